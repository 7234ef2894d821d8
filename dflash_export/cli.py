"""Command line of dflash_export: build, generate, check, engine, train-draft, bench.

User errors (:class:`DFlashError`) print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from dataclasses import fields
from pathlib import Path

from runtime.cli.generate import add_generate_arguments
from runtime.errors import DFlashError
from runtime.manifest import has_draft

# Each module has `register(subparsers)` adding its subcommand(s) with `set_defaults(func=...)`,
# where func(args) returns an exit status and raises DFlashError for user errors.
SUBCOMMAND_MODULES = ("dflash_export.check.parity", "dflash_export.trt.engine", "dflash_export.train.run", "dflash_export.eval.decoding.bench")


def cmd_build(args) -> int:
    from dflash_export.build import BuildOptions, build

    if args.engine == "trt":
        from dflash_export.trt.engine import require_tensorrt

        require_tensorrt(precision=args.precision, dtype=args.dtype)  # fail at once, before a long export, when TensorRT or a GPU is missing
    out = Path(args.out)
    before = _artifact_stamp(out)
    try:
        manifest = build(BuildOptions(**{f.name: getattr(args, f.name) for f in fields(BuildOptions) if hasattr(args, f.name)}))
    except KeyboardInterrupt:
        if _artifact_stamp(out) != before:  # the swap into place had happened: the build is not undone
            print(f"interrupted too late: {out} was already written (a complete artifact)", file=sys.stderr)
            return 130
        raise
    if args.engine == "trt":
        from dflash_export.trt.engine import build_engines

        manifest = build_engines(Path(args.out), precision=args.precision)
    print(build_summary(manifest, Path(args.out)))
    if not (Path(args.out) / "tokenizer" / "tokenizer.json").is_file():
        print("note: the target has no tokenizer files: the artifact takes token ids (`generate --prompt-ids`, "
              "Python), and `serve` needs a tokenizer", file=sys.stderr)
    if not has_draft(manifest):
        print("note: no DFlash draft: " + ("the target's MTP head drafts" if "mtp" in manifest else
              "the artifact decodes plain (no speculation)"), file=sys.stderr)
    elif not manifest["draft"]["trained"]:
        print("note: the draft is UNTRAINED (deterministic random init): output is exact but few proposals are "
              "accepted; pass --draft DIR for a trained draft", file=sys.stderr)
    return 0


def _artifact_stamp(out: Path) -> int | None:
    """The modification time (ns) of `out`'s manifest, None without one: a new value means a build
    swapped its artifact into place."""
    try:
        return (out / "manifest.json").stat().st_mtime_ns
    except OSError:
        return None


def build_summary(manifest: dict, out: Path) -> str:
    """build's last line: where the artifact is and what it holds (family, dtype, INT4 method, block and
    head, KV capacity, draft block, taps, export time)."""
    d, q = manifest["draft"], manifest.get("quantization")
    quant = f", int4 {q['method']} block {q['block']}{' + LM head' if q.get('lm_head') else ''}" if q else ""
    quant += (", batched graphs" if "draft_batched" in manifest else ", batched graph") if "target_batched" in manifest else ""
    return (f"wrote {out.resolve()} ({manifest['family']}, {manifest['dtype']}{quant}, max_seq_len "
            f"{manifest['max_seq_len']}, " + (f"block {d['block_size']}, taps {d['target_layer_ids']}, " if has_draft(manifest)
                                              else "no draft, ") + ("MTP head, " if "mtp" in manifest else "") +
            f"export {manifest['export_seconds']}s)")


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m dflash_export`."""
    p = argparse.ArgumentParser(prog="python -m dflash_export", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="export target + DFlash draft to an ONNX artifact directory")
    b.add_argument("--target", help="target directory or known name (default: embedded SmolLM2-135M-Instruct)")
    b.add_argument("--draft", help="draft directory, or none: no DFlash draft (default: the target's released or "
                                   "shipped draft; where there is none, an untrained draft, or no draft when the "
                                   "checkpoint has an MTP head)")
    b.add_argument("--out", default="artifacts/default", help="artifact directory (default: artifacts/default)")
    b.add_argument("--max-seq-len", type=int, default=2048, help="KV buffer capacity in tokens (default 2048)")
    b.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    b.add_argument("--draft-vocab", choices=["auto", "full"], default="auto",
                   help="auto: propose from the draft's draft_vocab.json when present (faster, same output); full: whole vocabulary")
    b.add_argument("--quant", choices=["none", "int4"], default="none",
                   help="int4: decoder linear layers as INT4 weight-only (W4A16) DequantizeLinear, opset 21")
    b.add_argument("--quant-block", type=int, help="with --quant int4: INT4 values per scale along K (default 32, or 16 where 32 does not "
                        "divide every quantized layer's K)")
    b.add_argument("--quant-method", choices=["rtn", "awq"], help="with --quant int4: rtn (round to nearest, default) or awq (activation-aware scales calibrated on models/prompts, folded in before rounding)")
    b.add_argument("--proposal-head", choices=["int4", "full"], default="full",
                   help="the proposal vocabulary's LM-head rows: full (default: the graph dtype) or int4 (they only "
                        "rank proposals, which the full head verifies, so output is unchanged)")
    b.add_argument("--quant-lm-head", action="store_true",
                   help="with --quant int4: the LM head too (a tied embedding keeps its table for lookups)")
    b.add_argument("--batched", action="store_true",
                   help="also export target_batched.onnx and draft_batched.onnx (reading the same weights files): "
                        "serve several clients at once (`python -m runtime serve --max-batch N`; Qwen3 / Llama targets)")
    b.add_argument("--no-mtp", dest="mtp", action="store_false",
                   help="leave out the target's multi-token-prediction head (exported as mtp.onnx whenever the "
                        "checkpoint has mtp.* tensors: Qwen3.5 / Qwen3.6)")
    b.add_argument("--engine", choices=["onnx", "trt"], default="onnx", help="trt: also build TensorRT engines (needs TensorRT + GPU)")
    b.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="fp16", help="TensorRT engine precision")
    b.set_defaults(func=cmd_build)

    g = sub.add_parser("generate", help="generate with speculative decoding from an artifact (also `python -m runtime generate`)")
    add_generate_arguments(g)
    for module in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 user error)."""
    args = make_parser().parse_args(argv)
    # SIGTERM (docker stop, schedulers) unwinds like Ctrl-C, so temporary outputs are removed.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return args.func(args)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

"""Peak memory and time of `build` (and `check`) on random-weight checkpoints of real model shapes.

Export must stay within the memory bound of issue 11 (peak RSS <= 1.25 x the weight bytes in the graph
dtype + 1 GiB) so that large targets export on ordinary machines. Per shape: a bf16 checkpoint written
once (`random_checkpoint`, kept in --work), then `build` (and `check`) as child processes, each child's
peak RSS (ru_maxrss, as `/usr/bin/time -v` reports it) against the bound. Exit status 1 when a step fails
or exceeds it.

    python scripts/export_memory.py --shapes qwen3-4b qwen3-8b [--work /tmp/export-memory] [--check]
    python scripts/export_memory.py --shapes ci --check          # the small shape the test suite uses
    python scripts/export_memory.py --shapes qwen3.5-4b --check  # a Qwen3.5 Gated DeltaNet hybrid
    python scripts/export_memory.py --shapes qwen3.8-27b --draft dflash2 [--layers 24] [--quant int4]
    python scripts/export_memory.py --shapes qwen3.8-27b --layers 12 --mtp  # + the multi-token-prediction head
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dflash_export.eval.scale.random_checkpoint import (
    QWEN3_VOCAB,
    SHAPES,
    dflash2_draft,
    qwen3_config,
    tensor_shapes,
    write_checkpoint,
)

GIB = 1 << 30
# Shapes besides the released ones. "ci" has ~200M parameters (~390 MB in fp16): big enough that a copy of
# the weights more than the bound allows shows above the fixed cost of torch and tracing.
EXTRA_SHAPES = {
    "ci": dict(hidden=1024, layers=6, heads=8, kv_heads=4, head_dim=128, intermediate=4096, tie=False, vocab=50000),
}


# Qwen3.5 hybrids (Qwen3_5ForCausalLM, every 4th layer full attention), sized as `memory_table.QWEN3_5`
# assumes them: layers, hidden, heads, head_dim and vocab published; intermediate, tying and the Gated
# DeltaNet head layout (transformers' Qwen3_5TextConfig defaults) assumed.
HYBRID_SHAPES = {
    "qwen3.5-4b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       intermediate_size=9216, vocab_size=248320, tie_word_embeddings=True),
    "qwen3.5-9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                       intermediate_size=12288, vocab_size=248320, tie_word_embeddings=False),
    # DFlash 2's released target: 64 layers, hidden 5120 and vocab 248320 published; Qwen3.5-27B's other
    # sizes (24 / 4 heads of 256, intermediate 17408, 48 value GDN heads) ASSUMED (`memory_table.QWEN3_5`)
    "qwen3.8-27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        intermediate_size=17408, vocab_size=248320, tie_word_embeddings=False, linear_num_value_heads=48),
}
_GDN_LAYOUT = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4)


def hybrid_checkpoint(name: str, layers: int | None = None, mtp: bool = False) -> tuple[dict, dict]:
    """(tensor shapes, config.json) of a Qwen3.5 hybrid shape (`layers`: another depth, every 4th layer
    still full attention; `mtp`: with a multi-token-prediction head): transformers' own module, built on
    the meta device (no memory), names the tensors, so the checkpoint is what `build` reads from a real one."""
    import torch
    import transformers

    cfg = transformers.Qwen3_5TextConfig(**{**_GDN_LAYOUT, **HYBRID_SHAPES[name],
                                            **({"num_hidden_layers": layers} if layers else {})})
    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    config = {**cfg.to_dict(), "architectures": ["Qwen3_5ForCausalLM"], "torch_dtype": "bfloat16"}
    if mtp:
        shapes.update(mtp_head_shapes(shapes, cfg.layer_types.index("full_attention"), cfg.hidden_size))
        config["mtp_num_hidden_layers"] = 1
    return shapes, config


def mtp_head_shapes(shapes: dict, full_layer: int, hidden: int) -> dict:
    """The `mtp.*` tensors of a released Qwen3.5 head (vLLM's `qwen3_5_mtp.py` names): `fc [d, 2d]`, three
    norms and one full-attention decoder layer, named after transformers' layer `full_layer` of `shapes`
    rather than `nn.mtp`'s module, so the checkpoint does not merely agree with the code that reads it."""
    prefix = f"model.layers.{full_layer}."
    head = {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": (hidden,),
            "mtp.pre_fc_norm_hidden.weight": (hidden,), "mtp.norm.weight": (hidden,)}
    head.update({"mtp.layers.0." + k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)})
    return head


def checkpoint_spec(name: str, layers: int | None = None, mtp: bool = False) -> tuple[dict, dict]:
    """(tensor shapes, config.json) of a named shape (`layers`: at another depth; `mtp`: a hybrid's with
    its multi-token-prediction head)."""
    if name in HYBRID_SHAPES:
        return hybrid_checkpoint(name, layers, mtp)
    if mtp:
        raise ValueError(f"{name} is no Qwen3.5 hybrid: only those carry a multi-token-prediction head")
    dims = {**shape_dims(name), **({"layers": layers} if layers else {})}
    return tensor_shapes(**dims), qwen3_config(**dims, dtype="bf16")


def shape_dims(name: str) -> dict:
    """Sizes of a named shape, with its vocabulary."""
    if name in EXTRA_SHAPES:
        return dict(EXTRA_SHAPES[name])
    return {**SHAPES[name], "vocab": QWEN3_VOCAB}


def weight_count(shapes: dict) -> int:
    """Parameters of a checkpoint of these tensor shapes."""
    total = 0
    for shape in shapes.values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def bound_bytes(weight_bytes: int) -> int:
    """The memory bound of issue 11: 1.25x the weights in the graph dtype plus 1 GiB."""
    return int(1.25 * weight_bytes) + GIB


# Runs `python -m MODULE ARGS` and, at exit, writes the process's own peak RSS (VmHWM, in KiB) to a file.
# The kernel's ru_maxrss of a child is no good here: at exec it keeps the high-water mark of the memory
# the child was forked with, i.e. the parent's size (a test worker holding models reads as that).
_PEAK_WRAPPER = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def record_peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(kib)
atexit.register(record_peak)
module = sys.argv.pop(1)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run_measured(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """Run `cmd` (`[python, "-m", module, *args]`); returns (exit status, wall seconds, peak RSS bytes of
    that process alone: its VmHWM where /proc has one, else the kernel's ru_maxrss)."""
    peak_file = Path(log).with_suffix(".peak")
    peak_file.unlink(missing_ok=True)
    wrapped = cmd
    if len(cmd) > 2 and cmd[1] == "-m" and Path("/proc/self/status").is_file():
        wrapped = [cmd[0], "-c", _PEAK_WRAPPER, str(peak_file), *cmd[2:]]
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(wrapped, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux
    if peak_file.is_file():
        peak = int(peak_file.read_text()) * 1024
    return proc.returncode, time.perf_counter() - t0, peak


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def ensure_checkpoint(work: Path, name: str, shapes: dict, config: dict) -> Path:
    ckpt = work / f"{name}-bf16"
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, shapes, "bf16", 0, 4.0, config)
    return ckpt


def measure_shape(work: Path, name: str, dtype: str, check: bool, max_seq_len: int, quant: str = "none",
                  quant_method: str = "rtn", layers: int | None = None, dflash2: bool = False,
                  mtp: bool = False) -> list[dict]:
    """Build (and check) one shape; returns one row per step. The bound stays that of the unquantized
    graph dtype for `quant="int4"` (the weights are quantized one tensor at a time). `layers`: the shape
    at another depth; `dflash2`: with a random DFlash 2 draft of the released layout (its weights count);
    `mtp`: a hybrid with its multi-token-prediction head, which `build` exports as `mtp.onnx` (its
    weights count; `mtp_bytes`: that graph and its data file)."""
    shapes, config = checkpoint_spec(name, layers, mtp)
    tag = (f"-{layers}l" if layers else "") + ("-mtp" if mtp else "")
    ckpt = ensure_checkpoint(work, name + tag, shapes, config)
    draft_args = []
    if dflash2:
        dshapes, dconfig = dflash2_draft(config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
                                         config["vocab_size"])
        draft_dir = ensure_checkpoint(work, name + tag + "-dflash2-draft", dshapes, dconfig)
        draft_args = ["--draft", str(draft_dir)]
        shapes = {**shapes, **{f"draft.{k}": v for k, v in dshapes.items()}}
    weight_bytes = weight_count(shapes) * (2 if dtype == "fp16" else 4)
    label = f"{dtype}{'-int4' if quant == 'int4' else ''}{'-awq' if quant == 'int4' and quant_method == 'awq' else ''}"
    art = work / f"{name}{tag}-{label}-artifact"
    py = sys.executable
    steps = [("build", [py, "-m", "dflash_export", "build", "--target", str(ckpt), "--out", str(art), *draft_args,
                        "--dtype", dtype, "--max-seq-len", str(max_seq_len), "--quant", quant]
              + (["--quant-method", quant_method] if quant == "int4" else []))]
    if check:
        steps.append(("check", [py, "-m", "dflash_export", "check", str(art)]))
    rows = []
    for step, cmd in steps:
        log = work / f"{name}{tag}-{label}-{step}.log"
        status, seconds, rss = run_measured(cmd, log)
        rows.append({
            "shape": name + tag, "step": step, "dtype": label, "status": status, "weight_bytes": weight_bytes,
            "peak_rss_bytes": rss, "ratio": rss / weight_bytes, "bound_bytes": bound_bytes(weight_bytes),
            "within_bound": rss <= bound_bytes(weight_bytes), "seconds": round(seconds, 1),
            "artifact_bytes": dir_bytes(art) if art.is_dir() else None, "log": str(log),
            "mtp_bytes": sum(f.stat().st_size for f in art.glob("mtp.onnx*")) if mtp and art.is_dir() else None,
        })
        if status != 0:
            break
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'shape':<20}{'dtype':<15}{'step':<7}{'weights':>10}{'peak RSS':>10}{'ratio':>7}{'bound':>9}  {'ok':<4}{'wall s':>8}{'artifact':>10}"
    lines = [head]
    for r in rows:
        art = f"{r['artifact_bytes'] / GIB:.2f}G" if r["artifact_bytes"] else "-"
        ok = "yes" if r["within_bound"] and r["status"] == 0 else ("FAIL" if r["status"] == 0 else f"rc{r['status']}")
        lines.append(f"{r['shape']:<20}{r['dtype']:<15}{r['step']:<7}{r['weight_bytes'] / GIB:>9.2f}G{r['peak_rss_bytes'] / GIB:>9.2f}G"
                     f"{r['ratio']:>7.2f}{r['bound_bytes'] / GIB:>8.2f}G  {ok:<4}{r['seconds']:>8.1f}{art:>10}"
                     + (f"  mtp.onnx {r['mtp_bytes'] / GIB:.2f}G" if r.get("mtp_bytes") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command line (`scripts/export_memory.py`); returns the exit status (1: a step failed or exceeded the bound)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3-4b", "qwen3-8b"], choices=[*SHAPES, *EXTRA_SHAPES, *HYBRID_SHAPES])
    p.add_argument("--work", type=Path, default=Path("/tmp/export-memory"), help="checkpoints, artifacts, logs")
    p.add_argument("--dtype", choices=["fp16", "fp32"], default="fp16")
    p.add_argument("--quant", choices=["none", "int4"], default="none", help="build --quant (default none)")
    p.add_argument("--quant-method", choices=["rtn", "awq"], default="rtn", help="with --quant int4 (default rtn)")
    p.add_argument("--check", action="store_true", help="also run `check` on each artifact")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("--layers", type=int, default=None,
                   help="build the shapes at this depth (a disk too small for the whole checkpoint and artifact)")
    p.add_argument("--draft", choices=["untrained", "dflash2"], default="untrained",
                   help="the draft: build's untrained DFlash one (default) or a random DFlash 2 of the released layout")
    p.add_argument("--mtp", action="store_true",
                   help="Qwen3.5 hybrids: the checkpoint carries a multi-token-prediction head (mtp.*), built as mtp.onnx")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error(f"--layers {args.layers} must be positive")
    if args.mtp and set(args.shapes) - set(HYBRID_SHAPES):
        p.error(f"--mtp needs Qwen3.5 hybrid shapes ({', '.join(HYBRID_SHAPES)})")
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes:
        rows += measure_shape(args.work, name, args.dtype, args.check, args.max_seq_len, args.quant, args.quant_method,
                              args.layers, args.draft == "dflash2", args.mtp)
        print(format_rows(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    failed = [r for r in rows if r["status"] != 0 or not r["within_bound"]]
    for r in failed:
        print(f"{r['shape']} {r['step']}: {'exit status ' + str(r['status']) if r['status'] else 'above the bound'}; "
              f"see {r['log']}", file=sys.stderr)
    return 1 if failed else 0

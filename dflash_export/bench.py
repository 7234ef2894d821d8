"""`bench`: plain vs speculative decoding on the same engines, plus the PyTorch loop baseline.

For every prompt of a JSONL set (default: the held-out `models/prompts/eval.jsonl`), one process runs:
plain decoding (block size 1) and speculative decoding on the artifact's graphs, and optionally the
straightforward PyTorch loop (Hugging Face target + PyTorch draft). It reports per prompt and overall:
tau (mean and histogram), tokens/s, speedup, the split of decode time into draft, verify and host
overhead, prefill time, and the verify-cost curve (target call time against proposals verified).
Prompts are wrapped in the model's chat template as one user turn when it has one. Writes
`bench.json` and `bench.png`; `--save-verify-len` stores the suggested verify length in the artifact.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from runtime.errors import DFlashError

DEFAULT_EVAL = Path(__file__).resolve().parent.parent / "models" / "prompts" / "eval.jsonl"


def verify_cost_curve(sess, past_len: int = 256, reps: int = 7) -> dict:
    """Wall time (ms) of one target call verifying n proposals (n = 0..block_size-1) at a fixed past
    length, and of one draft call; the basis for choosing `verify_len`.

    Each point is the fastest of `reps` timed calls: other load on the machine only ever adds time, so
    the minimum is the least disturbed estimate of a call's cost. The calls run in rounds, each round
    one call per n in shuffled order (after one warm-up round), so load that comes and goes during the
    measurement disturbs all points alike instead of tilting the curve."""
    be = sess.backend
    b = sess.block_size
    past_len = min(past_len, sess.max_seq_len - b - 1)
    be.write(sess.input_ids.rows(0, 1), np.array([1], np.int64))
    order = list(range(b))
    shuffle = np.random.default_rng(0)
    best = {n: float("inf") for n in order}
    for rnd in range(reps + 1):
        shuffle.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            sess._target(1, n, past_len)
            if rnd:
                best[n] = min(best[n], time.perf_counter() - t0)
    curve = {n: 1000 * best[n] for n in range(b)}
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        sess._draft(1, past_len, b)
        times.append(time.perf_counter() - t0)
    return {"past_len": past_len, "verify_ms": curve, "draft_ms": 1000 * min(times[1:])}


def curve_inversions(verify_ms: dict, tolerance: float = 0.10, floor_ms: float = 0.05) -> list[tuple[int, int]]:
    """Pairs (n, m), 1 <= n < m, where verifying m proposals measured faster than verifying n by more
    than `tolerance` (fraction) and `floor_ms`. On onnxruntime CPU a verify of more rows never costs
    less, so such pairs mean the timing was disturbed (a loaded machine, frequency changes) and a
    verify length chosen from it is unreliable. (n = 0, plain decoding, is never a suggestion; TensorRT
    profiles tuned for the full block can legitimately invert, so bench only warns there.)"""
    points = sorted((int(n), float(v)) for n, v in verify_ms.items() if int(n) >= 1)
    return [(n, m) for i, (n, vn) in enumerate(points) for m, vm in points[i + 1 :]
            if vm < vn - max(tolerance * vn, floor_ms)]


def best_verify_len(curve: dict, acceptance_rate_by_pos: list[float]) -> tuple[int, float]:
    """Pick the verify length maximising expected tokens per second from the measured curve.

    Args:
        curve: from :func:`verify_cost_curve`.
        acceptance_rate_by_pos: P(proposal j accepted | all before accepted), j = 0.., measured
            with full verification.

    Returns:
        (verify_len, expected tokens per ms).
    """
    best = (0, 0.0)
    for n in range(1, len(curve["verify_ms"])):
        expected, alive = 1.0, 1.0
        for j in range(n):
            alive *= acceptance_rate_by_pos[j] if j < len(acceptance_rate_by_pos) else 0.0
            expected += alive
        rate = expected / (curve["verify_ms"][n] + curve["draft_ms"])
        if rate > best[1]:
            best = (n, rate)
    return best


def _positional_acceptance(steps: list[dict]) -> list[float]:
    reached, accepted = Counter(), Counter()
    for s in steps:
        n = len(s["proposed"])
        for j in range(min(s["accepted"] + 1, n)):
            reached[j] += 1
            if j < s["accepted"]:
                accepted[j] += 1
    return [accepted[j] / reached[j] if reached[j] else 0.0 for j in range(max(reached) + 1 if reached else 0)]


def run_bench(args) -> int:
    """Run the benchmark (see module docstring); returns the exit status."""
    import runtime

    from .train import read_prompts

    if args.verify_len is not None and args.verify_len < 1:
        raise DFlashError(f"--verify-len must be at least 1 (got {args.verify_len}); omit it to verify all proposals")
    if args.save_verify_len and args.verify_len is not None:
        raise DFlashError("--save-verify-len needs a run that verifies all proposals: drop --verify-len")
    if args.limit is not None and args.limit < 1:
        raise DFlashError(f"--limit must be at least 1 (got {args.limit})")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    sess = runtime.load(args.artifact, backend=args.backend)
    if args.save_verify_len:
        _check_writable(Path(args.artifact))  # before the run, not after minutes of benchmarking
    prompts = read_prompts(Path(args.prompts))
    if args.limit:
        by_cat = defaultdict(list)
        for p in prompts:
            by_cat[p["category"]].append(p)
        prompts = [p for rows in by_cat.values() for p in rows[: args.limit]]
    b = sess.block_size if args.block_size is None else args.block_size
    if not 1 <= b <= sess.max_block:
        raise DFlashError(f"--block-size must be between 1 and {sess.max_block} (got {b})")
    if args.verify_len is not None and args.verify_len > max(b - 1, 1):
        raise DFlashError(f"--verify-len must be at most block size - 1 = {max(b - 1, 1)} (got {args.verify_len})")
    if args.save_verify_len and b != sess.block_size:
        raise DFlashError(f"--save-verify-len needs the draft's own block size {sess.block_size} (got --block-size {b}): "
                          "the saved length applies to that block")
    chat = bool(sess.tokenizer is not None and sess.tokenizer.chat_template)  # instruct models: one user turn
    encoded = [sess.encode(p["prompt"], chat=chat) for p in prompts]
    too_long = [f"{p['id']} ({len(ids)})" for p, ids in zip(prompts, encoded) if len(ids) + args.max_new_tokens > sess.max_seq_len]
    if too_long:  # checked up front: one long prompt must not end the run after the others have been timed
        raise DFlashError(f"{len(too_long)} prompt(s) plus --max-new-tokens {args.max_new_tokens} exceed the artifact's "
                          f"max_seq_len {sess.max_seq_len}: {', '.join(too_long[:5])}{' ...' if len(too_long) > 5 else ''} "
                          "(prompt tokens in brackets); drop them, lower --max-new-tokens or rebuild with a larger --max-seq-len")
    out = Path(args.out)
    try:  # before the run: an unusable --out must not cost a whole benchmark
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DFlashError(f"--out {out}: cannot create that directory ({exc.strerror or exc})") from None
    torch_ctx = _torch_baseline(sess) if args.torch_baseline else None
    # warm-up: first calls allocate onnxruntime arenas
    sess.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[], block_size=b)
    rows = []
    for i, (p, ids) in enumerate(zip(prompts, encoded)):
        plain = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=1)
        # verify all proposals unless told otherwise (not the artifact's saved default): the positional
        # acceptance behind the suggested verify_len needs full verification
        spec = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=b, verify_len=args.verify_len or max(b - 1, 1),
                             record_steps=True)
        row = {
            "id": p["id"],
            "category": p["category"],
            "prompt_tokens": len(ids),
            "new_tokens": len(spec.output_ids),
            "lossless_match": spec.output_ids == plain.output_ids,
            "plain": _timing(plain),
            "spec": _timing(spec),
            "acceptance_lengths": spec.acceptance_lengths,
            "tau": spec.tau,
            "positional_acceptance": _positional_acceptance(spec.steps),
        }
        row["speedup"] = row["spec"]["decode_tokens_per_s"] / row["plain"]["decode_tokens_per_s"] if row["plain"]["decode_tokens_per_s"] else 0.0
        if torch_ctx is not None:
            res = torch_ctx(ids, args.max_new_tokens, b)
            row["torch"] = {"seconds": res["seconds"], "tokens_per_s": len(res["output_ids"]) / res["seconds"], "tau": float(np.mean(res["acceptance_lengths"])) if res["acceptance_lengths"] else 1.0, "match": res["output_ids"] == spec.output_ids}
        rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {p['id']}: tau {row['tau']:.2f}, plain {row['plain']['decode_tokens_per_s']:.1f} tok/s, "
              f"spec {row['spec']['decode_tokens_per_s']:.1f} tok/s, x{row['speedup']:.2f}", file=sys.stderr, flush=True)
    curve = verify_cost_curve(sess)
    report = _summarise(rows, curve, b, args, sess)
    # written whole: a kill mid-write must not leave a truncated bench.json beside an older bench.png
    (out / ".bench.json.tmp").write_text(json.dumps(report, indent=2))
    _plot(report, out / ".bench.tmp.png")
    (out / ".bench.json.tmp").replace(out / "bench.json")
    (out / ".bench.tmp.png").replace(out / "bench.png")
    _print_table(report)
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    inversions = curve_inversions(report["verify_cost_curve"]["verify_ms"])
    if inversions:
        n, m = inversions[0]
        print(f"warning: the verify-cost curve is noisy ({len(inversions)} inversions, e.g. verifying {m} proposals "
              f"measured faster than {n}); the machine was probably busy. Rerun on an idle machine before trusting "
              "the suggested verify_len.", file=sys.stderr)
    if args.save_verify_len:
        if inversions and args.backend == "ort":
            raise DFlashError("not saving decoding.verify_len from a noisy verify-cost curve (see the warning above); "
                              "rerun `bench --save-verify-len` on an idle machine")
        save_verify_len(Path(args.artifact), report)
        print(f"saved decoding.verify_len = {report['suggested_verify_len']} in {Path(args.artifact) / 'manifest.json'} "
              "(the default of generate on this artifact; pass --verify-len to override)")
    return 0


def save_verify_len(artifact_dir: Path, report: dict) -> None:
    """Store the bench's suggested verify length as the artifact's default (`manifest["decoding"]`).

    The suggestion is a measurement of this machine and backend (verify-cost curve x the draft's
    positional acceptance on the bench prompts), recorded with them; the manifest is replaced atomically.

    Raises:
        DFlashError: the report has no suggestion (no proposals were verified), or the manifest cannot
            be read or replaced.
    """
    import os
    import platform

    from .engine import write_atomic

    n = int(report.get("suggested_verify_len") or 0)
    if n < 1 or not report.get("positional_acceptance"):
        raise DFlashError("the bench measured no accepted proposals, so it suggests no verify length; nothing saved")
    path = Path(artifact_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise DFlashError(f"cannot read {path}: {exc.strerror or exc}; nothing saved") from None
    manifest["decoding"] = {
        "verify_len": n,
        "measured_by": "python -m dflash_export bench --save-verify-len",
        "backend": report["backend"],
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "verify_cost_ms": report["verify_cost_curve"]["verify_ms"],
        "positional_acceptance": report["positional_acceptance"],
    }
    try:
        write_atomic(path, json.dumps(manifest, indent=2).encode())
    except OSError as exc:
        raise DFlashError(f"cannot write {path}: {exc.strerror or exc}; nothing saved") from None


def _check_writable(artifact_dir: Path) -> None:
    """Refuse up front when the manifest could not be replaced: try creating a file next to it (os.access
    says yes to root even on read-only mounts).

    Raises:
        DFlashError: the artifact directory does not accept new files."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=artifact_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise DFlashError(f"--save-verify-len: cannot write in {artifact_dir} ({exc.strerror or exc}); "
                          "fix the permissions or drop the option") from None


def _timing(res) -> dict:
    decode = res.draft_s + res.verify_s + res.host_s
    return {
        "tokens": len(res.output_ids),
        "tokens_per_s": res.tokens_per_s,
        "decode_tokens_per_s": res.decode_tokens_per_s,
        "prefill_s": res.prefill_s,
        "draft_s": res.draft_s,
        "verify_s": res.verify_s,
        "host_s": res.host_s,
        "host_fraction": res.host_s / decode if decode else 0.0,
        "steps": len(res.acceptance_lengths) if res.acceptance_lengths else max(len(res.output_ids) - 1, 0),
    }


def _summarise(rows, curve, b, args, sess) -> dict:
    def agg(subset):
        plain_t = sum(r["plain"]["draft_s"] + r["plain"]["verify_s"] + r["plain"]["host_s"] for r in subset)
        spec_t = sum(r["spec"]["draft_s"] + r["spec"]["verify_s"] + r["spec"]["host_s"] for r in subset)
        plain_n = sum(r["plain"]["tokens"] - 1 for r in subset)
        spec_n = sum(r["spec"]["tokens"] - 1 for r in subset)
        acc = [a for r in subset for a in r["acceptance_lengths"]]
        out = {
            "prompts": len(subset),
            "tau": float(np.mean(acc)) if acc else 1.0,
            "plain_tokens_per_s": plain_n / plain_t if plain_t else 0.0,
            "spec_tokens_per_s": spec_n / spec_t if spec_t else 0.0,
            "draft_fraction": sum(r["spec"]["draft_s"] for r in subset) / spec_t if spec_t else 0.0,
            "verify_fraction": sum(r["spec"]["verify_s"] for r in subset) / spec_t if spec_t else 0.0,
            "host_fraction": sum(r["spec"]["host_s"] for r in subset) / spec_t if spec_t else 0.0,
            "prefill_s_mean": float(np.mean([r["spec"]["prefill_s"] for r in subset])),
            "lossless_matches": sum(r["lossless_match"] for r in subset),
        }
        out["speedup"] = out["spec_tokens_per_s"] / out["plain_tokens_per_s"] if out["plain_tokens_per_s"] else 0.0
        if subset and "torch" in subset[0]:
            torch_t = sum(r["torch"]["seconds"] for r in subset)
            torch_n = sum(r["new_tokens"] for r in subset)
            out["torch_loop_tokens_per_s"] = torch_n / torch_t if torch_t else 0.0
            spec_total = sum(r["new_tokens"] / r["spec"]["tokens_per_s"] for r in subset if r["spec"]["tokens_per_s"])
            out["spec_end_to_end_tokens_per_s"] = torch_n / spec_total if spec_total else 0.0
            out["speedup_vs_torch_loop"] = out["spec_end_to_end_tokens_per_s"] / out["torch_loop_tokens_per_s"] if out["torch_loop_tokens_per_s"] else 0.0
        return out

    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    hist = Counter(a for r in rows for a in r["acceptance_lengths"])
    pos = defaultdict(list)
    for r in rows:
        for j, v in enumerate(r["positional_acceptance"]):
            pos[j].append(v)
    pos_rate = [float(np.mean(pos[j])) for j in sorted(pos)]
    best = best_verify_len(curve, pos_rate) if pos_rate else (None, 0.0)  # plain decoding: nothing to suggest
    return {
        "artifact": str(args.artifact),
        "backend": args.backend,
        "block_size": b,
        "verify_len": args.verify_len,
        "max_new_tokens": args.max_new_tokens,
        "draft_trained": sess.manifest["draft"]["trained"],
        "overall": agg(rows),
        "by_category": {c: agg(v) for c, v in sorted(cats.items())},
        "tau_histogram": {int(k): v for k, v in sorted(hist.items())},
        "positional_acceptance": pos_rate,
        "verify_cost_curve": curve,
        "suggested_verify_len": best[0],
        "prompts": rows,
    }


def _print_table(report: dict) -> None:
    print(f"\n{'category':<18}{'n':>4}{'tau':>7}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'host %':>8}")
    for name, s in [*report["by_category"].items(), ("overall", report["overall"])]:
        print(f"{name:<18}{s['prompts']:>4}{s['tau']:>7.2f}{s['plain_tokens_per_s']:>13.1f}{s['spec_tokens_per_s']:>12.1f}"
              f"{s['speedup']:>9.2f}{100 * s['host_fraction']:>8.1f}")
    o = report["overall"]
    if "torch_loop_tokens_per_s" in o:
        print(f"PyTorch loop {o['torch_loop_tokens_per_s']:.1f} tok/s vs this runtime {o['spec_end_to_end_tokens_per_s']:.1f} tok/s "
              f"(x{o['speedup_vs_torch_loop']:.2f}, end to end incl. prefill)")
    c = report["verify_cost_curve"]
    print("verify cost (ms) by proposals verified: " + ", ".join(f"{n}:{v:.1f}" for n, v in c["verify_ms"].items())
          + f"; draft {c['draft_ms']:.1f} ms; suggested verify_len {report['suggested_verify_len']}")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    hist = report["tau_histogram"]
    axes[0].bar(list(hist.keys()), list(hist.values()))
    axes[0].set(title=f"tokens per step (tau {report['overall']['tau']:.2f})", xlabel="acc + 1", ylabel="steps")
    cats = list(report["by_category"])
    axes[1].bar(cats, [report["by_category"][c]["speedup"] for c in cats])
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(title="speedup over plain decoding", ylabel="x")
    axes[1].tick_params(axis="x", rotation=30)
    curve = report["verify_cost_curve"]
    axes[2].plot([int(k) for k in curve["verify_ms"]], list(curve["verify_ms"].values()), marker="o")
    axes[2].set(title=f"verify cost (past {curve['past_len']})", xlabel="proposals verified", ylabel="ms per target call")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _torch_baseline(sess):
    """Build the PyTorch loop (HF target + PyTorch draft) from the artifact's source checkpoints."""
    import torch
    from transformers import AutoModelForCausalLM

    from .build import prepare_pair
    from .modules import DFlashDraft, load_weights
    from .torch_loop import torch_spec_generate

    src = sess.manifest["sources"]
    tspec, dspec, _tstate, dstate, _ = prepare_pair(src["target"]["path"], src["draft"]["path"])
    model = AutoModelForCausalLM.from_pretrained(src["target"]["path"], dtype=torch.float32, trust_remote_code=False).eval()
    draft = DFlashDraft(dspec).eval()
    load_weights(draft, dstate, "draft")

    def run(ids, max_new, b):
        return torch_spec_generate(model, draft, ids, max_new, b, dspec.mask_token_id, sess.stop_token_ids)

    return run


def register(sub) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser("bench", help="benchmark plain vs speculative decoding (and the PyTorch loop)")
    p.add_argument("artifact", help="artifact directory written by build")
    p.add_argument("--prompts", default=str(DEFAULT_EVAL), help="JSONL prompts (default: models/prompts/eval.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt and run (default 128)")
    p.add_argument("--block-size", type=int, default=None, help="speculative block size (default: the draft's)")
    p.add_argument("--verify-len", type=int, default=None, help="proposals verified per step (default: all)")
    p.add_argument("--backend", default="ort", help="ort (default), ort-cuda or trt")
    p.add_argument("--no-torch-baseline", dest="torch_baseline", action="store_false",
                   help="skip timing the PyTorch loop (Hugging Face target + PyTorch draft)")
    p.add_argument("--save-verify-len", action="store_true",
                   help="store the suggested verify_len in the artifact's manifest as generate's default on it")
    p.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png (default: bench-out)")
    p.set_defaults(func=run_bench)

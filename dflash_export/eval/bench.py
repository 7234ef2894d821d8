"""`bench`: plain decoding against speculative policies on the same engines, plus the PyTorch loop.

For every prompt of a JSONL set (default: the held-out `models/prompts/eval.jsonl`), one process runs
in turn: plain decoding (block size 1), then each speculative policy of `--policies` ("auto", the
default of generate, and fixed verify lengths), and optionally the straightforward PyTorch loop
(Hugging Face target + PyTorch draft). It reports per policy, per category and overall: tau, tokens/s
and the speedup over plain, the split of decode time into draft, verify and host work, the measured
step costs auto chose from, the verify-cost curve, and decode tokens/s at long past lengths. Prompts
are wrapped in the model's chat template as one user turn when it has one. Writes `bench.json` and
`bench.png`.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from runtime.graphs.costs import measurement_points
from runtime.errors import DFlashError
from runtime.graphs.tree import parse_tree
from dflash_export.build import prepare_pair
from dflash_export.eval.torch_loop import torch_spec_generate
from dflash_export.nn.draft import DFlashDraft
from dflash_export.nn.layers import load_weights
from dflash_export.train.data import first_per_category, read_prompts
from runtime.graphs.costs import COSTS_ENV

DEFAULT_EVAL = Path(__file__).resolve().parents[2] / "models" / "prompts" / "eval.jsonl"
DEFAULT_PAST_LENGTHS = (128, 512, 1024, 2000)


def eval_prompts(path: Path, limit: int | None) -> list[str]:
    """Prompt texts of the eval set, at most `limit` per category, in file order."""
    out, seen = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        cat = row.get("category", "")
        if limit is None or seen.get(cat, 0) < limit:
            seen[cat] = seen.get(cat, 0) + 1
            out.append(row["prompt"])
    return out


def verify_cost_curve(sess, past_len: int = 256, reps: int = 7) -> dict:
    """Wall time (ms) of one target call verifying n proposals (n = 0..block_size-1) at a fixed past
    length, and of one draft call returning all block_size - 1 rows (`draft_ms`) and one row
    (`draft_1row_ms`: a 1-proposal step's draft, its last layer cut to that row where the graph allows).

    Each point is the fastest of `reps` timed calls: other load on the machine only ever adds time, so
    the minimum is the least disturbed estimate of a call's cost. The calls run in rounds, each round
    one call per n in shuffled order (after one warm-up round), so load that comes and goes during the
    measurement disturbs all points alike instead of tilting the curve."""
    b = sess.block_size
    past_len = min(past_len, sess.max_seq_len - b - 1)
    sess.backend.write(sess.input_ids.rows(0, 1), np.array([1], np.int64))
    order = list(range(b))
    shuffle = np.random.default_rng(0)
    best = {n: float("inf") for n in order}
    for rnd in range(reps + 1):
        shuffle.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            sess.run_target(1, n, past_len)
            if rnd:
                best[n] = min(best[n], time.perf_counter() - t0)
    curve = {n: 1000 * best[n] for n in range(b)}
    times = {b - 1: [], 1: []}
    for _ in range(reps + 1):
        for rows in times:
            t0 = time.perf_counter()
            sess.run_draft(1, past_len, b, rows=rows)
            times[rows].append(time.perf_counter() - t0)
    sess.reset()  # the calls above wrote over the cached context
    return {"past_len": past_len, "verify_ms": curve, "draft_ms": 1000 * min(times[b - 1][1:]),
            "draft_1row_ms": 1000 * min(times[1][1:])}


def curve_inversions(verify_ms: dict, tolerance: float = 0.10, floor_ms: float = 0.05) -> list[tuple[int, int]]:
    """Pairs (n, m), 1 <= n < m, where verifying m proposals measured faster than verifying n by more
    than `tolerance` (fraction) and `floor_ms`. On onnxruntime CPU a verify of more rows never costs
    less, so such pairs mean the timing was disturbed (a loaded machine, frequency changes). (TensorRT
    profiles tuned for the full block can legitimately invert, so bench only warns.)"""
    points = sorted((int(n), float(v)) for n, v in verify_ms.items() if int(n) >= 1)
    return [(n, m) for i, (n, vn) in enumerate(points) for m, vm in points[i + 1 :]
            if vm < vn - max(tolerance * vn, floor_ms)]


def parse_policies(text: str, block_size: int) -> list[str]:
    """`--policies` ("auto,1,3,15,1+3") -> policy labels; fixed lengths must be 1..block_size-1, a fixed
    verify tree "L+A" (`runtime.graphs.tree`) L in that range and A in 1..3.

    Raises:
        DFlashError: an empty list, a repeated entry or an entry that is neither auto nor a valid length.
    """
    labels = [t.strip() for t in text.split(",") if t.strip()]
    if not labels:
        raise DFlashError("--policies is empty; give e.g. auto,1,3,15")
    if len(set(labels)) != len(labels):
        raise DFlashError(f"--policies {text!r} repeats an entry")
    for label in labels:
        if "+" in label:  # a fixed verify tree
            try:
                ok = parse_tree(label).length <= block_size - 1
            except ValueError:
                ok = False
        else:
            ok = label == "auto" or (label.isdigit() and 1 <= int(label) <= block_size - 1)
        if not ok:
            raise DFlashError(f"--policies entry {label!r} must be auto, a verify length from 1 to block size - 1 = "
                              f"{block_size - 1}, or a verify tree L+A (A from 1 to 3, e.g. 1+3)")
    return labels


def positional_acceptance(steps: list[dict]) -> list[float]:
    """P(proposal j accepted | proposals 0..j-1 accepted), j = 0.., from `record_steps` steps: the
    draft's, so lookup steps (`runtime.speculation.lookup`) are left out."""
    reached, accepted = Counter(), Counter()
    for s in steps:
        if s.get("lookup"):
            continue
        n = len(s["proposed"])
        for j in range(min(s["accepted"] + 1, n)):
            reached[j] += 1
            if j < s["accepted"]:
                accepted[j] += 1
    return [accepted[j] / reached[j] if reached[j] else 0.0 for j in range(max(reached) + 1 if reached else 0)]


def _check_args(args, sess) -> tuple[int, list[str]]:
    if args.limit is not None and args.limit < 1:
        raise DFlashError(f"--limit must be at least 1 (got {args.limit})")
    if args.max_new_tokens < 1:
        raise DFlashError(f"--max-new-tokens must be at least 1 (got {args.max_new_tokens})")
    b = sess.block_size if args.block_size is None else args.block_size
    if not 1 <= b <= sess.max_block:
        raise DFlashError(f"--block-size must be between 1 and {sess.max_block} (got {b})")
    if b == 1:
        return b, []
    if args.policies is None:  # auto beside the lengths auto measures: 1, 3, 7, ..., b - 1, and a tree
        return b, ["auto"] + [str(n) for n in measurement_points(b)[1:]] + (["1+3"] if sess.verifies_trees else [])
    return b, parse_policies(args.policies, b)


def parse_past_lengths(text: str) -> list[int]:
    """`--past-lengths` ("128,512") -> ints >= 1 ('' -> none).

    Raises:
        DFlashError: an entry that is not a positive integer."""
    out = []
    for t in (x.strip() for x in text.split(",")):
        if not t:
            continue
        if not t.isdigit() or int(t) < 1:
            raise DFlashError(f"--past-lengths entry {t!r} must be a positive integer (e.g. 128,512,1024,2000)")
        out.append(int(t))
    return out


def run_bench(args) -> int:
    """Run the benchmark (see module docstring); returns the exit status."""
    import os
    import tempfile

    import runtime


    if args.fresh_costs:  # a first-time user's run: auto measures the step costs itself
        os.environ[COSTS_ENV] = tempfile.mkdtemp(prefix="dflash-bench-costs-")
    sess = runtime.load(args.artifact, backend=args.backend, int4_accuracy_level=args.int4_accuracy_level)
    b, policies = _check_args(args, sess)
    past_lengths = parse_past_lengths(args.past_lengths)
    prompts = first_per_category(read_prompts(Path(args.prompts)), args.limit)
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
    torch_ctx = None
    if args.torch_baseline and sess.recurrent is not None:
        # Hugging Face's cache crops attention K/V but cannot roll a Gated DeltaNet state back
        print("bench: no PyTorch loop baseline for a hybrid (Qwen3.5) target: Hugging Face's cache cannot roll back "
              "its recurrent state after a rejected proposal (skipped; --no-torch-baseline silences this)")
    elif args.torch_baseline:
        torch_ctx = _torch_baseline(sess)
    t0 = time.perf_counter()
    costs = sess.policy(b).costs if "auto" in policies else None  # as generate does on first use
    costs_s = time.perf_counter() - t0
    sess.generate([1, 2, 3], max_new_tokens=4, stop_token_ids=[], block_size=b, verify_len=max(b - 1, 1), reuse_prefix=False)  # warm-up
    rows = [_bench_prompt(sess, p, ids, args, b, policies, torch_ctx) for p, ids in zip(prompts, encoded)]
    curve = verify_cost_curve(sess)
    report = _summarise(rows, curve, b, policies, args, sess)
    if costs is not None:
        report["step_costs"] = {"step_ms": costs.step_ms, "past_len": costs.past_len, "seconds_to_load_or_measure": costs_s}
    if past_lengths:
        report["long_context"] = long_context(sess, encoded, past_lengths, b)
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
              f"measured faster than {n}); the machine was probably busy: rerun on an idle machine.", file=sys.stderr)
    return 0


def _bench_prompt(sess, p: dict, ids: list[int], args, b: int, policies: list[str], torch_ctx) -> dict:
    """Plain, then every policy, on one prompt (interleaved per prompt, so drifting load hits all alike)."""
    plain = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=1, reuse_prefix=False)
    row = {"id": p["id"], "category": p["category"], "prompt_tokens": len(ids), "plain": _timing(plain), "policies": {}}
    for label in policies:
        res = sess.generate(ids, max_new_tokens=args.max_new_tokens, block_size=b, record_steps=True,
                            verify_len=None if label == "auto" else label if "+" in label else int(label),
                            reuse_prefix=False)
        row["policies"][label] = {
            **_timing(res),
            "lossless_match": res.output_ids == plain.output_ids,
            "acceptance_lengths": res.acceptance_lengths,
            "tau": res.tau,
            "lookup_steps": res.lookup_steps,
            "verify_lens": [len(s["proposed"]) for s in res.steps],
            "positional_acceptance": positional_acceptance(res.steps),
            "speedup": res.decode_tokens_per_s / plain.decode_tokens_per_s if plain.decode_tokens_per_s else 0.0,
        }
    if torch_ctx is not None:
        res = torch_ctx(ids, args.max_new_tokens, b)
        ref = row["policies"][policies[0]] if policies else row["plain"]
        row["torch"] = {"seconds": res["seconds"], "tokens_per_s": len(res["output_ids"]) / res["seconds"],
                        "tau": float(np.mean(res["acceptance_lengths"])) if res["acceptance_lengths"] else 1.0,
                        "match": res["output_ids"] == plain.output_ids, "spec_tokens_per_s": ref["tokens_per_s"]}
    shown = ", ".join(f"{k} x{v['speedup']:.2f}" for k, v in row["policies"].items())
    print(f"{p['id']}: plain {row['plain']['decode_tokens_per_s']:.1f} tok/s; {shown}", file=sys.stderr, flush=True)
    return row


def long_context(sess, encoded: list[list[int]], past_lengths: list[int], b: int, new_tokens: int = 32) -> list[dict]:
    """Decode tokens/s at each past length (plain and auto), on a prompt of that many tokens made by
    concatenating the benchmark prompts. Lengths that do not fit the artifact's max_seq_len are skipped."""
    stream = [t for ids in encoded for t in ids]
    out = []
    for past in past_lengths:
        if past + new_tokens > sess.max_seq_len or past < 1:
            continue
        ids = (stream * (past // max(len(stream), 1) + 1))[:past]
        plain = sess.generate(ids, max_new_tokens=new_tokens, block_size=1, stop_token_ids=[], reuse_prefix=False)
        spec = sess.generate(ids, max_new_tokens=new_tokens, block_size=b, stop_token_ids=[], reuse_prefix=False) if b > 1 else plain
        out.append({"past_len": past, "plain_tokens_per_s": plain.decode_tokens_per_s,
                    "plain_ms_per_step": 1000 * (plain.verify_s + plain.host_s) / max(len(plain.output_ids) - 1, 1),
                    "auto_tokens_per_s": spec.decode_tokens_per_s, "auto_tau": spec.tau,
                    "lossless_match": spec.output_ids == plain.output_ids})
    return out


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


def _decode_s(t: dict) -> float:
    return t["draft_s"] + t["verify_s"] + t["host_s"]


def _aggregate(subset: list[dict], policies: list[str]) -> dict:
    """Totals over prompts: tokens after the first / decode time, per policy, and the speedups."""
    plain_t = sum(_decode_s(r["plain"]) for r in subset)
    plain_rate = sum(r["plain"]["tokens"] - 1 for r in subset) / plain_t if plain_t else 0.0
    out = {"prompts": len(subset), "plain_tokens_per_s": plain_rate, "plain_prefill_s_mean": float(np.mean([r["plain"]["prefill_s"] for r in subset])), "policies": {}}
    for label in policies:
        runs = [r["policies"][label] for r in subset]
        t = sum(_decode_s(x) for x in runs)
        rate = sum(x["tokens"] - 1 for x in runs) / t if t else 0.0
        acc = [a for x in runs for a in x["acceptance_lengths"]]
        lens = [n for x in runs for n in x["verify_lens"]]
        out["policies"][label] = {
            "tokens_per_s": rate,
            "speedup": rate / plain_rate if plain_rate else 0.0,
            "tau": float(np.mean(acc)) if acc else 1.0,
            "plain_step_fraction": lens.count(0) / len(lens) if lens else 0.0,
            "lookup_step_fraction": sum(x["lookup_steps"] for x in runs) / len(lens) if lens else 0.0,
            "mean_verify_len": float(np.mean(lens)) if lens else 0.0,
            "draft_fraction": sum(x["draft_s"] for x in runs) / t if t else 0.0,
            "verify_fraction": sum(x["verify_s"] for x in runs) / t if t else 0.0,
            "host_fraction": sum(x["host_s"] for x in runs) / t if t else 0.0,
            "lossless_matches": sum(x["lossless_match"] for x in runs),
        }
    if subset and "torch" in subset[0]:
        torch_t = sum(r["torch"]["seconds"] for r in subset)
        n = sum(r["plain"]["tokens"] for r in subset)
        spec_total = sum(r["plain"]["tokens"] / r["torch"]["spec_tokens_per_s"] for r in subset if r["torch"]["spec_tokens_per_s"])
        out["torch_loop_tokens_per_s"] = n / torch_t if torch_t else 0.0
        out["spec_end_to_end_tokens_per_s"] = n / spec_total if spec_total else 0.0
        out["speedup_vs_torch_loop"] = out["spec_end_to_end_tokens_per_s"] / out["torch_loop_tokens_per_s"] if out["torch_loop_tokens_per_s"] else 0.0
    return out


def _summarise(rows, curve, b, policies, args, sess) -> dict:
    cats = defaultdict(list)
    for r in rows:
        cats[r["category"]].append(r)
    full = str(b - 1) if str(b - 1) in policies else None  # positional acceptance needs full verification
    pos = defaultdict(list)
    for r in rows:
        for j, v in enumerate(r["policies"][full]["positional_acceptance"] if full else []):
            pos[j].append(v)
    first = policies[0] if policies else None
    hist = Counter(a for r in rows for a in (r["policies"][first]["acceptance_lengths"] if first else []))
    return {
        "artifact": str(args.artifact),
        "backend": args.backend,
        "block_size": b,
        "policies": policies,
        "max_new_tokens": args.max_new_tokens,
        "draft_trained": sess.manifest["draft"]["trained"],
        "overall": _aggregate(rows, policies),
        "by_category": {c: _aggregate(v, policies) for c, v in sorted(cats.items())},
        "tau_histogram": {"policy": first, **{int(k): v for k, v in sorted(hist.items())}},
        "positional_acceptance": [float(np.mean(pos[j])) for j in sorted(pos)],
        "verify_cost_curve": curve,
        "prompts": rows,
    }


def _print_table(report: dict) -> None:
    policies = report["policies"]
    print(f"\n{'category':<18}{'n':>4}{'plain tok/s':>13}" + "".join(f"{'x ' + p:>10}" for p in policies)
          + (f"{'tau auto':>10}{'plain %':>9}" if "auto" in policies else ""))
    for name, s in [*report["by_category"].items(), ("overall", report["overall"])]:
        line = f"{name:<18}{s['prompts']:>4}{s['plain_tokens_per_s']:>13.1f}"
        line += "".join(f"{s['policies'][p]['speedup']:>10.2f}" for p in policies)
        if "auto" in policies:
            a = s["policies"]["auto"]
            line += f"{a['tau']:>10.2f}{100 * a['plain_step_fraction']:>9.1f}"
        print(line)
    o = report["overall"]
    bad = {p: o["prompts"] - v["lossless_matches"] for p, v in o["policies"].items() if v["lossless_matches"] < o["prompts"]}
    print("speculative == plain on every prompt" if not bad else f"speculative != plain on some prompts: {bad}")
    if "torch_loop_tokens_per_s" in o:
        print(f"PyTorch loop {o['torch_loop_tokens_per_s']:.1f} tok/s vs this runtime {o['spec_end_to_end_tokens_per_s']:.1f} tok/s "
              f"(x{o['speedup_vs_torch_loop']:.2f}, end to end incl. prefill)")
    if "step_costs" in report:
        c = report["step_costs"]
        print("auto's step costs (ms) by proposals verified: " + ", ".join(f"{n}:{v:.1f}" for n, v in c["step_ms"].items())
              + f" (past {c['past_len']}; loaded or measured in {c['seconds_to_load_or_measure']:.2f} s)")
    c = report["verify_cost_curve"]
    print("target call (ms) by proposals verified: " + ", ".join(f"{n}:{v:.1f}" for n, v in c["verify_ms"].items())
          + f"; draft call {c['draft_ms']:.1f} ms ({c.get('draft_1row_ms', c['draft_ms']):.1f} ms for 1 row)")
    for row in report.get("long_context", []):
        print(f"past {row['past_len']:>5}: plain {row['plain_tokens_per_s']:.1f} tok/s ({row['plain_ms_per_step']:.1f} ms/step), "
              f"auto {row['auto_tokens_per_s']:.1f} tok/s (tau {row['auto_tau']:.2f})")


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    hist = {k: v for k, v in report["tau_histogram"].items() if k != "policy"}
    axes[0].bar(list(hist.keys()), list(hist.values()))
    axes[0].set(title=f"tokens per step ({report['tau_histogram']['policy']})", xlabel="acc + 1", ylabel="steps")
    cats = list(report["by_category"])
    width = 0.8 / max(len(report["policies"]), 1)
    for i, pol in enumerate(report["policies"]):
        axes[1].bar([c + i * width for c in range(len(cats))], [report["by_category"][c]["policies"][pol]["speedup"] for c in cats],
                    width, label=pol)
    axes[1].set_xticks(range(len(cats)), cats, rotation=30)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    if report["policies"]:
        axes[1].legend(title="verify")
    axes[1].set(title="speedup over plain decoding", ylabel="x")
    curve = report["verify_cost_curve"]
    axes[2].plot([int(k) for k in curve["verify_ms"]], list(curve["verify_ms"].values()), marker="o")
    axes[2].set(title=f"target call cost (past {curve['past_len']})", xlabel="proposals verified", ylabel="ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _torch_baseline(sess):
    """Build the PyTorch loop (HF target + PyTorch draft) from the artifact's source checkpoints."""
    import torch
    from transformers import AutoModelForCausalLM


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
    p.add_argument("--policies", default=None,
                   help="speculative policies run after plain on each prompt, comma-separated: auto and/or fixed "
                        "verify lengths, and verify trees L+A (e.g. 1+3; default: auto,1,3,7,...,block size - 1, and 1+3 where "
                        "the target verifies trees)")
    p.add_argument("--fresh-costs", action="store_true",
                   help="measure auto's step costs anew in this run (a first-time user's run) instead of the user cache")
    p.add_argument("--past-lengths", default=",".join(map(str, DEFAULT_PAST_LENGTHS)),
                   help="decode tok/s at these past lengths, plain and auto (default 128,512,1024,2000; '' skips)")
    p.add_argument("--backend", default="ort", help="ort (default), ort-cuda or trt")
    p.add_argument("--int4-accuracy-level", type=int, choices=(1, 4), default=None,
                   help="INT4 artifacts on onnxruntime CPU: 4 = int8 activations (default where the target is "
                        "row-exact: lossless and faster), 1 = fp32 compute")
    p.add_argument("--no-torch-baseline", dest="torch_baseline", action="store_false",
                   help="skip timing the PyTorch loop (Hugging Face target + PyTorch draft)")
    p.add_argument("--out", default="bench-out", help="directory for bench.json and bench.png (default: bench-out)")
    p.set_defaults(func=run_bench)

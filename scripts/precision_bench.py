"""Decode speed of several artifacts of one target (fp32, fp16, int4 ...), interleaved prompt by prompt.

    python scripts/precision_bench.py artifacts/fp32 artifacts/int4 [--limit 2] [--max-new-tokens 96]
           [--verify-len 2] [--repeats 2]

For every held-out prompt (models/prompts/eval.jsonl, `--limit` per category, chat template) each
artifact runs plain decoding (block size 1) and speculative decoding (its draft, `--verify-len`) in
turn, so machine noise hits them alike. Prints decode tokens/s (median over prompts and repeats), tau,
and each artifact's speed relative to the first. Same greedy prompts for all, torch-free runtime.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    import runtime
    from dflash_export.eval.bench import eval_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--prompts", type=Path, default=ROOT / "models" / "prompts" / "eval.jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts per category (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--verify-len", type=int, default=2, help="proposals verified per speculative step (default 2)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    sessions = {a: runtime.load(a) for a in args.artifacts}
    prompts = eval_prompts(args.prompts, args.limit)
    rates = {(a, mode): [] for a in args.artifacts for mode in ("plain", "spec")}
    taus = {a: [] for a in args.artifacts}
    for sess in sessions.values():  # warm-up: first calls allocate
        sess.generate(prompts[0], chat=True, max_new_tokens=8, block_size=1, reuse_prefix=False)
    for _ in range(args.repeats):
        for prompt in prompts:
            for a, sess in sessions.items():
                plain = sess.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, block_size=1, reuse_prefix=False)
                spec = sess.generate(prompt, chat=True, max_new_tokens=args.max_new_tokens, verify_len=args.verify_len, reuse_prefix=False)
                rates[(a, "plain")].append(plain.tokens_per_s)
                rates[(a, "spec")].append(spec.tokens_per_s)
                taus[a].append(spec.tau)
    first = args.artifacts[0]
    base = statistics.median(rates[(first, "plain")])
    print(f"{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, greedy, verify-len {args.verify_len}")
    print(f"{'artifact':<40}{'size MB':>9}{'plain tok/s':>13}{'spec tok/s':>12}{'tau':>6}{'plain vs first':>16}")
    for a in args.artifacts:
        size = sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) / 1e6
        pl, sp = statistics.median(rates[(a, "plain")]), statistics.median(rates[(a, "spec")])
        print(f"{str(a):<40}{size:>9.0f}{pl:>13.1f}{sp:>12.1f}{statistics.mean(taus[a]):>6.2f}{pl / base:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

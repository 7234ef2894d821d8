"""Default `generate` (auto speculation) against plain decoding, as a Python user runs them.

    python scripts/auto_vs_plain.py ARTIFACT [--limit 10] [--repeats 3] [--max-new-tokens 128]

One fresh Session with an empty step-cost cache (so the first auto call measures the costs itself, as
on a new device), held-out prompts (models/prompts/eval.jsonl, chat template), greedy. Per prompt,
`--repeats` rounds of one plain and one default generate, the order alternating round by round and
prompt by prompt (on this machine whichever runs second tends to be faster). A prompt's ratio is its
median plain decode time over its median auto decode time: a median over rounds drops the runs a
neighbour on this shared machine slowed down (about +-10% on a 1.5 s run), which a single pair cannot.
Prints, per category and overall, the median of the prompts' ratios, "total" (summed median plain
time / summed median auto time) and a 90% bootstrap interval of the median over prompts, and checks
auto == plain ids.

`--control` runs plain decoding in both arms (an A/A run): its ratios show how far this machine's noise
alone moves a category's median, the floor under any "never below x" reading of the real run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict

import numpy as np


def interval(ratios: list[float], rng: np.random.Generator, draws: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the median of `ratios` (resampling prompts)."""
    x = np.asarray(ratios)
    medians = np.median(x[rng.integers(0, len(x), (draws, len(x)))], axis=1)
    return float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def report(label: str, rows: list[tuple[float, float]], rng: np.random.Generator) -> str:
    """One line: median ratio, total and interval over `rows` of (plain s, auto s) per prompt."""
    ratios = [p / a for p, a in rows]
    lo, hi = interval(ratios, rng)
    total = sum(p for p, _ in rows) / sum(a for _, a in rows)
    return f"{label:16s} median {np.median(ratios):.3f}  total {total:.3f}  90% [{lo:.3f}, {hi:.3f}]  prompts {len(rows)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--limit", type=int, default=10, help="prompts per category")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of plain + auto per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--control", action="store_true", help="plain decoding in both arms (A/A: the noise floor)")
    args = ap.parse_args()
    from runtime.graphs.costs import COSTS_ENV

    os.environ[COSTS_ENV] = tempfile.mkdtemp(prefix="dflash-costs-")  # a device seen for the first time
    import runtime
    from dflash_export.eval.bench import DEFAULT_EVAL
    from dflash_export.train.data import first_per_category, read_prompts

    sess = runtime.load(args.artifact)
    prompts = first_per_category(read_prompts(DEFAULT_EVAL), args.limit)
    rows, mismatches, taus = defaultdict(list), 0, []
    for i, p in enumerate(prompts):
        ids = sess.encode(p["prompt"], chat=True)
        times = {"plain": [], "auto": []}
        for rnd in range(args.repeats):
            for kind in (("plain", "auto") if (i + rnd) % 2 == 0 else ("auto", "plain")):
                r = sess.generate(ids, max_new_tokens=args.max_new_tokens, reuse_prefix=False,
                                  block_size=1 if kind == "plain" or args.control else None)
                n = len(r.output_ids) - 1
                times[kind].append(n / r.decode_tokens_per_s if n >= 1 else 0.0)
                if kind == "plain":
                    plain_ids = r.output_ids
                else:
                    auto_ids, taus = r.output_ids, taus + [r.tau]
            mismatches += plain_ids != auto_ids
        tp, ta = float(np.median(times["plain"])), float(np.median(times["auto"]))
        if tp > 0 and ta > 0:
            rows[p["category"]].append((tp, ta))
            print(f"{p['id']}: auto/plain {tp / ta:.3f} (plain {tp:.2f} s, auto {ta:.2f} s, tau {taus[-1]:.2f})",
                  file=sys.stderr, flush=True)
    rng = np.random.default_rng(0)
    for category, r in rows.items():
        print(report(category, r, rng))
    print(report("overall", [x for r in rows.values() for x in r], rng))
    print(f"auto != plain in {mismatches} of {len(prompts) * args.repeats} pairs; mean tau {np.mean(taus):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Default `generate` (auto speculation) against plain decoding, as a Python user runs them.

    python scripts/auto_vs_plain.py ARTIFACT [--limit 10] [--repeats 2] [--max-new-tokens 128]

One fresh Session with an empty step-cost cache (so the first auto call measures the costs itself, as
on a new device), held-out prompts (models/prompts/eval.jsonl, chat template), greedy. Per prompt
and repeat, one plain and one default generate, in alternating order (plain first on even pairs,
auto first on odd ones: on this machine whichever runs second tends to be faster). Prints the
auto/plain decode-speed ratio per category (median of the pairs), overall (median of all pairs)
and "total" (summed plain decode time / summed auto decode time), and checks auto == plain ids.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--limit", type=int, default=10, help="prompts per category")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    from runtime.call_costs import COSTS_ENV

    os.environ[COSTS_ENV] = tempfile.mkdtemp(prefix="dflash-costs-")  # a device seen for the first time
    import runtime
    from dflash_export.bench import DEFAULT_EVAL
    from dflash_export.train_data import first_per_category, read_prompts

    sess = runtime.load(args.artifact)
    prompts = first_per_category(read_prompts(DEFAULT_EVAL), args.limit)
    ratios, plain_s, auto_s, mismatches, pair = defaultdict(list), 0.0, 0.0, 0, 0
    for rep in range(args.repeats):
        for p in prompts:
            ids = sess.encode(p["prompt"], chat=True)
            runs = {}
            for kind in (("plain", "auto") if pair % 2 == 0 else ("auto", "plain")):
                runs[kind] = sess.generate(ids, max_new_tokens=args.max_new_tokens, reuse_prefix=False,
                                           block_size=1 if kind == "plain" else None)
            pair += 1
            plain, auto = runs["plain"], runs["auto"]
            mismatches += plain.output_ids != auto.output_ids
            n = len(plain.output_ids) - 1
            if n < 1:
                continue
            tp, ta = n / plain.decode_tokens_per_s, n / auto.decode_tokens_per_s
            plain_s, auto_s = plain_s + tp, auto_s + ta
            ratios[p["category"]].append(tp / ta)
            print(f"{p['id']} rep {rep}: auto/plain {tp / ta:.3f} (tau {auto.tau:.2f})", file=sys.stderr, flush=True)
    every = [r for rs in ratios.values() for r in rs]
    print(" ".join(f"{c} {np.median(rs):.3f}" for c, rs in ratios.items()) +
          f" | overall {np.median(every):.3f} total {plain_s / auto_s:.3f} | pairs {len(every)}, "
          f"auto != plain in {mismatches}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

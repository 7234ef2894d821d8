"""Verify-cost curves of several artifacts, measured in one process (onnxruntime, CPU).

For each artifact: the fastest of --reps calls (run in rounds, shuffled order) of one target call verifying n
proposals (n = 0..block_size-1) at past length 256, greedy as the runtime binds it, and of one draft call; then each artifact's curve as a ratio
to the first one's. Used to measure graph changes (e.g. a draft vocabulary) against a baseline artifact.

    python scripts/verify_cost.py BASELINE_ARTIFACT OTHER_ARTIFACT [...] [--reps 7]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> int:
    import runtime
    from dflash_export.eval.bench import verify_cost_curve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--past", type=int, default=256)
    args = ap.parse_args()
    curves = []
    for art in args.artifacts:
        sess = runtime.load(art)
        curves.append(verify_cost_curve(sess, past_len=args.past, reps=args.reps))
    base = curves[0]
    ns = sorted(base["verify_ms"])
    print("proposals  " + "  ".join(f"{Path(a).name[:14]:>14s}" for a in args.artifacts))
    for n in ns:
        cells = [f"{c['verify_ms'][n]:8.1f} ms" + (f" {c['verify_ms'][n] / base['verify_ms'][n]:4.2f}x" if i else "      ")
                 for i, c in enumerate(curves)]
        print(f"{n:9d}  " + "  ".join(f"{x:>14s}" for x in cells))
    print("draft call " + "  ".join(f"{c['draft_ms']:11.1f} ms" for c in curves))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

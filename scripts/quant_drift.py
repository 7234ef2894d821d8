"""How far quantized artifacts drift from the full-precision one: teacher-forced top-1 agreement and KL.

    python scripts/quant_drift.py REFERENCE_ART QUANTIZED_ART... [--limit 2] [--max-new-tokens 64]
                                  [--int4-accuracy-level 1|4]

The measurement is `dflash_export.check.drift` (also `check DIR --drift-reference REF`): held-out prompts
(models/prompts/eval.jsonl, `--limit` per category), the reference's greedy continuation, then every
artifact teacher-forced over it one token per call; top-1 agreement with the reference and mean
KL(reference || artifact) in nats. Quantized artifacts run as the runtime runs them by default (INT4:
MatMulNBits at level 4 where the target is row-exact) unless `--int4-accuracy-level` says otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv=None) -> int:
    import runtime
    from dflash_export.check.drift import DEFAULT_PROMPTS, measure_drift, prompt_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reference", help="full-precision artifact (the drift is measured from it)")
    p.add_argument("quantized", nargs="+", help="artifacts of the same target to compare")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--int4-accuracy-level", type=int, choices=(1, 4), help="default: the runtime's")
    args = p.parse_args(argv)
    try:
        ref = runtime.load(args.reference)
        others = {d: runtime.load(d, int4_accuracy_level=args.int4_accuracy_level) for d in args.quantized}
        rows = measure_drift(ref, others, prompt_ids(ref, args.prompts, args.limit), args.max_new_tokens)
    except runtime.DFlashError as exc:
        raise SystemExit(f"quant_drift: {exc}") from None
    print(f"reference {args.reference}, {args.max_new_tokens} teacher-forced positions a prompt")
    print(f"{'artifact':<40}{'level':>6}{'top-1 agreement':>17}{'mean KL (nats)':>16}")
    for r in rows:
        print(f"{r.artifact:<40}{str(r.int4_accuracy_level or '-'):>6}{r.top1_agreement:>17.4f}{r.mean_kl:>16.5f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Is an INT4 target graph's output independent of how the rows are split into calls?

    python scripts/int4_split_check.py ARTIFACT [--levels 1 4] [--past 40] [--proposals 3]

Prints, per MatMulNBits accuracy level, the max abs differences `dflash_export.check.row_split.check`
measures (its docstring says what each column compares). Measurements: docs/performance.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import runtime
from dflash_export.check.row_split import COLUMNS, check


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4], help="MatMulNBits accuracy levels")
    p.add_argument("--past", type=int, default=40, help="prefilled past length")
    p.add_argument("--proposals", type=int, default=3)
    args = p.parse_args(argv)
    try:
        manifest = runtime.manifest.load_manifest(args.artifact)
    except runtime.DFlashError as exc:
        raise SystemExit(f"int4_split_check: {exc}") from None
    if not manifest.get("quantization"):
        print(f"{args.artifact} is not an INT4 artifact: the accuracy level does not apply (fp32/fp16 compute)")
    cols = COLUMNS
    print(f"{'level':>5} " + " ".join(f"{c:>19}" for c in cols))
    for level in args.levels:
        d = check(args.artifact, level, args.past, args.proposals)
        print(f"{level:>5} " + " ".join(f"{d[c]:>19.2e}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

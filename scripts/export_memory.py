#!/usr/bin/env python3
"""Peak memory and time of `build` and `check` on random-weight checkpoints of real shapes.

The command line of `dflash_export.eval.scale.export_memory` (whose docstring says how and why):

    python scripts/export_memory.py --help
"""

import sys

from dflash_export.eval.scale.export_memory import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/export_memory.py"))

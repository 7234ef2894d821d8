#!/usr/bin/env python3
"""Device memory of a DFlash pair at fp16 or INT4, and which Jetson devices it fits.

The command line of `dflash_export.eval.scale.memory_table` (whose docstring says how and why):

    python scripts/memory_table.py --help
"""

import sys

from dflash_export.eval.scale.memory_table import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/memory_table.py"))

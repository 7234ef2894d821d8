#!/usr/bin/env python3
"""Write a random-weight Hugging Face checkpoint with the shape of a real Qwen3 target.

The command line of `dflash_export.eval.scale.random_checkpoint` (whose docstring says how and why):

    python scripts/make_random_checkpoint.py --help
"""

import sys

from dflash_export.eval.scale.random_checkpoint import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/make_random_checkpoint.py"))

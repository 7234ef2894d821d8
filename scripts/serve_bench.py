#!/usr/bin/env python3
"""Streaming through the OpenAI-compatible server against the in-process runtime, and KV reuse in chat.

The command line of `dflash_export.eval.serving.serve_bench` (whose docstring says how and why):

    python scripts/serve_bench.py --help
"""

import sys

from dflash_export.eval.serving.serve_bench import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/serve_bench.py"))

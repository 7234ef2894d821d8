#!/usr/bin/env python3
"""Plain greedy decode speed and memory of our artifacts against the peers (onnxruntime-genai, llama.cpp).

The command line of `dflash_export.eval.peers.peer_bench` (whose docstring says how and why; its workers,
`dflash_export/eval/peers/peer_workers.py`, run in the peers' own interpreters):

    python scripts/peer_bench.py --help
"""

import sys

from dflash_export.eval.peers.peer_bench import main

if __name__ == "__main__":
    sys.exit(main(prog="scripts/peer_bench.py"))

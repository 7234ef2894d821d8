"""`python -m dflash_export`: see dflash_export.cli."""

import os
import signal
import sys

from dflash_export.cli import main


def _finished(signum, frame):
    # a Ctrl-C while the interpreter winds down (a second or so with torch loaded) is not lost silently
    print("interrupted too late: the command had already finished (its output is complete)", file=sys.stderr, flush=True)
    os._exit(130)


status = main()
signal.signal(signal.SIGINT, _finished)
sys.exit(status)

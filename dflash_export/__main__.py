"""`python -m dflash_export`: see dflash_export.cli."""

import importlib.util
import os
import signal
import sys


def _finished(signum, frame):
    # a Ctrl-C while the interpreter winds down (a second or so with torch loaded) is not lost silently
    print("interrupted too late: the command had already finished (its output is complete)", file=sys.stderr, flush=True)
    os._exit(130)


def _has_torch() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


if not _has_torch():  # a runtime-only install (`pip install .`, a Jetson)
    if sys.argv[1:2] == ["generate"]:  # the same command as `python -m runtime generate`
        from runtime.__main__ import main as runtime_main

        sys.exit(runtime_main(sys.argv[1:]))
    print("error: the exporter needs torch and the export extra: pip install '.[export]' (torch: the CPU or CUDA "
          "build you want). Without them the runtime works: python -m runtime generate|chat|serve", file=sys.stderr)
    sys.exit(2)

from dflash_export.cli import main  # noqa: E402

status = main()
signal.signal(signal.SIGINT, _finished)
sys.exit(status)

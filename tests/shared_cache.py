"""Directories built once per test run and shared by every pytest-xdist worker.

Under `pytest -n N` each worker is its own process, so a session fixture runs once PER WORKER: every
tiny export the suite shares (and the SmolLM2 export) would be built N times. `shared_dir` builds a
directory once per run instead: the first worker to ask builds it under an exclusive file lock, the
others wait for that lock and reuse the result. Without xdist it is an ordinary per-session cache.

Where: each worker's basetemp is `<run root>/popen-gwN` (a subdirectory of the controlling process's
basetemp), so the run root is unique to one run and visible to all of its workers; pytest's own
clean-up of old basetemps removes it later.

Tests must treat shared directories as read-only (copy one to change it): other tests, in this worker
or the other, read the same files.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

def run_root(tmp_path_factory) -> Path:
    """The directory shared by all workers of this test run (the basetemp itself without xdist)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER") and base.name.startswith("popen-"):
        return base.parent
    return base


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another worker builds; released on close (or death)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_dir(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """`<run root>/shared/<name>`, an empty directory filled by `make(path)` once per test run.

    `<name>.done` beside it is written last: a failed (or killed) `make` leaves none, so the next caller,
    in any worker, starts over and fails with the same error in its own test, not a confusing one later."""
    root = run_root(tmp_path_factory) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    path, done = root / name, root / f"{name}.done"
    with _locked(root / f"{name}.lock"):
        if not done.is_file():
            if path.exists():
                shutil.rmtree(path)
            path.mkdir()
            make(path)
            done.touch()
    return path

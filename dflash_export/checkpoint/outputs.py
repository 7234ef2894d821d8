"""Output directories written whole or not at all: checked before any work, assembled in a temporary
sibling, swapped into place in one rename (build's artifacts, converted checkpoints)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from runtime.errors import DFlashError


def check_output_dir(out: Path, overwrite: bool = True, markers: tuple[str, ...] = ("manifest.json",),
                     kind: str = "dflash_export artifact", allowed: tuple[str, ...] | None = None) -> None:
    """Refuse an output location the atomic rename cannot serve, before any work is done. A directory
    that exists may only be replaced if it holds one of `markers` (an earlier output of the same
    command, `kind`) and, when `allowed` is given, no entry outside it, or nothing: never a user's
    other files.

    Raises:
        DFlashError: `out` is a file, a mount point, an existing directory without `overwrite`, a
            non-empty directory without any of `markers` or with entries outside `allowed`, or its
            parent is not writable.
    """
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} is a file; choose a directory path")
    if out.exists() and not overwrite:
        raise DFlashError(f"{out} exists; remove it or pass --overwrite")
    if out.is_dir() and os.path.ismount(out):
        raise DFlashError(f"--out {out} is a mount point, which cannot be replaced atomically; use a subdirectory of it")
    if out.is_dir() and any(out.iterdir()):
        others = sorted(p.name for p in out.iterdir() if allowed is not None and p.name not in allowed)
        if others or not any((out / m).exists() for m in markers):
            raise DFlashError(f"{out} exists and is not a {kind}{f' (it holds {others[:3]})' if others else ''}; "
                              "choose another --out")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DFlashError(f"cannot write to {parent}; choose a writable --out")


@contextmanager
def staged_directory(out: Path, kind: str = "an output") -> Iterator[Path]:
    """A temporary sibling of `out` to write into. When the block ends normally it replaces `out`
    (the previous `out`, if any, is moved aside first, put back if the swap fails, and removed only
    once the new one is in place); when it raises (Ctrl-C included) it is removed and `out` is as
    it was. The directory is made readable by others (an output is meant to be shared). `kind` names
    the output in the error.

    Raises:
        DFlashError: the parent of `out` cannot be written, or the swap fails.
    """
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as exc:
        raise DFlashError(f"cannot write {kind} under {out.parent} ({exc.strerror or exc}); choose a writable --out "
                          "directory") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        replace_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_directory(new: Path, out: Path) -> None:
    """Rename directory `new` to `out`, replacing an existing `out` (see :func:`staged_directory`).

    Raises:
        DFlashError: a rename fails (the previous `out` is put back).
    """
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    try:
        out.rename(old / out.name)
        new.rename(out)
    except OSError as exc:
        if (old / out.name).exists() and not out.exists():
            (old / out.name).rename(out)  # put the previous output back
        raise DFlashError(f"cannot replace {out}: {exc}") from None
    finally:
        shutil.rmtree(old, ignore_errors=True)

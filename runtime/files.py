"""File helpers shared by the runtime and the exporter: whole-file replacement and the user cache.

Both are torch-free so the runtime can use them on a device; `dflash_export` imports them from here
(one atomic write for the whole project).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CACHE_ENV = "DFLASH_EXPORT_CACHE"


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one rename (readers see the old or the new file, never a part).

    The temporary file lives beside `path` (a rename is atomic only within one file system) and gets
    mode 0644 like the rest of an artifact (mkstemp would leave 0600).

    Raises:
        OSError: the directory does not accept new files (nothing is left behind).
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(name, 0o644)
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def cache_dir() -> Path:
    """The user cache directory: `$DFLASH_EXPORT_CACHE`, else `$XDG_CACHE_HOME/dflash_export`, else
    `~/.cache/dflash_export` (not created here)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash_export"

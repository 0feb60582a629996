"""Files a crash cannot leave half-written.

``atomic_write`` writes to a temporary file beside the target, fsyncs it, renames it over the
target (``os.replace`` is atomic within a directory) and fsyncs the directory, so a reader, or
a run resumed after a SIGKILL or a power cut, sees the old content or the new, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Replace ``path``'s content with ``data`` (text is UTF-8) all at once."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make a rename in the directory ``path`` durable (best effort: some file systems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

"""Atomic file replacement: readers see the old file or the new one, never a half-written one."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist a rename: on POSIX the directory entry is only durable once the directory is synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms without directory fds (Windows): best effort
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    """A sibling temp name unique per process, so concurrent writers never share a temp file."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write tmp, fsync, os.replace, fsync the folder: survives a crash or power loss at any point."""
    path = Path(path)
    tmp = tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)

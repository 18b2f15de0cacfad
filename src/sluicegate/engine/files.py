"""Files the engines keep in their cache directory, written so that a reader (or a
concurrent writer: another replica on the machine) never sees a half-written one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(target: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path in the target's directory (its name ending in ``suffix``), renamed
    over the target on success and removed otherwise."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shareable data
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextmanager
def one_at_a_time(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` (created if need be) for the block: processes
    that would make the same cache entry make it one after another, and the later ones
    find it made.  Where the lock cannot be created (a read-only cache), no lock."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")  # noqa: SIM115 - held for the block, closed below
    except OSError:
        yield
        return
    with handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield

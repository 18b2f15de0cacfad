"""Where the background-job journal lives.

A configured ``journal_path`` is used as given.  Without one, every start uses the same
file, ``<cache_dir>/jobs.sqlite3`` (default ``~/.cache/sluicegate/jobs.sqlite3``), so a
restart replays what a crash left and starts leave no litter behind.  The running server
holds an exclusive lock on it (``jobs.sqlite3.lock``, released when the process ends,
however it ends): a second server started on the same machine with the default finds it
locked and journals its jobs in a temporary file instead, which it deletes when it
stops, and says so in its log.  (Two servers must not share a journal: each requeues the
other's running jobs at start.)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_JOURNAL_NAME = "jobs.sqlite3"


@dataclass(slots=True)
class JournalLocation:
    """The journal file this server uses, and what to undo when it stops."""

    path: Path
    #: A temporary journal: its directory is deleted by :meth:`release`.
    temporary: bool = False
    _lock_fd: int | None = None

    def release(self) -> None:
        """Let go of the default journal's lock, or delete a temporary journal."""
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None
        if self.temporary:
            shutil.rmtree(self.path.parent, ignore_errors=True)


def claim_journal(journal_path: str | None, cache_dir: str | None) -> JournalLocation:
    """The journal to open: ``journal_path``, else the default one if no other server on
    this machine holds it, else a temporary one."""
    if journal_path:
        return JournalLocation(Path(journal_path).expanduser())
    base = Path(cache_dir).expanduser() if cache_dir else Path.home() / ".cache" / "sluicegate"
    path = base / DEFAULT_JOURNAL_NAME
    base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base / f"{DEFAULT_JOURNAL_NAME}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        temporary = Path(tempfile.mkdtemp(prefix="sluicegate-jobs-")) / DEFAULT_JOURNAL_NAME
        logger.warning(
            "job journal %s is in use by another server on this machine: this one journals "
            "background jobs in %s, deleted when it stops (set journal_path to keep them)",
            path,
            temporary,
        )
        return JournalLocation(temporary, temporary=True)
    return JournalLocation(path, _lock_fd=fd)

"""Where the job journal lives: one default file reused by every start, locked while a
server runs; a temporary one for a second server, deleted when it stops."""

from __future__ import annotations

from pathlib import Path

from sluicegate.queue.journal_location import claim_journal


def test_the_default_journal_is_one_file_and_a_second_server_gets_a_temporary_one(
    tmp_path: Path,
) -> None:
    first = claim_journal(None, str(tmp_path))
    assert first.path == tmp_path / "jobs.sqlite3" and not first.temporary
    second = claim_journal(None, str(tmp_path))  # the first server still runs
    assert second.temporary and second.path.parent != tmp_path
    second.path.write_bytes(b"jobs")
    second.release()
    assert not second.path.parent.exists()
    first.release()
    again = claim_journal(None, str(tmp_path))  # the next start reuses the same file
    assert again.path == first.path and not again.temporary
    again.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.sqlite3.lock"]


def test_a_configured_journal_is_used_as_given(tmp_path: Path) -> None:
    location = claim_journal(str(tmp_path / "mine.db"), str(tmp_path / "cache"))
    assert location.path == tmp_path / "mine.db" and not location.temporary
    location.release()
    assert not (tmp_path / "cache").exists()

"""The ``sluicegate`` command line: every setting a whole, readable flag."""

from __future__ import annotations

from typer.testing import CliRunner

from sluicegate.cli import _cli_type, app
from sluicegate.config import Settings


def test_serve_help_shows_every_flag_whole_at_80_columns() -> None:
    result = CliRunner().invoke(
        app, ["serve", "--help"], env={"COLUMNS": "80"}, prog_name="sluicegate"
    )
    assert result.exit_code == 0, result.output
    help_text = result.output
    flags = [
        f"--{name.replace('_', '-')}"
        for name, field in Settings.model_fields.items()
        if _cli_type(name, field.annotation) is not None
    ]
    assert len(flags) > 50
    words = set(help_text.replace("/", " ").split())
    missing = [flag for flag in flags if flag not in words]
    assert not missing, missing
    for name in ("SLUICEGATE_MAX_REQUEST_BODY_BYTES", "SLUICEGATE_BREAKER_QUEUE_WAIT_SHED_SECONDS"):
        assert name in help_text
    assert "…" not in help_text
    assert max(len(line) for line in help_text.splitlines()) <= 80

"""What every ``sluicegate bench`` command shares: the ``--out`` option and failing with a
message."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console

OutOption = Annotated[
    Path, typer.Option("--out", help="Directory for results.json, summary.md and PNG plots.")
]


def console() -> Console:
    from rich.console import Console

    return Console(stderr=True)


def fail(message: str) -> NoReturn:
    console().print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(2)

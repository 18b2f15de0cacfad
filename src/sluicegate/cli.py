"""The ``sluicegate`` command.

``serve`` takes every setting as a flag (:mod:`sluicegate.serve_flags`). ``bench`` is
loaded only when it runs: the load generator is an extra (``sluicegate[bench]``), and
neither ``serve`` nor ``--help`` should pay for importing it.
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
import typer.main
import yaml
from pydantic import ValidationError
from typer.core import TyperCommand, TyperGroup

from sluicegate.serve_flags import SettingsHelpCommand, serve_signature

if TYPE_CHECKING:
    # The types of the hooks overridden below. typer vendors click there (only the names
    # are used: every method called is click's long-standing public API).
    from typer._click import Command, Context

#: The modules of the bench extra's distributions (pyproject.toml's ``bench``), checked
#: before ``sluicegate bench`` loads, so a missing one is told as such.
BENCH_EXTRA_MODULES = ("matplotlib", "rich", "h11", "jsonschema")
#: The modules of the torch extra's distributions (pyproject.toml's ``torch``): the
#: embedded engine's.
TORCH_EXTRA_MODULES = ("torch", "gguf")
#: ``sluicegate bench``'s line in ``sluicegate --help`` (the bench's own help says the same).
BENCH_HELP = "Load generator: open-loop arrivals, slow readers, disconnects, capacity search."
#: Help is wrapped to the terminal, but never wider than this (click's own cap, 80, wraps
#: ``serve``'s ninety settings onto a fifth more lines).
HELP_MAX_WIDTH = 100


def require_extra(extra: str, modules: Sequence[str], needed_by: str, hint: str = "") -> None:
    """Exit with one line naming what to install when a module of ``extra`` is missing."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(
            f"sluicegate: {needed_by} needs the {extra} extra (not installed: "
            f"{', '.join(missing)}): pip install 'sluicegate[{extra}]'{hint}"
        )


def bench_command() -> Command:
    """The ``bench`` command group, imported now; a one-line exit if its extra is missing."""
    require_extra("bench", BENCH_EXTRA_MODULES, "sluicegate bench")
    from sluicegate.bench.cli import bench_app

    return typer.main.get_command(bench_app)


class Commands(TyperGroup):
    """The ``sluicegate`` commands, ``bench`` among them without importing it: listed by
    its help line, and loaded only when it is the command that runs."""

    def list_commands(self, ctx: Context) -> list[str]:
        return [*super().list_commands(ctx), "bench"]

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name == "bench":
            return TyperCommand("bench", help=BENCH_HELP)  # what --help lists
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: Context, args: list[str]
    ) -> tuple[str | None, Command | None, list[str]]:
        if args and args[0] == "bench":
            return "bench", bench_command(), args[1:]
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="sluicegate",
    cls=Commands,
    help="An OpenAI-compatible streaming LLM server with backpressure end to end.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: rich's option tables cut long flag names (--max-request-bo…) to fit the
    # terminal; click's plain layout wraps the descriptions and keeps every name whole.
    rich_markup_mode=None,
    context_settings={"max_content_width": HELP_MAX_WIDTH},
)


@app.command("version")
def version() -> None:
    """Print the version."""
    from sluicegate import __version__

    typer.echo(__version__)


@app.command("export-hf")
def export_hf(
    out: Annotated[Path, typer.Argument(help="Directory to write (created if missing).")],
    model: Annotated[
        Optional[str],  # noqa: UP045 (typer reads the annotation)
        typer.Option(help="A .gguf file or Hugging Face directory [default: SmolLM2's GGUF]."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
) -> None:
    """Write the model as a Hugging Face directory, for engines that want one (vLLM,
    TGI, transformers serve) to serve the same weights behind --engine upstream."""
    require_extra("torch", TORCH_EXTRA_MODULES, "sluicegate export-hf")
    from sluicegate.engine.torch.export import export_hf_directory

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"dtype must be float32 or bfloat16; got {dtype!r}")
    try:
        written = export_hf_directory(model, out, dtype=dtype)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(written))


def _serve(**kwargs: Any) -> None:
    from sluicegate.config import load_settings

    config = kwargs.pop("config", None)
    flags = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in kwargs.items()}
    flags = {k: v for k, v in flags.items() if v != []}  # a repeatable flag not given
    try:
        settings = load_settings(config, **flags)
    except (ValidationError, ValueError, OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"sluicegate: invalid configuration: {settings_error(exc)}") from None
    if settings.engine == "torch":
        require_extra(
            "torch",
            TORCH_EXTRA_MODULES,
            "--engine torch (the default)",
            "; --engine sim and --engine upstream run without it",
        )
    # Imported once the settings are good: a bad configuration is told at once.
    from sluicegate.server import run_server

    run_server(settings)


def settings_error(exc: Exception) -> str:
    """A settings problem on one line: each field, what is wrong, and what was given."""
    if isinstance(exc, ValidationError):
        problems = []
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "settings"
            message = error["msg"].removeprefix("Value error, ")
            given = error.get("input")
            shown = "" if isinstance(given, dict) or error["type"] == "missing" else given
            problems.append(f"{where}: {message}" + (f" (got {shown!r})" if shown != "" else ""))
        return "; ".join(problems)
    if isinstance(exc, OSError):
        return f"cannot read {exc.filename}: {exc.strerror}"
    return " ".join(str(exc).split())


_serve.__signature__ = serve_signature()  # type: ignore[attr-defined]
app.command(
    "serve",
    cls=SettingsHelpCommand,
    help="Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000)."
    "\n\nEach setting is a flag, an environment variable (named beside it) and a key of the "
    "--config file; a flag beats the environment, which beats the file.",
)(_serve)


def main() -> None:
    app(prog_name="sluicegate")

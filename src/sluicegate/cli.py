"""The ``sluicegate`` command.

``serve`` exposes every field of :class:`sluicegate.config.Settings` as a flag, generated
from the settings object itself so that flags, ``SLUICEGATE_*`` env vars and the YAML
file never drift apart.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, get_args, get_origin

import typer
import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from sluicegate.bench.cli import bench_app
from sluicegate.config import Settings

app = typer.Typer(
    name="sluicegate",
    help="An OpenAI-compatible streaming LLM server with backpressure end to end.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help: rich's option tables cut long flag names (--max-request-bo…) to fit the
    # terminal; click's plain layout wraps the descriptions and keeps every name whole.
    rich_markup_mode=None,
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
    from sluicegate.engine.torch.export import export_hf_directory

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"dtype must be float32 or bfloat16; got {dtype!r}")
    try:
        written = export_hf_directory(model, out, dtype=dtype)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(str(written))


def _cli_type(name: str, annotation: Any) -> Any | None:
    """The type typer should parse for a settings annotation, or None if not a CLI scalar."""
    origin = get_origin(annotation)
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return _cli_type(name, args[0]) if len(args) == 1 else None
    if origin is Literal:
        choices = [str(a) for a in get_args(annotation)]
        return enum.Enum(f"{name}_choice", {c: c for c in choices}, type=str)
    if annotation in (bool, int, float, str):
        return annotation
    if origin is list and args == [str]:
        return list[str]  # a repeatable flag (--upstream URL --upstream URL)
    return None


def _serve(**kwargs: Any) -> None:
    from sluicegate.config import load_settings

    config = kwargs.pop("config", None)
    flags = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in kwargs.items()}
    flags = {k: v for k, v in flags.items() if v != []}  # a repeatable flag not given
    try:
        settings = load_settings(config, **flags)
    except (ValidationError, ValueError, OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"sluicegate: invalid configuration: {settings_error(exc)}") from None
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


def _serve_signature() -> inspect.Signature:
    params = [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                Optional[Path],  # noqa: UP045 - typer inspects this at run time
                typer.Option(
                    "--config", help="YAML file of settings (flags and env vars override it)."
                ),
            ],
        )
    ]
    for name, field in Settings.model_fields.items():
        assert isinstance(field, FieldInfo)
        cli_type = _cli_type(name, field.annotation)
        if cli_type is None:
            continue
        default_text = "none" if field.default is None else str(field.default)
        option = typer.Option(
            help=f"{field.description or ''} [default: {default_text}; "
            f"env SLUICEGATE_{name.upper()}]",
            show_default=False,
        )
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[Optional[cli_type], option],  # noqa: UP045
            )
        )
    return inspect.Signature(params)


_serve.__signature__ = _serve_signature()  # type: ignore[attr-defined]
app.command(
    "serve",
    help="Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8000).",
)(_serve)


app.add_typer(bench_app, name="bench")


def main() -> None:
    app(prog_name="sluicegate")

"""The flags of ``sluicegate serve``: one per field of :class:`~sluicegate.config.Settings`,
generated from the settings object itself so that flags, ``SLUICEGATE_*`` env vars and
the YAML file never drift apart, and their ``--help`` grouped under headings."""

from __future__ import annotations

import enum
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, get_args, get_origin

import typer
from pydantic.fields import FieldInfo
from typer.core import TyperCommand

from sluicegate.config import Settings

if TYPE_CHECKING:
    # The types of the help hooks overridden below. typer vendors click there (only the
    # names are used: every method called is click's long-standing public API).
    from typer._click import Context, HelpFormatter, Parameter

#: The headings of ``serve --help``, in the order shown, each with the first setting under
#: it: a setting falls under the last heading whose first setting comes at or before it in
#: :class:`Settings` (as the ``# ---`` comments of ``config.py`` mark the same sections).
SECTIONS: tuple[tuple[str, str], ...] = (
    ("Server", "host"),
    ("Connections (docs/security.md)", "max_connections"),
    ("Engine", "engine"),
    ("Torch engine (docs/engine.md)", "dtype"),
    ("Sim engine", "sim_step_base_ms"),
    ("Upstream engine (docs/upstream.md)", "upstream"),
    ("Scheduler", "max_num_seqs"),
    ("Sampling of a request that sets none", "default_max_tokens"),
    ("Latency objectives (docs/admission.md)", "admission"),
    ("Queues and limits of the front door", "max_queued_requests"),
    ("Circuit breaker", "breaker"),
    ("Prefill: stall-free chunks, length-aware lanes (docs/stall-free.md)", "stall_free_prefill"),
    ("Flow control: slow readers and stalled clients", "pause"),
    ("Pace-aware scheduling (docs/pace-aware-scheduling.md)", "scheduling"),
    ("Resumable streams and the shared store (docs/resume.md)", "store"),
    ("Background jobs (docs/batch-api.md)", "journal_path"),
    ("Shutdown", "drain_grace_seconds"),
)

#: The heading of the options that are not settings (``--config``, ``--help``).
GENERAL_HEADING = "Options"
#: How far a description stands in from its flag.
DESCRIPTION_INDENT = 4


def cli_type(name: str, annotation: Any) -> Any | None:
    """The type typer should parse for a settings annotation, or None if not a CLI scalar."""
    origin = get_origin(annotation)
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin in (typing.Union, types.UnionType):
        return cli_type(name, args[0]) if len(args) == 1 else None
    if origin is Literal:
        choices = [str(a) for a in get_args(annotation)]
        return enum.Enum(f"{name}_choice", {c: c for c in choices}, type=str)
    if annotation in (bool, int, float, str):
        return annotation
    if origin is list and args == [str]:
        return list[str]  # a repeatable flag (--upstream URL --upstream URL)
    return None


def default_text(field: FieldInfo) -> str | None:
    """What ``--help`` says a setting defaults to, or None to say nothing: a setting with
    no default, or one whose default is None while its description tells what that means
    (``default: SmolLM2-135M-Instruct``)."""
    if field.is_required():
        return None
    value = field.get_default(call_default_factory=True)
    if value is None or value == []:
        return None if "default" in (field.description or "") else "none"
    return str(value)


def env_var(name: str) -> str:
    """The environment variable of setting ``name``: ``SLUICEGATE_MAX_NUM_SEQS``."""
    return f"{Settings.model_config.get('env_prefix', '')}{name.upper()}"


def option_help(name: str, field: FieldInfo, *, with_env: bool = True) -> str:
    """A setting's description, then ``[default: ...; env ...]``."""
    default = default_text(field)
    shown = [f"default: {default}"] if default is not None else []
    if with_env:
        shown.append(f"env {env_var(name)}")
    description = field.description or ""
    return f"{description} [{'; '.join(shown)}]".lstrip() if shown else description


def serve_signature() -> inspect.Signature:
    """``--config``, then every setting that a flag can give, as keyword parameters."""
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
        parsed = cli_type(name, field.annotation)
        if parsed is None:
            continue
        option = typer.Option(
            help=option_help(name, field),
            show_default=False,
            # One value per flag, repeated: "<list[str]>" would read as a list in one.
            metavar="<str>" if parsed == list[str] else None,
        )
        params.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[Optional[parsed], option],  # noqa: UP045
            )
        )
    return inspect.Signature(params)


def section_of_settings() -> dict[str, str]:
    """Each setting's heading (see :data:`SECTIONS`)."""
    starts = {first: heading for heading, first in SECTIONS}
    names = list(Settings.model_fields)
    if names[0] not in starts:
        raise ValueError(f"the first setting, {names[0]}, starts no section of SECTIONS")
    missing = [first for first in starts if first not in Settings.model_fields]
    if missing:
        raise ValueError(f"SECTIONS starts at settings that do not exist: {missing}")
    sections: dict[str, str] = {}
    heading = starts[names[0]]
    for name in names:
        heading = starts.get(name, heading)
        sections[name] = heading
    return sections


def wrap_description(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` columns, keeping its closing ``[default: ...;
    env ...]`` whole: on the last line if it fits there, else on a line of its own (an env
    var's name split from the word ``env`` reads as two things)."""
    # Whole words only: docs/engine-performance.md and env var names are not cut.
    wrapper = textwrap.TextWrapper(width, break_long_words=False, break_on_hyphens=False)
    body, bracket, tail = text.rpartition(" [")
    if not bracket or not tail.endswith("]"):
        return wrapper.wrap(text)
    tail = "[" + tail
    lines = wrapper.wrap(body) or [""]
    if len(lines[-1]) + 1 + len(tail) <= width:
        lines[-1] = f"{lines[-1]} {tail}".lstrip()
    else:
        lines.extend(wrapper.wrap(tail))
    return lines


class SettingsHelpCommand(TyperCommand):
    """A command whose ``--help`` lists its options under the headings of
    :data:`SECTIONS`: each flag on a line with its env var, its description and default
    indented below it. Ninety settings stay readable, one or two lines most of them, and
    no flag name is cut to fit a column."""

    def format_options(self, ctx: Context, formatter: HelpFormatter) -> None:
        sections = section_of_settings()
        grouped: dict[str, list[Parameter]] = {GENERAL_HEADING: []}
        grouped.update({heading: [] for heading, _ in SECTIONS})
        for param in self.get_params(ctx):
            grouped[sections.get(param.name or "", GENERAL_HEADING)].append(param)
        for heading, params in grouped.items():
            if not params:
                continue
            with formatter.section(heading):
                for param in params:
                    record = param.get_help_record(ctx)
                    if record is None:  # a hidden option
                        continue
                    width = formatter.width - formatter.current_indent
                    head, description = (
                        setting_entry(param.name, record[0], width)
                        if param.name in sections
                        else record
                    )
                    formatter.write_text(head)
                    lines = wrap_description(description, width - DESCRIPTION_INDENT)
                    if lines:
                        # Click's "\b" paragraph: written as wrapped here, only indented.
                        indent = " " * DESCRIPTION_INDENT
                        formatter.write_text("\b\n" + "\n".join(indent + line for line in lines))


def setting_entry(name: str, flags: str, width: int) -> tuple[str, str]:
    """A setting's flag line and description, in ``width`` columns: its env var beside its
    flags where the line has room for it (nearly always), else at the end of the
    description."""
    field = Settings.model_fields[name]
    head = f"{flags}  env {env_var(name)}"
    if len(head) <= width:
        return head, option_help(name, field, with_env=False)
    return flags, option_help(name, field)

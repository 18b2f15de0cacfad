"""The ``sluicegate`` command line: every setting a whole, readable flag under its
heading; ``bench`` loaded only when it runs, and a missing extra told in one line."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluicegate import cli
from sluicegate.bench.cli import bench_app
from sluicegate.cli import BENCH_EXTRA_MODULES, BENCH_HELP, TORCH_EXTRA_MODULES, app
from sluicegate.config import Settings
from sluicegate.serve_flags import SECTIONS, cli_type, env_var, section_of_settings

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def flag_settings() -> list[str]:
    """The settings that ``serve`` takes as flags."""
    return [
        name
        for name, field in Settings.model_fields.items()
        if cli_type(name, field.annotation) is not None
    ]


def serve_help(terminal_width: int) -> str:
    result = CliRunner().invoke(
        app, ["serve", "--help"], prog_name="sluicegate", terminal_width=terminal_width
    )
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("terminal_width", [80, 100])
def test_serve_help_shows_every_flag_and_env_var_whole(terminal_width: int) -> None:
    help_text = serve_help(terminal_width)
    names = flag_settings()
    assert len(names) > 50
    words = set(re.findall(r"[\w-]+", help_text))
    missing = [
        name
        for name in names
        if f"--{name.replace('_', '-')}" not in words or env_var(name) not in words
    ]
    assert not missing, missing
    assert "…" not in help_text
    assert "PydanticUndefined" not in help_text
    assert max(len(line) for line in help_text.splitlines()) <= terminal_width


def test_serve_help_groups_the_flags_under_headings_at_100_columns() -> None:
    lines = serve_help(100).splitlines()
    headings = [line.removesuffix(":") for line in lines if re.fullmatch(r"\S.*:", line)]
    assert headings == ["Options", *(heading for heading, _ in SECTIONS)]
    # Each flag sits under its own heading, its env var on its line: --max-num-seqs under
    # Scheduler, --pause under flow control (FlowSettings' fields come first in Settings).
    scheduler = lines.index("Scheduler:")
    flow = next(i for i, line in enumerate(lines) if line.startswith("Flow control"))
    max_num_seqs = next(i for i, line in enumerate(lines) if "--max-num-seqs" in line)
    pause = next(i for i, line in enumerate(lines) if line.startswith("  --pause "))
    assert scheduler < max_num_seqs < scheduler + 3
    assert flow < pause < flow + 3
    assert lines[max_num_seqs] == "  --max-num-seqs <int>  env SLUICEGATE_MAX_NUM_SEQS"
    assert "[default: 32]" in lines[max_num_seqs + 1]
    # Compact: ~2.8 lines a flag (255 lines for 91 flags when this was written: flag line,
    # a description line or two, headings); click's default layout took 4 at 80 columns.
    assert len(lines) <= 3 * len(flag_settings())


def test_a_default_of_none_says_none_or_what_the_description_says() -> None:
    lines = serve_help(100).splitlines()

    def description_of(flag: str) -> str:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"  {flag} "))
        following = []
        for line in lines[start + 1 :]:
            if not line.startswith("      "):
                break
            following.append(line.strip())
        return " ".join(following)

    assert description_of("--upstream").endswith("[default: none]")  # a list: none given
    assert description_of("--max-queued-tokens").endswith("[default: none]")
    model = description_of("--model")
    assert "default: SmolLM2-135M-Instruct" in model and "[default" not in model


def test_every_setting_falls_under_a_heading() -> None:
    sections = section_of_settings()
    assert list(sections) == list(Settings.model_fields)
    headings = {heading for heading, _ in SECTIONS}
    assert set(sections.values()) == headings
    with_flags = {sections[name] for name in flag_settings()}
    assert with_flags == headings, headings - with_flags


def test_help_loads_neither_the_bench_nor_torch() -> None:
    """``sluicegate --help`` and ``serve --help`` run in a process of their own, as a user
    runs them, which then says which modules were imported."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('loaded: ' + repr(sorted(\n"
        "    m for m in sys.modules if m.startswith(('sluicegate.bench', 'torch'))))))\n"
        "from sluicegate.cli import main\n"
        "sys.argv = ['sluicegate', *sys.argv[1:]]\n"
        "main()\n"
    )
    for args in (["--help"], ["serve", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert "Usage: sluicegate" in done.stdout
        assert done.stderr.strip().endswith("loaded: []"), done.stderr


def test_bench_is_listed_and_its_help_works() -> None:
    listing = CliRunner().invoke(app, ["--help"], prog_name="sluicegate", terminal_width=100)
    assert listing.exit_code == 0, listing.output
    assert re.search(rf"^  bench\s+{re.escape(BENCH_HELP)}$", listing.output, re.MULTILINE)
    assert bench_app.info.help == BENCH_HELP
    result = CliRunner().invoke(app, ["bench", "--help"], prog_name="sluicegate")
    assert result.exit_code == 0, result.output
    assert "Usage: sluicegate bench [OPTIONS] COMMAND" in result.output
    for command in ("run", "capacity", "compare", "scenarios"):
        assert re.search(rf"^  {command}\s", result.output, re.MULTILINE), command


def test_bench_without_its_extra_says_what_to_install_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "BENCH_EXTRA_MODULES", ("json", "sluicegate_no_such_module"))
    result = CliRunner().invoke(app, ["bench", "scenarios"], prog_name="sluicegate")
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "sluicegate: sluicegate bench needs the bench extra (not installed: "
        "sluicegate_no_such_module): pip install 'sluicegate[bench]'"
    ]


def test_serve_on_the_torch_engine_without_its_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "TORCH_EXTRA_MODULES", ("sluicegate_no_such_module",))
    result = CliRunner().invoke(app, ["serve", "--port", "0"], prog_name="sluicegate")
    assert result.exit_code == 1
    [line] = result.output.splitlines()
    assert "--engine torch (the default) needs the torch extra" in line
    assert "pip install 'sluicegate[torch]'" in line
    assert "--engine sim and --engine upstream run without it" in line


def requirement_names(requirements: list[str]) -> set[str]:
    """``["torch==2.13.0", "gguf>=0.10"]`` -> ``{"torch", "gguf"}``."""
    names = set()
    for requirement in requirements:
        found = re.match(r"[A-Za-z0-9_.-]+", requirement)
        assert found is not None, requirement
        names.add(found.group(0).lower())
    return names


def test_the_extras_the_command_checks_are_the_extras_of_pyproject() -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = project["optional-dependencies"]
    assert requirement_names(extras["bench"]) == set(BENCH_EXTRA_MODULES)
    assert requirement_names(extras["torch"]) == set(TORCH_EXTRA_MODULES)
    # The CPU build that `make` installs first (an unpinned torch pulls a CUDA build).
    [torch_spec] = re.findall(r"^TORCH_SPEC := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert torch_spec in extras["torch"]
    assert "sluicegate[bench,torch]" in extras["test"]
    runtime = requirement_names(project["dependencies"])
    assert not runtime & (set(BENCH_EXTRA_MODULES) | set(TORCH_EXTRA_MODULES))

"""The wheel, as a user installs it: built from this tree, installed with its runtime
dependencies only (no extra) in a fresh venv, it serves the sim engine over real HTTP,
and the commands that need an extra say which one to install.

uv builds and installs (the ``test`` extra brings it): ~5 s where pip took ~40 s on this
2-core machine, downloading from the package index either way (uv caches what it
downloads; pip's cache stayed empty here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from uv import find_uv_bin

from sluicegate.bench.server_process import ServerProcess, free_port
from sluicegate.cli import BENCH_EXTRA_MODULES, TORCH_EXTRA_MODULES

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: Bounds on each step. A build takes ~3 s and an install ~5 s (measured here with uv's
#: cache cold, over the network); these leave room for a slow index, and all three steps
#: of the fixture together stay under pytest's 300 s timeout of a test.
BUILD_TIMEOUT_SECONDS = 60.0
INSTALL_TIMEOUT_SECONDS = 150.0
COMMAND_TIMEOUT_SECONDS = 60.0
READY_TIMEOUT_SECONDS = 60.0
HTTP_TIMEOUT_SECONDS = 30.0
#: What only the extras bring, none of which may come with the runtime dependencies (the
#: bench's rich and h11 do: typer and uvicorn need them).
EXTRA_ONLY_MODULES = tuple(
    name for name in (*TORCH_EXTRA_MODULES, *BENCH_EXTRA_MODULES) if name not in ("rich", "h11")
)


def run(
    command: Sequence[str | Path], timeout: float, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; on failure, raise with what it printed."""
    done = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and done.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, command))} exited with {done.returncode}:\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return done


def clean_env() -> dict[str, str]:
    """This environment, less what would point a child at this tree or its venv."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")
    return {k: v for k, v in os.environ.items() if k not in drop}


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` directory of a fresh venv that holds the wheel and its runtime
    dependencies, nothing else."""
    work = tmp_path_factory.mktemp("wheel")
    env = clean_env()
    uv = find_uv_bin()
    # A copy of what the wheel is built from: a build in place would leave build/ and an
    # egg-info in the tree, and reuse a build/lib that may hold deleted modules.
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "src", source / "src", ignore=ignore)
    dist = work / "dist"
    run([uv, "build", "--quiet", "--wheel", "--out-dir", dist, source], BUILD_TIMEOUT_SECONDS, env)
    [wheel] = dist.glob("sluicegate-*.whl")
    venv = work / "venv"
    run([uv, "venv", "--quiet", "--python", sys.executable, venv], COMMAND_TIMEOUT_SECONDS, env)
    # torch must not come with the runtime dependencies; were it to, uv (which does not
    # know the CPU build on this disk) would download a CUDA build of several GB first:
    # this constraint turns that into an immediate "no solution" naming torch.
    constraints = work / "constraints.txt"
    constraints.write_text("torch<0\n")
    python = venv / "bin" / "python"
    install = [uv, "pip", "install", "--quiet", "--python", python, "--constraint", constraints]
    run([*install, wheel], INSTALL_TIMEOUT_SECONDS, env)
    return venv / "bin"


@pytest.fixture
def sim_server(venv_bin: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    """``sluicegate serve --engine sim`` from the venv's own script, on a free port."""
    port = free_port()
    log_path = tmp_path / "server.log"
    command = [str(venv_bin / "sluicegate"), "serve", "--engine", "sim", "--port", str(port)]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_until_ready(server)
        yield server
    finally:
        server.stop()


def wait_until_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise AssertionError(f"the server exited early:\n{server.log()}")
            try:
                if client.get(server.base_url + "/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(
        f"the server was not ready in {READY_TIMEOUT_SECONDS:g} s:\n{server.log()}"
    )


def test_the_runtime_install_brings_no_extra_and_runs_from_the_venv(venv_bin: Path) -> None:
    code = (
        "import importlib.util, sluicegate\n"
        "print(sluicegate.__file__)\n"
        f"print([m for m in {EXTRA_ONLY_MODULES!r} if importlib.util.find_spec(m)])\n"
    )
    done = run([venv_bin / "python", "-c", code], COMMAND_TIMEOUT_SECONDS, clean_env())
    location, installed = done.stdout.splitlines()
    assert Path(location).is_relative_to(venv_bin.parent), location
    assert installed == "[]"


def test_the_wheel_serves_a_chat_completion_on_the_sim_engine(sim_server: ServerProcess) -> None:
    response = httpx.post(
        sim_server.v1 + "/chat/completions",
        json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        timeout=HTTP_TIMEOUT_SECONDS,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0


def test_bench_says_to_install_the_bench_extra(venv_bin: Path) -> None:
    done = run(
        [venv_bin / "sluicegate", "bench", "--help"],
        COMMAND_TIMEOUT_SECONDS,
        clean_env(),
        check=False,
    )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("sluicegate: sluicegate bench needs the bench extra"), line
    assert line.endswith("pip install 'sluicegate[bench]'"), line


def test_the_torch_engine_says_to_install_the_torch_extra(venv_bin: Path) -> None:
    done = run(
        [venv_bin / "sluicegate", "serve", "--port", "0"],
        COMMAND_TIMEOUT_SECONDS,
        clean_env(),
        check=False,
    )
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert "--engine torch (the default) needs the torch extra" in line
    assert "pip install 'sluicegate[torch]'" in line

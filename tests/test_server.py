"""Start-up failures: each is one line on stderr and exit code 1, never a traceback, never
a server that stays up unable to serve."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sluicegate.bench.server_process import free_port

pytestmark = pytest.mark.slow


def serve(*args: str, timeout: float = 60.0) -> tuple[int, str]:
    """``sluicegate serve ARGS``: its exit code and stderr (it must exit by itself)."""
    done = subprocess.run(
        [sys.executable, "-m", "sluicegate", "serve", "--port", str(free_port()), *args],
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stderr.decode(errors="replace")


def assert_one_line_failure(code: int, stderr: str, *words: str) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("sluicegate: "), stderr
    for word in words:
        assert word in last, last
    # The one line says it all: nothing else is logged as an error.
    assert not [line for line in stderr.splitlines() if " ERROR " in line], stderr


def test_a_missing_model_file(tmp_path: Path) -> None:
    code, stderr = serve("--model", str(tmp_path / "missing.gguf"), timeout=30)
    assert_one_line_failure(code, stderr, "missing.gguf", "does not exist")


def test_a_file_that_is_not_gguf_and_a_directory_without_config(tmp_path: Path) -> None:
    """Told from a glance at the path, before uvicorn starts: one line, no INFO lines."""
    (tmp_path / "bad.gguf").write_text("not a model")
    code, stderr = serve("--model", str(tmp_path / "bad.gguf"), timeout=30)
    assert_one_line_failure(code, stderr, "bad.gguf", "not a GGUF file")
    assert stderr.strip().count("\n") == 0, stderr
    (tmp_path / "empty").mkdir()
    code, stderr = serve("--model", str(tmp_path / "empty"), timeout=30)
    assert_one_line_failure(code, stderr, "empty", "no config.json")
    assert stderr.strip().count("\n") == 0, stderr


def test_a_model_of_a_family_the_engine_does_not_run(tmp_path: Path) -> None:
    """A directory's config.json model_type, a GGUF file's general.architecture: read at a
    glance, before uvicorn starts: one line naming the family and those it runs."""
    import gguf

    directory = tmp_path / "gemma3n"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "gemma3n"}')
    code, stderr = serve("--model", str(directory), timeout=30)
    assert_one_line_failure(code, stderr, "'gemma3n'", "gemma3_text", "--engine upstream")
    assert stderr.strip().count("\n") == 0, stderr
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    code, stderr = serve("--model", str(path), timeout=30)
    assert_one_line_failure(code, stderr, "'falcon'", "llama, qwen2, qwen3, phi3")
    assert stderr.strip().count("\n") == 0, stderr


def test_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr = serve("--engine", "sim", "--port", str(port), timeout=30)
    assert_one_line_failure(code, stderr, f"127.0.0.1:{port}", "in use")


@pytest.mark.parametrize(
    ("yaml_text", "words"),
    [
        ("max_num_seqs: -3\n", ("max_num_seqs", "-3")),
        ("max_num_sequences: 8\n", ("max_num_sequences", "not permitted")),
        ("port: [1, 2\n", ("invalid configuration",)),
        ("tenants:\n  - {name: a}\n  - {name: a}\n", ("tenants",)),
    ],
    ids=["a bad value", "an unknown setting", "broken YAML", "duplicate tenants"],
)
def test_a_bad_config_file(tmp_path: Path, yaml_text: str, words: tuple[str, ...]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text)
    code, stderr = serve("--engine", "sim", "--config", str(config), timeout=30)
    assert_one_line_failure(code, stderr, "invalid configuration", *words)


def test_a_missing_config_file(tmp_path: Path) -> None:
    code, stderr = serve("--config", str(tmp_path / "nope.yaml"), timeout=30)
    assert_one_line_failure(code, stderr, "nope.yaml")


def test_an_unreachable_redis() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, stderr = serve("--engine", "sim", "--store", url, timeout=30)
    assert_one_line_failure(code, stderr, url.rsplit("/", 1)[0], "Redis")


def test_an_engine_that_fails_to_load_ends_the_process(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    # GGUF's magic, so that it passes the glance before start-up, then garbage.
    broken.write_bytes(b"GGUF" + b"this is not a GGUF file" * 100)
    code, stderr = serve("--model", str(broken), "--journal-path", str(tmp_path / "j.db"))
    assert_one_line_failure(code, stderr, "engine failed to load")

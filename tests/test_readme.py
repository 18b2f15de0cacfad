"""The README's commands work as written, on the sim engine too."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import httpx
import orjson
import pytest

from tests.support.servers import start_server

README = Path(__file__).resolve().parent.parent / "README.md"


def quick_start_curl() -> list[str]:
    """The words of the quick start's ``curl`` command."""
    section = README.read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None
    command = block.group(1).replace("\\\n", " ")
    words = shlex.split(command)
    assert words[0] == "curl"
    return words


@pytest.mark.slow
def test_the_quick_start_curl_streams_from_the_sim_engine() -> None:
    words = quick_start_curl()
    url = next(w for w in words if w.startswith("http://"))
    body = orjson.loads(words[words.index("-d") + 1])
    headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
    server = start_server(["--engine", "sim"], "readme")
    try:
        path = "/" + url.split("/", 3)[3]
        with httpx.stream(
            "POST",
            server.base_url + path,
            content=orjson.dumps(body),
            headers=headers,
            timeout=30,
        ) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunk = orjson.loads(lines[0].removeprefix("data: "))
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "sluicegate-sim"
    finally:
        server.stop()

"""The README's commands work as written, on the sim engine too (in process)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import orjson

from sluicegate.config import Settings
from tests.support.inprocess import serve_in_process

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


async def test_the_quick_start_curl_streams_from_the_sim_engine() -> None:
    words = quick_start_curl()
    url = next(w for w in words if w.startswith("http://"))
    body = orjson.loads(words[words.index("-d") + 1])
    headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
    # It talks to where `sluicegate serve` listens by default.
    host, port = (Settings.model_fields[name].default for name in ("host", "port"))
    assert url.startswith(f"http://{host}:{port}/")
    async with serve_in_process(engine="sim") as app:
        path = "/" + url.split("/", 3)[3]
        response = await app.client.post(path, content=orjson.dumps(body), headers=headers)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunk = orjson.loads(lines[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "sluicegate-sim"

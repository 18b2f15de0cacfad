"""The gateway in front of a third-party engine serving the same SmolLM2 weights:
``transformers serve --continuous-batching`` (in every run: ``transformers`` and
``accelerate`` are test dependencies), on the GGUF the embedded engine serves, exported
by ``sluicegate export-hf``.  llama.cpp's ``llama-server``: test_llama_server.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from sluicegate.bench.server_process import free_port
from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support.servers import ARTIFACTS, ServerProcess, start_server
from tests.upstream.conftest import GATEWAY, start_upstream

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Peer:
    """A third-party engine process on a free port."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], model: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        #: The name it wants in requests.
        self.model = model
        ARTIFACTS.mkdir(exist_ok=True)
        log = self._log = (ARTIFACTS / f"peer-{name}-{self.port}.log").open("wb")
        self.process = subprocess.Popen(
            [*args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | env,
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}; see {log.name}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{name} did not become healthy in 180 s; see {log.name}")

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        response = httpx.post(self.base_url + "/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, torch_cache_dir: Path) -> Path:
    pytest.importorskip("torch")
    from sluicegate.engine.torch.export import export_hf_directory

    out = tmp_path_factory.mktemp("smollm2-hf")
    export_hf_directory(None, out, cache_dir=torch_cache_dir)
    return out


@pytest.fixture(scope="module")
def transformers_serve(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    pytest.importorskip("accelerate", reason="transformers serve needs accelerate")
    command = Path(sys.executable).parent / "transformers"
    # A small paged KV cache: by default it sizes one from the machine's memory (14 GB
    # here) and takes 20 s to set it up.
    args = [
        str(command),
        "serve",
        "--continuous-batching",
        "--device",
        "cpu",
        "--cb-num-blocks",
        "128",
        "--cb-block-size",
        "32",
        str(hf_dir),
    ]
    # Offline, with no hub cache: nothing may come from the hub.  Its model list may then
    # fail; the gateway asks its /health instead (its models are configured).
    absent = tmp_path_factory.mktemp("hub") / "absent"
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(absent)}
    # Under two pytest-xdist workers its torch computes on one thread too, as ours do
    # (tests/conftest.py): its two OpenMP threads, spinning for the cores the other worker
    # used, took 7-10 s of CPU for a 12-token answer where one thread takes under 1 s.
    if threads := os.environ.get("SLUICEGATE_TORCH_THREADS"):
        env["OMP_NUM_THREADS"] = threads
    peer = Peer("transformers", args, env, model=str(hf_dir))
    peer.chat(QUESTION, 2)  # its first answer sets it up (seconds): not in a test's time
    yield peer
    peer.stop()


def gateway_for(peers: list[tuple[str, str]], name: str, tmp: Path, *extra: str) -> ServerProcess:
    """A gateway serving ``MODEL`` from ``peers`` (url, the peer's own model name), in
    that order (ties go to the first)."""
    lines = ["upstreams:"]
    for url, model in peers:
        lines += [f"  - url: {url}", "    models:", f"      {MODEL}: {model!r}"]
    (tmp / "gateway.yaml").write_text("\n".join(lines) + "\n")
    args = [
        *GATEWAY,
        "--config",
        str(tmp / "gateway.yaml"),
        "--no-upstream-prefix-affinity",
        *extra,
    ]
    return start_server(args, f"gateway-{name}")


def stream_text(gateway: ServerProcess, body: dict[str, object]) -> tuple[str, str | None]:
    """The text and finish reason of a streamed chat through ``gateway``."""
    port = int(gateway.base_url.rsplit(":", 1)[1])
    stream = open_stream("127.0.0.1", port, "/v1/chat/completions", body | {"stream": True})
    text, finish = [], None
    for event in stream.events():
        if event.data == b"data: [DONE]":
            break
        assert b'"error"' not in event.data, event.data
        if event.data.startswith(b"data: {"):
            choices = orjson.loads(event.data[6:]).get("choices") or [{}]
            finish = choices[0].get("finish_reason") or finish
        if (piece := event_text(event)) is not None:
            text.append(piece)
    stream.close()
    return "".join(text), finish


def test_transformers_serve_answers_pass_through_unchanged(
    transformers_serve: Peer, tmp_path: Path
) -> None:
    gateway = gateway_for([(transformers_serve.base_url, transformers_serve.model)], "tf", tmp_path)
    try:
        direct = transformers_serve.chat(QUESTION, 12)
        assert "Paris" in direct
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0.0}
        whole = httpx.post(gateway.v1 + "/chat/completions", json=body, timeout=120)
        assert whole.status_code == 200, whole.text
        assert whole.json()["choices"][0]["message"]["content"] == direct
        assert stream_text(gateway, body)[0] == direct
        # Whatever the peer's own model list answers (offline it may fail), the gateway
        # lists its configured name.
        assert [m["id"] for m in httpx.get(gateway.v1 + "/models").json()["data"]] == [
            MODEL,
            EMBEDDING_MODEL,
        ]
    finally:
        gateway.stop()


def test_a_failover_onto_transformers_serve_continues_as_a_completion(
    transformers_serve: Peer, tmp_path: Path
) -> None:
    """A sim upstream dies mid-answer; the answer continues on ``transformers serve``,
    which refuses ``continue_final_message`` (it takes no field it does not know): the
    gateway continues it on ``/v1/completions`` from the conversation rendered with its
    chat template plus the text so far, and remembers to for that upstream."""
    # 30 ms steps: the kill lands mid-answer (at 5 ms the sim could finish its 24 tokens
    # first, leaving nothing to continue).
    sim = start_upstream("peer-sim", "--served-model-name", MODEL, "--sim-step-base-ms", "30")
    gateway = gateway_for(
        [(sim.base_url, MODEL), (transformers_serve.base_url, transformers_serve.model)],
        "tf-failover",
        tmp_path,
    )
    try:
        body = {
            "model": MODEL,
            "messages": QUESTION,
            "max_tokens": 24,
            "temperature": 0.0,
            "stream": True,
        }
        port = int(gateway.base_url.rsplit(":", 1)[1])
        stream = open_stream("127.0.0.1", port, "/v1/chat/completions", body)
        events = stream.events()
        before = ""
        for event in events:
            before += event_text(event) or ""
            if len(before) >= 8:
                break
        sim.process.kill()  # mid-answer, without a goodbye
        sim.process.wait()
        after, done = "", False
        for event in events:
            if event.data == b"data: [DONE]":
                done = True
                break
            assert b'"error"' not in event.data, event.data
            after += event_text(event) or ""
        stream.close()
        # The continuation may be empty: after the sim's words the model may well end at
        # once. That it continued there, as a completion, is the peer's record below.
        assert done, "the answer ended cleanly after the failover"
        upstreams = gateway.stats()["upstreams"]
        peer = next(u for name, u in upstreams.items() if str(transformers_serve.port) in name)
        assert peer["continuation"] == "completion"
        assert sum(u["failovers_total"] for u in upstreams.values()) == 1
    finally:
        gateway.stop()
        sim.stop()

"""The gateway in front of a third-party engine serving the same SmolLM2 weights:
``transformers serve --continuous-batching`` (in every run: ``transformers`` and
``accelerate`` are test dependencies), on the GGUF the embedded engine serves, exported
by ``sluicegate export-hf``.  llama.cpp's ``llama-server``: test_llama_server.py.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from sluicegate.bench.raw_client import event_text, open_stream
from sluicegate.bench.server_process import free_port
from sluicegate.pipeline.embedding import EMBEDDING_MODEL
from tests.support import plain_http
from tests.support.servers import ARTIFACTS, ServerProcess, start_server, start_servers
from tests.upstream.conftest import GATEWAY, SLOW_SIM

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Peer:
    """A third-party engine process on a free port, starting: :meth:`wait` for it."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], model: str) -> None:
        self.name = name
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

    def wait(self) -> None:
        """Until it is healthy (its /health answers 200)."""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}; see {self._log.name}"
                )
            try:
                if plain_http.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not become healthy in 180 s; see {self._log.name}")

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        response = plain_http.post(self.base_url + "/v1/chat/completions", json=body, timeout=120)
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


@dataclass
class Served:
    """``transformers serve``, and the servers of the tests in front of it."""

    peer: Peer
    #: A gateway in front of the peer alone.
    gateway: ServerProcess
    #: A sim upstream serving ``MODEL`` (30 ms steps), which a test kills.
    sim: ServerProcess
    #: A gateway in front of the sim, then the peer (ties go to the sim).
    failover: ServerProcess


@pytest.fixture(scope="module")
def served(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The peer, and the gateways and sim, which start while it loads (many seconds)."""
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
    with contextlib.ExitStack() as stack:
        stack.callback(peer.stop)
        tmp = tmp_path_factory.mktemp("gateways")
        # 30 ms steps: the kill lands mid-answer (at 5 ms the sim could finish its 24
        # tokens first, leaving nothing to continue).
        sim_args = [*SLOW_SIM, "--served-model-name", MODEL, "--sim-step-base-ms", "30"]
        sim, gateway = start_servers(
            (sim_args, "upstream-peer-sim"),
            (gateway_args([(peer.base_url, peer.model)], tmp / "tf.yaml"), "gateway-tf"),
        )
        stack.callback(sim.stop)
        stack.callback(gateway.stop)
        failover = start_server(
            gateway_args([(sim.base_url, MODEL), (peer.base_url, peer.model)], tmp / "f.yaml"),
            "gateway-tf-failover",
        )
        stack.callback(failover.stop)
        peer.wait()
        peer.chat(QUESTION, 2)  # its first answer sets it up (seconds): not in a test's time
        for each in (gateway, failover):  # until their health checks have found it
            wait_healthy(each, str(peer.port))
        yield Served(peer, gateway, sim, failover)


def gateway_args(peers: list[tuple[str, str]], config: Path) -> list[str]:
    """A gateway serving ``MODEL`` from ``peers`` (url, the peer's own model name), in
    that order (ties go to the first).  Its timeouts wait on a peer slow to answer on a
    busy machine (a sim that dies is seen at once: its connection breaks)."""
    lines = ["upstreams:"]
    for url, model in peers:
        lines += [f"  - url: {url}", "    models:", f"      {MODEL}: {model!r}"]
    config.write_text("\n".join(lines) + "\n")
    return [
        *GATEWAY,
        "--config",
        str(config),
        "--no-upstream-prefix-affinity",
        "--upstream-first-token-timeout-seconds",
        "30",
        "--upstream-idle-timeout-seconds",
        "30",
    ]


def wait_healthy(gateway: ServerProcess, port: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        upstreams = plain_http.stats(gateway)["upstreams"]
        if any(port in name and u["healthy"] for name, u in upstreams.items()):
            return
        assert time.monotonic() < deadline, f"the gateway never found the peer healthy: {upstreams}"
        time.sleep(0.1)


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


def test_transformers_serve_answers_pass_through_unchanged(served: Served) -> None:
    gateway, peer = served.gateway, served.peer
    direct = peer.chat(QUESTION, 12)
    assert "Paris" in direct
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0.0}
    whole = plain_http.post(gateway.v1 + "/chat/completions", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"] == direct
    assert stream_text(gateway, body)[0] == direct
    # Whatever the peer's own model list answers (offline it may fail), the gateway
    # lists its configured name.
    assert [m["id"] for m in plain_http.get(gateway.v1 + "/models").json()["data"]] == [
        MODEL,
        EMBEDDING_MODEL,
    ]


def test_a_failover_onto_transformers_serve_continues_as_a_completion(served: Served) -> None:
    """A sim upstream dies mid-answer; the answer continues on ``transformers serve``,
    which refuses ``continue_final_message`` (it takes no field it does not know): the
    gateway continues it on ``/v1/completions`` from the conversation rendered with its
    chat template plus the text so far, and remembers to for that upstream."""
    gateway, sim = served.failover, served.sim
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
    upstreams = plain_http.stats(gateway)["upstreams"]
    peer = next(u for name, u in upstreams.items() if str(served.peer.port) in name)
    assert peer["continuation"] == "completion"
    assert sum(u["failovers_total"] for u in upstreams.values()) == 1

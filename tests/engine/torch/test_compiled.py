"""``--engine-compile decode``: through the real server it serves eagerly while the
package builds in the background (the calibration it finishes while idle waits for it),
then decodes through it, and an engine started on the same cache loads it, as a restart
would; in the engine, the compiled step gives the eager step's logits within rounding,
writes the same keys and values, and a row's result does not depend on the batch around
it.

The model is SmolLM2 cut to its first layer (same widths, tokenizer and template), in
float32, so the build takes seconds rather than a minute and the comparisons are tight.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sluicegate.bench.scrape import admin_headers
from sluicegate.engine.cpu_share import CpuShare
from sluicegate.engine.torch.attention_batch import SequenceChunk, build_batch
from sluicegate.engine.torch.compiled import CompiledDecode, main
from sluicegate.engine.torch.decode_graph import MAX_ROWS, GraphRun
from sluicegate.engine.torch.model import Transformer
from sluicegate.scheduler.prompt_lookup import SpeculationConfig
from sluicegate.scheduler.request import Request, SamplingParams
from tests.engine.torch.conftest import TEST_THREADS
from tests.engine.torch.drive import RecordingEngine, run_requests
from tests.resume.conftest import Received, kill, owner, read_stream, resume, servers
from tests.store.conftest import start_redis
from tests.support.servers import ServerProcess, start_server

if TYPE_CHECKING:
    from sluicegate.engine.torch import TorchEngine

pytestmark = [pytest.mark.slow, pytest.mark.model]

SLOTS = 4
LENGTH = 256


@pytest.fixture(scope="module")
def cut_model(smollm2_hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's first layer, as a Hugging Face directory."""
    out = tmp_path_factory.mktemp("smollm2-cut")
    for source in smollm2_hf_dir.iterdir():
        if source.name not in ("model.safetensors", "config.json"):
            shutil.copy(source, out / source.name)
    with safe_open(smollm2_hf_dir / "model.safetensors", "pt") as weights:  # what it keeps
        kept = {
            name: weights.get_tensor(name)
            for name in weights.keys()  # noqa: SIM118 - safe_open handles are not mappings
            if not name.startswith("model.layers.") or name.startswith("model.layers.0.")
        }
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((smollm2_hf_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    return out


def serve(model: Path, cache: Path) -> ServerProcess:
    return start_server(server_args(model, cache), "compiled")


def server_args(model: Path, cache: Path) -> list[str]:
    return [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--engine-compile",
        "decode",
        "--max-num-seqs",
        str(SLOTS),
        "--max-model-len",
        str(LENGTH),
        "--cache-dir",
        str(cache),
        # The build competes for the CPU; these tests are not about admission.
        "--ttft-slo-ms",
        "60000",
    ]


def complete(server: ServerProcess, seed: int) -> str:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        reply = client.completions.create(
            model=str(server.stats()["model"]),
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0.8,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
    return reply.choices[0].text


def wait_until_built(server: ServerProcess) -> None:
    deadline = time.monotonic() + 300
    one_token = {"model": str(server.stats()["model"]), "prompt": "Once", "max_tokens": 1}
    # One client for every poll: a client per request took more CPU than the request.
    with httpx.Client(base_url=server.v1, timeout=60) as client:
        # Each step looks at the build, then at the package's load: a one-token answer
        # is a step.
        while compile_status(client) in ("building", "loading"):
            assert time.monotonic() < deadline, "the compiled decode step was not built"
            client.post("/completions", json=one_token).raise_for_status()
            time.sleep(1)
        assert compile_status(client) == "ready"


def compile_status(client: httpx.Client) -> str:
    response = client.get("/stats", headers=admin_headers())
    response.raise_for_status()
    return str(response.json()["engine_compile"])


@pytest.fixture(scope="module")
def compiled_server(
    cut_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Path]]:
    cache = tmp_path_factory.mktemp("compiled-cache")
    server = serve(cut_model, cache)
    yield server, cache
    server.stop()


def test_builds_in_the_background_then_decodes_compiled(
    compiled_server: tuple[ServerProcess, Path],
) -> None:
    server, cache = compiled_server
    if server.stats()["engine_compile"] == "building":
        assert complete(server, 1)  # served eagerly meanwhile
    wait_until_built(server)
    assert list((cache / "compiled").glob("*.pt2"))
    # The calibration left waited for the build, then ran while idle, and was saved for
    # the next start.
    deadline = time.monotonic() + 300
    while server.stats()["calibration"] != {"complete": True}:
        assert time.monotonic() < deadline, server.stats()["calibration"]
        time.sleep(0.2)
    assert list((cache / "calibration").glob("*.json"))
    alone = complete(server, 7)
    with ThreadPoolExecutor(4) as pool:
        batched = list(pool.map(lambda seed: complete(server, seed), [7, 8, 9, 7]))
    assert batched[0] == batched[3] == alone  # seeded: the same alone and batched
    assert len(set(batched[:3])) == 3
    assert server.stats()["compiled"] == {"status": "ready", "inexact_replays": 0}


def test_a_stream_taken_over_by_another_replica_keeps_its_bits(
    compiled_server: tuple[ServerProcess, Path], cut_model: Path, tmp_path: Path
) -> None:
    """A seeded stream computed through the compiled step, its replica killed, goes on
    on another replica (same package, shared Redis) with the log probabilities of an
    uninterrupted run: the taker re-prefills the answer through the compiled step too."""
    server, cache = compiled_server
    wait_until_built(server)
    redis = start_redis(tmp_path)
    store = ["--store", f"redis://127.0.0.1:{redis.port}", "--lease-ttl-seconds", "1"]
    args = [*server_args(cut_model, cache), *store, "--flush-interval-ms", "0"]
    try:
        with servers((args, "compiled-a"), (args, "compiled-b")) as (a, b):
            for replica in (a, b):
                wait_until_built(replica)  # loads the package the first server built
            body = {
                "model": str(a.stats()["model"]),
                "prompt": "Once upon a time",
                "max_tokens": 200,
                "temperature": 0.8,
                "seed": 5,
                "logprobs": 2,
                "ignore_eos": True,
                "stream": True,
            }
            whole = read_stream("POST", b.v1 + "/completions", json=body)
            first = read_stream("POST", a.v1 + "/completions", json=body, stop_after_events=8)
            kill(a)  # its client gone, it paused at the high-water mark: far from the end
            stream_id = first.headers["x-sluicegate-stream-id"]
            rest = resume(b, stream_id, first.last_event_id, headers=owner(first))
            assert rest.done
            metrics = httpx.get(b.base_url + "/metrics", timeout=10).text
            assert 'sluicegate_stream_resumes_total{status="follow"} 1.0' in metrics
    finally:
        redis.kill()
    assert token_logprobs(first) + token_logprobs(rest) == token_logprobs(whole)
    assert len(token_logprobs(whole)) == 200


def token_logprobs(received: Received) -> list[float]:
    out: list[float] = []
    for event in received.events:
        chunk = event.json
        if chunk and chunk.get("choices") and chunk["choices"][0].get("logprobs"):
            out.extend(chunk["choices"][0]["logprobs"]["token_logprobs"])
    return out


def cut_engine(
    compiled_server: tuple[ServerProcess, Path], cut_model: Path, **options: int
) -> TorchEngine:
    """The cut model in this process, with the package the server built (not loaded yet)."""
    from sluicegate.engine.torch import TorchEngine

    server, cache = compiled_server
    wait_until_built(server)
    return TorchEngine(
        str(cut_model),
        dtype="float32",
        max_num_seqs=SLOTS,
        max_model_len=LENGTH,
        cache_dir=str(cache),
        compile="decode",
        num_threads=options.pop("num_threads", TEST_THREADS),
        **options,
    )


@pytest.fixture(scope="module")
def engine(compiled_server: tuple[ServerProcess, Path], cut_model: Path) -> Iterator[TorchEngine]:
    """The cut model in this process, with the package the server built, loaded: as a
    restart of the server would (a package in the cache is loaded, not built again)."""
    engine = cut_engine(compiled_server, cut_model)
    assert engine.compile_status == "loading"  # once the engine is warmed up
    engine.warmed_up()
    wait_loaded(engine.compiled)
    assert engine.compile_status == "ready"
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def q4_engine(cut_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchEngine]:
    """The cut model with 4-bit weights for its answers (``--weights q4``), its compiled
    step built with them (by the engine's own background build, as a server's is)."""
    from sluicegate.engine.torch import TorchEngine

    engine = TorchEngine(
        str(cut_model),
        dtype="float32",
        max_num_seqs=SLOTS,
        max_model_len=LENGTH,
        cache_dir=str(tmp_path_factory.mktemp("q4-cache")),
        compile="decode",
        weights="q4",
        num_threads=TEST_THREADS,
    )
    assert engine.q4_bytes and engine.compile_status == "building"
    engine.warmed_up()
    assert engine.compiled is not None and engine.compiled.wait(600) == "ready"
    assert engine.compiled.min_rows == 1  # the int4 kernel needs no second row
    yield engine
    engine.close()


def test_prompt_only_steps_take_the_package_into_use_on_one_thread_until_then(
    compiled_server: tuple[ServerProcess, Path], cut_model: Path
) -> None:
    """Steps without a decode row (one-token answers) follow the load too, and the engine
    computes on one thread while it runs (the cores are shared with it); before it (the
    start-up calibration's steps) on every thread, as it will serve."""
    from sluicegate.engine.calibrate import _prefill

    engine = cut_engine(compiled_server, cut_model, num_threads=2)
    # Every thread once ready, whatever else runs on the machine (test_cpu_share.py).
    engine.cpu_share = CpuShare(2, busy_seconds=lambda: None)
    try:
        engine.step(_prefill(0, 8, num_decoding=0, context=0))
        assert engine.call(torch.get_num_threads) == 2 and engine.compile_status == "loading"
        engine.warmed_up()
        threads = []
        deadline = time.monotonic() + 60
        while engine.compile_status == "loading":
            assert time.monotonic() < deadline
            engine.step(_prefill(0, 8, num_decoding=0, context=0))
            threads.append(engine.call(torch.get_num_threads))
            time.sleep(0.1)  # a step now and then, as requests would come
        assert engine.compile_status == "ready"
        assert threads[-1] == 2 and set(threads[:-1]) <= {1}
    finally:
        engine.close()


def wait_loaded(handle: CompiledDecode | None) -> None:
    assert handle is not None
    assert handle.wait(60) != "loading", "the package did not load"


def prefill(model: Transformer, tokens: torch.Tensor, slot: int) -> None:
    batch, _ = build_batch([SequenceChunk(slot, 0, len(tokens), 0)])
    model(tokens, batch)


def eager_decode(
    model: Transformer,
    tokens: list[int],
    positions: list[int],
    slots: list[int],
    answers: bool = False,
) -> torch.Tensor:
    """One token of each sequence through the eager step; ``answers``: as an answer's (its
    prompt ends before it), which takes 4-bit weights where the model has them."""
    chunks = [
        SequenceChunk(s, p, 1, 1, p if answers else None)
        for s, p in zip(slots, positions, strict=True)
    ]
    batch, order = build_batch(chunks)
    assert order == list(range(len(chunks)))
    logits: torch.Tensor = model(torch.tensor(tokens), batch)
    return logits


def random_tokens(gen: torch.Generator, count: int) -> torch.Tensor:
    return torch.randint(100, 40000, (count,), generator=gen)


def rows(tokens: list[int], positions: list[int], slots: list[int]) -> list[GraphRun]:
    """One decode row per sequence."""
    return [GraphRun(s, p, [t]) for t, p, s in zip(tokens, positions, slots, strict=True)]


def test_matches_eager_and_writes_the_same_cache(engine: TorchEngine) -> None:
    model, handle = engine.model, engine.compiled
    assert handle is not None
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 40, 150]
    slots = [2, 0, 3]
    with torch.inference_mode():
        for slot, n in zip(slots, lengths, strict=True):
            prefill(model, random_tokens(gen, n), slot)
        saved = model.k_cache.clone(), model.v_cache.clone()
        positions = list(lengths)
        for _ in range(4):  # decode four tokens per sequence, both ways
            tokens = random_tokens(gen, 3).tolist()
            expected = eager_decode(model, tokens, positions, slots)
            eager_cache = model.k_cache.clone(), model.v_cache.clone()
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            assert handle.accepts(model, positions)
            got = handle.run(model, rows(tokens, positions, slots))
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
            torch.testing.assert_close(model.k_cache, eager_cache[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(model.v_cache, eager_cache[1], atol=1e-4, rtol=1e-4)
            saved = model.k_cache.clone(), model.v_cache.clone()
            positions = [p + 1 for p in positions]


def test_with_4_bit_weights_the_graph_computes_answers_through_them(
    q4_engine: TorchEngine,
) -> None:
    """The graph's rows are answers': with ``--weights q4`` it gives the eager step's
    logits for answer tokens (the int4 kernel) within rounding, and not those of the
    full weights (what prompts take)."""
    model, handle = q4_engine.model, q4_engine.compiled
    assert handle is not None
    gen = torch.Generator().manual_seed(5)
    slots, lengths = [1, 3], [30, 90]
    with torch.inference_mode():
        for slot, n in zip(slots, lengths, strict=True):
            prefill(model, random_tokens(gen, n), slot)
        saved = model.k_cache.clone(), model.v_cache.clone()
        tokens = random_tokens(gen, 2).tolist()
        expected = {}
        for answers in (True, False):
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            expected[answers] = eager_decode(model, tokens, lengths, slots, answers)
        model.k_cache.copy_(saved[0])
        model.v_cache.copy_(saved[1])
        got = handle.run(model, rows(tokens, lengths, slots))
    torch.testing.assert_close(got, expected[True], atol=2e-2, rtol=1e-2)
    # 4-bit weights move the logits far more than the graph's arithmetic does.
    assert (got - expected[False]).abs().max() > 10 * (got - expected[True]).abs().max()


@pytest.mark.parametrize("which", ["engine", "q4_engine"])
def test_a_row_does_not_depend_on_its_batch(which: str, request: pytest.FixtureRequest) -> None:
    """Alone (one row: computed as two with full weights, as one with 4-bit ones), beside a
    short context and beside one long enough to widen the key range: the same bits."""
    engine: TorchEngine = request.getfixturevalue(which)
    model, handle = engine.model, engine.compiled
    assert handle is not None
    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for slot, n in ((0, 20), (1, 9), (2, 200)):
            prefill(model, random_tokens(gen, n), slot)
        saved = model.k_cache.clone(), model.v_cache.clone()

        def decode(rows: list[tuple[int, int, int]]) -> torch.Tensor:
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            return handle.run(model, [GraphRun(s, p, [t]) for t, p, s in rows])

        me = (7000, 20, 0)
        alone = decode([me])[0]
        assert torch.equal(decode([(1100, 9, 1), me])[1], alone)
        assert torch.equal(decode([me, (500, 200, 2)])[0], alone)
        assert torch.equal(decode([me, (1100, 9, 1), (500, 200, 2)])[0], alone)


def test_accepts_every_position_of_a_slot_but_the_first(engine: TorchEngine) -> None:
    model, handle = engine.model, engine.compiled
    assert handle is not None
    assert handle.accepts(model, [1, LENGTH - 1])  # the cache is a key block longer
    assert not handle.accepts(model, [0, 5])  # a one-token prompt: nothing to attend yet


def test_consecutive_positions_in_one_call_are_those_decoded_one_by_one(
    engine: TorchEngine,
) -> None:
    """Positions of a sequence computed together (a re-prefill, drafts to verify), in one
    call or across calls and beside other rows: the logits, keys and values of decoding
    them one at a time, bit for bit."""
    model, handle = engine.model, engine.compiled
    assert handle is not None
    gen = torch.Generator().manual_seed(5)
    count = 2 * MAX_ROWS + 6  # three calls' worth
    with torch.inference_mode():
        prefill(model, random_tokens(gen, 20), 0)
        prefill(model, random_tokens(gen, 45), 1)
        saved = model.k_cache.clone(), model.v_cache.clone()
        mine, other = random_tokens(gen, count).tolist(), random_tokens(gen, count).tolist()
        one_by_one = torch.cat(
            [
                handle.run(
                    model, [GraphRun(0, 20 + i, [mine[i]]), GraphRun(1, 45 + i, [other[i]])]
                )[:1]
                for i in range(count)
            ]
        )
        decoded = (
            model.k_cache[:, 0, :, : 20 + count].clone(),
            model.v_cache[:, 0, :, : 20 + count].clone(),
        )
        layouts = {
            "one run": [[GraphRun(0, 20, mine, count)]],
            "pieces beside another sequence": [
                [GraphRun(1, 45, other[:1], 0), GraphRun(0, 20, mine[:5], 5)],
                [GraphRun(0, 25, mine[5:40], 35), GraphRun(1, 46, other[1:2], 0)],
                [GraphRun(0, 60, mine[40:], count - 40)],
            ],
        }
        for name, calls in layouts.items():
            model.k_cache.copy_(saved[0])
            model.v_cache.copy_(saved[1])
            logits = torch.cat([handle.run(model, runs) for runs in calls])
            assert torch.equal(logits, one_by_one), name
            assert torch.equal(model.k_cache[:, 0, :, : 20 + count], decoded[0]), name
            assert torch.equal(model.v_cache[:, 0, :, : 20 + count], decoded[1]), name
        # The eager path computes them with other bits (why re-prefills replay them here).
        model.k_cache.copy_(saved[0])
        model.v_cache.copy_(saved[1])
        eager = model(torch.tensor(mine), build_batch([SequenceChunk(0, 20, count, count)])[0])
        assert not torch.equal(eager, one_by_one)


#: Tokens of each answer in the tests driven by the scheduler.
NUM_TOKENS = 24


def seeded(seed: int, max_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(
        max_tokens, seed, temperature=0.9, top_p=0.95, ignore_eos=True, logprobs=5
    )


def question(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.parametrize("which", ["engine", "q4_engine"])
def test_answers_resumed_after_a_preemption_are_the_uninterrupted_ones(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A seeded answer decoded through the compiled step, and one whose first tokens were
    decoded eagerly before the step was ready: dropped half-way (KV gone, tokens and
    ``compiled_from`` kept, as a preemption or a stream's record keeps them), each is
    re-prefilled in chunks in another slot and goes on with the tokens and the log
    probabilities (the logits, bit for bit) of the uninterrupted answer; with full
    weights and with 4-bit ones (which an answer's eager positions take as well)."""
    engine: TorchEngine = request.getfixturevalue(which)
    prompt = question(engine, "Tell me about rivers.")
    start = len(prompt)
    recorder = RecordingEngine(engine)
    compiled = Request("compiled", list(prompt), seeded(7))
    run_requests(recorder, [compiled])
    assert compiled.reuse.compiled_from == start  # its whole answer through the graph
    # The same question, its first 5 tokens eager (no compiled step yet), then on.
    handle, engine.compiled = engine.compiled, None
    early = Request("early", list(prompt), seeded(8, max_tokens=5))
    run_requests(recorder, [early])
    engine.compiled = handle
    assert early.reuse.compiled_from is None
    switched = Request("switched", list(prompt), seeded(8))
    switched.all_token_ids.extend(early.output_token_ids)
    run_requests(recorder, [switched])
    # The position of the last eager token: it was never computed before.
    assert switched.reuse.compiled_from == start + 4
    half = NUM_TOKENS // 2
    for answer, logprobs in (
        (compiled, recorder.logprobs["compiled"]),
        (switched, recorder.logprobs["early"] + recorder.logprobs["switched"]),
    ):
        resumed = Request(f"resumed-{answer.request_id}", list(prompt), answer.sampling)
        resumed.all_token_ids.extend(answer.output_token_ids[:half])
        resumed.reuse.compiled_from = answer.reuse.compiled_from
        # Re-prefilled in chunks of at most 8 positions, in slot 1 (slot 0 is held).
        run_requests(recorder, [resumed], max_num_batched_tokens=8, hold_slots=1)
        assert resumed.output_token_ids == answer.output_token_ids, answer.request_id
        assert recorder.logprobs[resumed.request_id] == logprobs[half:], answer.request_id


def test_drafts_verified_through_the_compiled_step_give_the_tokens_of_plain_decoding(
    engine: TorchEngine,
) -> None:
    """Prompt-lookup drafts are verified through the compiled step, several positions of a
    sequence in one call: the answer is the one decoded a token at a time."""
    prompt = question(engine, "Repeat after me: " + "one two three four five six " * 6)
    greedy = SamplingParams(NUM_TOKENS, 0, temperature=0.0, ignore_eos=True)
    plain = Request("plain", list(prompt), greedy)
    run_requests(engine, [plain])
    drafted = Request("drafted", list(prompt), greedy)
    scheduler = run_requests(engine, [drafted], speculation=SpeculationConfig(num_tokens=8))
    counters = scheduler.make_stats().speculation
    assert counters is not None and counters["proposed_tokens"] > 0, counters
    assert drafted.output_token_ids == plain.output_token_ids
    assert drafted.reuse.compiled_from == plain.reuse.compiled_from == len(prompt)


def test_a_second_build_of_the_same_package_finds_it_done(
    compiled_server: tuple[ServerProcess, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """What a replica on the same machine starts: it waits for the first build's lock,
    then finds the package there (this returns without loading the model)."""
    server, cache = compiled_server
    wait_until_built(server)
    (package,) = (cache / "compiled").glob("*.pt2")
    built = package.stat().st_mtime_ns
    main(
        [
            "--model",
            "unused",
            "--dtype",
            "float32",
            "--slots",
            "4",
            "--max-model-len",
            "256",
            "--out",
            str(package),
        ]
    )
    assert "is built (by another process)" in capsys.readouterr().out
    assert package.stat().st_mtime_ns == built


def test_closing_the_engine_stops_its_build(cut_model: Path, tmp_path: Path) -> None:
    args = [
        "--model",
        str(cut_model),
        "--dtype",
        "float32",
        "--slots",
        "4",
        "--max-model-len",
        "256",
        "--cache-dir",
        str(tmp_path),
    ]
    handle = CompiledDecode(tmp_path / "compiled" / "cut.pt2", build_args=args)
    assert handle._process is None  # nothing before start
    handle.start()
    assert handle.status == "building" and not handle.poll()
    process = handle._process
    assert process is not None and process.poll() is None
    handle.close()
    assert process.returncode == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):  # its whole session is gone
        os.killpg(process.pid, 0)


def test_a_missing_package_without_a_build_is_off(tmp_path: Path) -> None:
    handle = CompiledDecode(tmp_path / "absent.pt2", build_args=None)
    handle.start()
    assert handle.status == "off" and not handle.poll()


def test_a_broken_package_leaves_the_engine_eager(tmp_path: Path) -> None:
    package = tmp_path / "broken.pt2"
    package.write_bytes(b"not a package")
    handle = CompiledDecode(package, build_args=None)
    handle.start()
    wait_loaded(handle)
    assert handle.status == "failed" and not handle.poll()

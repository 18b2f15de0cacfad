"""The embedded core with the simulated engine: its thread, commands and outputs.  No sockets."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import pytest

from sluicegate.engine.base import CoreHooks, StepStats
from sluicegate.engine.calibrate import Remaining, start_calibration
from sluicegate.engine.embedded import EmbeddedCore, WarmUp
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.sim import SimEngine, sim_text_bytes
from sluicegate.scheduler.cost_model import StepShape
from sluicegate.scheduler.request import FinishReason, Request, RequestStatus, SamplingParams
from sluicegate.scheduler.scheduler import Scheduler, SchedulerConfig
from sluicegate.scheduler.step import StepPlan, StepResult


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []
        self.aborts: list[float] = []
        self.resumes: list[float] = []

    def hooks(self) -> CoreHooks:
        return CoreHooks(self.steps.append, self.aborts.append, self.resumes.append)


@pytest.fixture
async def core() -> AsyncIterator[tuple[EmbeddedCore, Recorder]]:
    sim = SimEngine(step_base_ms=1.0, step_per_token_ms=0.0)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, pause_preempt_seconds=0.2
        ),
        eos_token_ids=sim.eos_token_ids,
    )
    recorder = Recorder()
    engine_core = EmbeddedCore(
        sim, sim.tokenizer, scheduler, asyncio.get_running_loop(), recorder.hooks()
    )
    engine_core.start_thread()
    yield engine_core, recorder
    await engine_core.close()


def request(rid: str, prompt: str, max_tokens: int, **sampling: object) -> Request:
    ids = list(prompt.encode())
    params = SamplingParams(max_tokens=max_tokens, seed=7, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return Request(rid, ids, params)


async def drain(stream: RequestStream) -> tuple[str, RequestOutput]:
    text = ""
    while True:
        out = await asyncio.wait_for(stream.get(), 5.0)
        text += out.text
        if out.finished:
            return text, out


async def wait_until(condition: Callable[[], object], within_seconds: float = 5.0) -> None:
    deadline = time.monotonic() + within_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_request_runs_to_its_length_and_its_text_is_the_sims(
    core: tuple[EmbeddedCore, Recorder],
) -> None:
    engine_core, recorder = core
    req = request("a", "hello", 40)
    stream = RequestStream("a")
    engine_core.add_request(req, stream)
    text, last = await drain(stream)
    assert last.finish_reason == FinishReason.LENGTH and last.num_output_tokens == 40
    assert text.encode() == bytes(req.output_token_ids)  # byte-level: ids are the bytes
    assert req.output_token_ids[:8] == list(sim_text_bytes(7, _digest(req), 8))
    assert recorder.steps and all(s.num_seqs >= 1 for s in recorder.steps)
    await wait_until(lambda: engine_core.stats().num_running == 0)


def _digest(req: Request) -> bytes:
    return hashlib.blake2b(repr(req.prompt_token_ids).encode(), digest_size=16).digest()


async def test_a_stop_string_ends_the_sequence_without_showing_it(
    core: tuple[EmbeddedCore, Recorder],
) -> None:
    engine_core, _ = core
    probe = request("probe", "stop me", 60)
    probe_stream = RequestStream("probe")
    engine_core.add_request(probe, probe_stream)
    full, _ = await drain(probe_stream)
    stop = full[10:14]
    req = request("s", "stop me", 60, stop=(stop,))
    stream = RequestStream("s")
    engine_core.add_request(req, stream)
    text, last = await drain(stream)
    assert last.finish_reason == FinishReason.STOP
    assert text == full[: full.index(stop)]


async def test_an_abort_takes_effect_before_the_next_step(
    core: tuple[EmbeddedCore, Recorder],
) -> None:
    engine_core, recorder = core
    req = request("long", "x", 400)
    stream = RequestStream("long")
    engine_core.add_request(req, stream)
    await asyncio.wait_for(stream.get(), 5.0)
    engine_core.abort_request("long")
    _, last = await drain(stream)
    assert last.finish_reason == FinishReason.ABORT and req.num_output_tokens < 400
    assert req.status == RequestStatus.FINISHED_ABORTED
    assert len(recorder.aborts) == 1 and recorder.aborts[0] < 1.0
    engine_core.abort_request("long")  # twice, or unknown: nothing happens
    await asyncio.sleep(0.05)
    assert len(recorder.aborts) == 1


async def test_pause_stops_a_sequence_and_a_long_pause_frees_its_kv(
    core: tuple[EmbeddedCore, Recorder],
) -> None:
    engine_core, recorder = core
    req = request("p", "pause", 300)
    stream = RequestStream("p")
    engine_core.add_request(req, stream)
    await asyncio.wait_for(stream.get(), 5.0)
    engine_core.pause_request("p")
    await wait_until(lambda: req.pause.paused)
    produced = req.num_output_tokens
    # Nothing else runs: the loop sleeps until the long pause is due, then preempts.
    await wait_until(lambda: engine_core.stats().preemptions_by_reason)
    stats = engine_core.stats()
    assert stats.preemptions_by_reason == {"long_pause": 1}
    assert stats.kv_cache.num_used_blocks == 0 and req.num_output_tokens == produced
    engine_core.resume_request("p")
    _, last = await drain(stream)
    assert last.finish_reason == FinishReason.LENGTH and req.num_output_tokens == 300
    assert len(recorder.resumes) == 1 and recorder.resumes[0] >= 0.2


async def test_shutdown_fails_what_is_left(core: tuple[EmbeddedCore, Recorder]) -> None:
    engine_core, _ = core
    streams = []
    for i in range(3):
        stream = RequestStream(f"r{i}")
        engine_core.add_request(request(f"r{i}", "y", 10_000 // 50), stream)
        streams.append(stream)
    engine_core.pause_request("r0")
    await engine_core.close()
    for stream in streams:
        _, last = await drain(stream)
        assert last.finish_reason in (FinishReason.ERROR, FinishReason.LENGTH)


async def test_stats_show_an_abort_at_once_when_no_step_follows(
    core: tuple[EmbeddedCore, Recorder],
) -> None:
    """Throttled sequences leave nothing to compute: an abort must still show at once."""
    engine_core, _ = core
    streams = {}
    for rid in ("slow-a", "slow-b"):
        req = request(rid, "pace", 100)
        req.pace.min_token_interval_seconds = 30.0  # its next token is far away
        streams[rid] = RequestStream(rid)
        engine_core.add_request(req, streams[rid])
        await asyncio.wait_for(streams[rid].get(), 5.0)
    await asyncio.sleep(0.1)  # each has its token of slack, then waits for its pace
    assert engine_core.stats().num_running == 2
    engine_core.abort_request("slow-a")
    # Well before either's next token (30 s away): the abort did not wait for a step.
    await wait_until(lambda: engine_core.stats().num_running == 1, within_seconds=10.0)
    engine_core.abort_request("slow-b")
    await wait_until(lambda: engine_core.stats().num_running == 0, within_seconds=10.0)
    stats = engine_core.stats()
    assert stats.kv_cache is not None and stats.kv_cache.num_used_blocks == 0
    assert stats.num_throttled == 0


class WatchedSim(SimEngine):
    """The sim, noting for every step whether it was a calibration step (its sequences
    are the warm-up's) and which requests the scheduler held then."""

    def __init__(self, held: Callable[[], list[str]]) -> None:
        super().__init__(step_base_ms=1.0, step_per_token_ms=0.0)
        self.held = held
        self.log: list[tuple[bool, list[str], list[int]]] = []

    def step(self, plan: StepPlan) -> StepResult:
        if plan.sequences:
            warm = any(s.request_id.startswith("warm-up") for s in plan.sequences)
            self.log.append((warm, self.held(), [s.kv_slot for s in plan.sequences]))
        return super().step(plan)


S = TypeVar("S", bound=SimEngine)


def calibrating_core(
    make_sim: Callable[[Scheduler], S], *, prefix_caching: bool, warm: WarmUp | None = None
) -> tuple[Scheduler, S, EmbeddedCore, Remaining, list[tuple[StepShape, float]]]:
    """A core on four slots whose first fit ran, not started: its sim (made from the
    scheduler), the calibration left and the first fit's steps."""
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=512,
        prefix_caching=prefix_caching,
    )
    scheduler = Scheduler(config, eos_token_ids=SimEngine().eos_token_ids)
    sim = make_sim(scheduler)
    loop = asyncio.get_running_loop()
    engine_core = EmbeddedCore(sim, sim.tokenizer, scheduler, loop, warm=warm)
    observations, engine_core._calibrating = start_calibration(sim, 4, 512, 256, repeats=1)
    scheduler.calibrate(observations)
    left = engine_core._calibrating
    assert left is not None
    return scheduler, sim, engine_core, left, observations


async def test_the_calibration_left_runs_only_while_nothing_is_held() -> None:
    """With ``WarmUp(background=True)`` the core serves on a first fit, then measures the
    rest one step at a time while no request is held, in slots the prefix cache does not
    keep; what does not fit before its deadline is given up, and the core refits from
    what it measured."""
    # Before the thread runs (start() would start it): the first fit, and steps left.
    scheduler, sim, engine_core, left, observations = calibrating_core(
        lambda s: WatchedSim(lambda: sorted(s.requests)),
        prefix_caching=True,
        warm=WarmUp(repeats=1, background=True),
    )
    assert not left.done
    # Never emptying cached slots, and given up after a second.
    engine_core._calibration_evicts_at = float("inf")
    engine_core._calibration_ends_at = time.monotonic() + 1.0
    # A request comes first, and is held until its end: no calibration step meanwhile.
    stream = RequestStream("a")
    prompt = "a prompt long enough for a cached block " * 2
    engine_core.add_request(request("a", prompt, 30), stream)
    engine_core.start_thread()
    try:
        _, last = await drain(stream)
        assert last.finish_reason == FinishReason.LENGTH
        await wait_until(lambda: engine_core.stats().sections["calibration"] == {"complete": True})
    finally:
        await engine_core.close()
    assert all(not held for warm, held, _ in sim.log if warm)
    assert any(held == ["a"] for warm, held, _ in sim.log if not warm)
    # Its slot stayed cached, and no calibration step wrote it: the shapes of four
    # sequences never fitted in the three empty slots, and were given up at the deadline.
    assert scheduler.kv.prefix is not None and scheduler.kv.prefix.num_cached_slots == 1
    served = next(i for i, (warm, _, _) in enumerate(sim.log) if not warm)
    cached = {slot for warm, _, slots in sim.log if not warm for slot in slots}
    written = {slot for warm, _, slots in sim.log[served:] if warm for slot in slots}
    assert len(cached) == 1 and written and not written & cached
    assert not left.done and 0 < len(left.measured) < len(left.shapes)
    assert scheduler.cost.num_observations >= len(observations) + len(left.measured)


async def test_after_its_patience_the_calibration_empties_cached_slots_and_finishes() -> None:
    scheduler, _, engine_core, left, _ = calibrating_core(
        lambda s: WatchedSim(lambda: sorted(s.requests)), prefix_caching=True
    )
    engine_core._calibration_evicts_at = time.monotonic() + 0.3
    engine_core._calibration_ends_at = time.monotonic() + 60.0
    stream = RequestStream("a")
    engine_core.add_request(request("a", "a prompt long enough for a cached block " * 2, 8), stream)
    engine_core.start_thread()
    try:
        await drain(stream)
        await wait_until(lambda: engine_core.stats().sections["calibration"] == {"complete": True})
    finally:
        await engine_core.close()
    assert left.done  # every shape, the four-slot ones after the patience
    assert scheduler.kv.prefix is not None and scheduler.kv.prefix.num_cached_slots == 0
    assert scheduler.kv.prefix.stats.evictions == 1


class BuildingSim(SimEngine):
    """The sim with a compiled decode step that builds until :attr:`finish` is set, then
    comes into use at its next step (as the torch engine's does, at a step, empty or not);
    each warm-up step is logged with the status it ran under."""

    def __init__(self) -> None:
        super().__init__(step_base_ms=1.0, step_per_token_ms=0.0)
        self.status = "building"
        self.finish = False
        self.warm_steps: list[str] = []

    @property
    def compile_status(self) -> str:
        return self.status

    def step(self, plan: StepPlan) -> StepResult:
        if self.finish:
            self.status = "ready"
        if any(s.request_id.startswith("warm-up") for s in plan.sequences):
            self.warm_steps.append(self.status)
        return super().step(plan)


async def test_a_build_leaves_nothing_it_slowed_behind() -> None:
    """While the compiled step builds, the calibration left waits past its deadline (it
    would only time the engine beside the compiler); once the build is over, seen by an
    idle core too, the steps the scheduler learnt from beside it are forgotten, the seat
    limit's feedback starts again, and the calibration left runs, every shape of it
    after the build."""
    scheduler, sim, engine_core, left, _ = calibrating_core(
        lambda _: BuildingSim(), prefix_caching=False, warm=WarmUp(repeats=1, background=True)
    )
    assert sim.warm_steps
    first_fit = len(sim.warm_steps)
    engine_core._calibration_ends_at = time.monotonic() - 1.0  # already due
    stream = RequestStream("a")
    engine_core.add_request(request("a", "a prompt beside the build", 24), stream)
    engine_core.start_thread()
    try:
        await drain(stream)
        await asyncio.sleep(1.2)  # two idle wake-ups past the deadline
        assert engine_core.stats().sections["calibration"] != {"complete": True}
        assert len(sim.warm_steps) == first_fit and not left.measured
        assert len(scheduler.cost._window) > 0  # the request's steps, beside the build
        scheduler.seats.correction = 0.25  # as the feedback cuts on steps a build slowed
        sim.finish = True  # nothing runs: the idle core must see it
        await wait_until(lambda: engine_core.stats().sections["calibration"] == {"complete": True})
    finally:
        await engine_core.close()
    assert left.done
    assert set(sim.warm_steps[first_fit:]) == {"ready"}
    assert len(scheduler.cost._window) == 0
    assert scheduler.seats.correction == 1.0

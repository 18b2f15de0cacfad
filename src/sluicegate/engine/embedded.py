"""The embedded core: one thread that plans, computes and hands results back.

The event loop never blocks on the engine.  It talks to this thread through a command
queue (add, abort, pause, resume) that is drained before every step, so an abort takes
effect before the next step is planned; results come back once per step through
``loop.call_soon_threadsafe``.  The core's stats are published after every step and
after every batch of commands, so an abort shows in ``/v1/stats`` and the metrics at
once, even when no step follows (every sequence left is paused or throttled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluicegate.engine.base import (
    COMPILE_UNDER_WAY,
    CoreFeatures,
    CoreHooks,
    CoreStats,
    Engine,
    StepStats,
)
from sluicegate.engine.calibrate import Remaining, start_calibration, warm_up
from sluicegate.engine.deliveries import Deliveries, Delivery
from sluicegate.engine.output import RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import FinishReason, Request, RequestStatus
from sluicegate.scheduler.scheduler import Scheduler
from sluicegate.scheduler.seat_limit import ServiceEstimate
from sluicegate.scheduler.step import StepPlan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request: Request
    stream: RequestStream


@dataclass(slots=True)
class _Abort:
    request_id: str
    requested_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Flow:
    """Flow control from the stream side: pause or resume a sequence."""

    request_id: str
    pause: bool


@dataclass(slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Flow | _Stop


@dataclass(slots=True, frozen=True)
class WarmUp:
    """The start-up calibration: timed passes over each shape (the sim's steps follow
    its own law, so one is enough; a real engine's vary with the machine's load), and
    where a warm start finds the last one (None: always measure)."""

    repeats: int = 3
    saved: Path | None = None
    #: Serve on the cheap shapes' measurements and measure the rest while idle
    #: (:func:`~sluicegate.engine.calibrate.start_calibration`), rather than all first.
    background: bool = False


#: Seconds after the start from which the calibration left may empty slots the prefix
#: cache keeps, least recently used first, for a shape that needs them (until then it waits
#: for empty ones: a conversation's next turn soon after the start keeps its prefix).
CALIBRATION_PATIENCE_SECONDS = 20.0
#: Seconds after the start at which the calibration left ends with what it has measured
#: if it has found no idle time to finish in; the live fit goes on from real steps.
CALIBRATION_WITHIN_SECONDS = 120.0


class EmbeddedCore:
    """Owns the scheduler and the engine (torch or sim); runs them on a dedicated thread."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: TextTokenizer,
        scheduler: Scheduler,
        loop: asyncio.AbstractEventLoop,
        hooks: CoreHooks | None = None,
        *,
        model_name: str | None = None,
        warm: WarmUp | None = None,
        features: CoreFeatures | None = None,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self._loop = loop
        self._model_name = model_name or engine.model_name
        self._warm = warm or WarmUp()
        self._features = features or CoreFeatures()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._deliveries = Deliveries(tokenizer)
        self._hooks = hooks or CoreHooks()
        self._thread = threading.Thread(target=self._run, name="sluicegate-engine", daemon=True)
        self._num_steps = 0
        self._batch_size = 0
        #: The engine's compiled decode step as last seen.
        self._compile_status = engine.compile_status
        #: Shapes the calibration still measures while the engine is idle (None: none).
        self._calibrating: Remaining | None = None
        #: When the calibration left may empty cached slots, and when it ends regardless.
        self._calibration_evicts_at = 0.0
        self._calibration_ends_at = 0.0
        self.engine_up = True
        self._stats_lock = threading.Lock()
        self._stats = self._make_stats()

    # ----------------------------------------------------------- the protocol
    @property
    def features(self) -> CoreFeatures:
        return self._features

    @property
    def capacity(self) -> DispatchCapacity:
        return self.scheduler.capacity

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    def model_max_len(self, model: str) -> int:
        return self.scheduler.config.max_model_len

    @property
    def model_names(self) -> list[str]:
        return [self._model_name]

    @property
    def embedding_models(self) -> list[str]:
        return []

    async def relay_embeddings(self, model: str, body: bytes) -> tuple[int, bytes]:
        raise APIError(404, f"The model '{model}' is not an embedding model here.", param="model")

    async def start(self, on_measured: Callable[[], None] | None = None) -> None:
        """Calibrate the cost model with warm-up steps (off the event loop; with
        ``WarmUp.background``, only the cheap shapes now and the rest while idle), then
        start the engine thread."""
        config = self.scheduler.config
        shape = (config.max_num_seqs, config.max_model_len, config.max_num_batched_tokens)
        warm = self._warm
        started = time.monotonic()
        if warm.background:
            observations, self._calibrating = await asyncio.to_thread(
                start_calibration, self.engine, *shape, warm.repeats, warm.saved
            )
        else:
            observations = await asyncio.to_thread(
                warm_up, self.engine, *shape, warm.repeats, warm.saved
            )
        self.scheduler.calibrate(observations)
        # The compiled decode step may build now: the calibration left waits for it (a
        # build beside its steps would slow them and skew it).
        await asyncio.to_thread(self.engine.warmed_up)
        now = time.monotonic()
        self._calibration_evicts_at = now + CALIBRATION_PATIENCE_SECONDS
        self._calibration_ends_at = now + CALIBRATION_WITHIN_SECONDS
        logger.info(
            "cost model calibrated in %.2fs%s: %s; seat limit %d",
            time.monotonic() - started,
            "" if self._calibrating is None else " (a first fit)",
            self.scheduler.cost.snapshot(),
            self.scheduler.seats.limit,
        )
        self._publish_stats()
        if on_measured is not None:
            on_measured()
        self._thread.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def add_request(
        self, request: Request, stream: RequestStream, call: UpstreamCall | None = None
    ) -> None:
        self._commands.put(_Add(request, stream))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def pause_request(self, request_id: str) -> None:
        """Ask the scheduler to pause a sequence (idempotent: it owns the pause state)."""
        self._commands.put(_Flow(request_id, pause=True))

    def resume_request(self, request_id: str) -> None:
        self._commands.put(_Flow(request_id, pause=False))

    def stats(self) -> CoreStats:
        with self._stats_lock:
            return self._stats

    def estimate(self) -> ServiceEstimate:
        # The seat limiter replaces its estimate whole (a reference read is atomic).
        return self.scheduler.seats.estimate

    # ----------------------------------------------------------- lifetime
    def start_thread(self) -> None:
        """Start the engine thread without a warm-up (tests that drive the core alone)."""
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        running = True
        while running:
            if self.scheduler.preempt_long_pauses() + self.scheduler.release_paced():
                self._publish_stats()
            # Nothing to compute (idle, or every sequence paused or throttled): sleep until a
            # command, a long pause due for preemption, or a throttled sequence's next token.
            block = not self.scheduler.has_schedulable_work
            if self._calibration_expired():
                self._end_calibration()
            if block and self._idle_calibration_fits():
                # Idle: measure the next calibration step, unless a command came.
                running = self._drain_commands(block=False)
                if running and self._idle_calibration_fits():
                    self._calibrate()
                continue
            timeout = self.scheduler.seconds_until_wake() if block else None
            if block and self._calibrating is not None:  # a due step, or its end
                due = 0.5 if time.monotonic() < self._calibration_ends_at else 0.0
                timeout = due if timeout is None else min(timeout, due)
            running = self._drain_commands(block, timeout)
            if not running or not self.scheduler.has_schedulable_work:
                self._batch_size = 0
                if running and self._calibrating is not None:
                    self._follow_compiled_step()
                self._publish_stats()
                continue
            plan = self.scheduler.schedule()
            if plan.is_empty:
                # Waiting work that cannot be admitted yet (e.g. no free KV): wait briefly
                # for a command rather than spin.
                running = self._drain_commands(block=True, timeout=0.005)
                continue
            started = time.perf_counter()
            try:
                result = self.engine.step(plan)
            except Exception:
                logger.exception("engine step failed; failing the batch")
                self._fail_batch([s.request_id for s in plan.sequences])
                continue
            elapsed = time.perf_counter() - started
            self._num_steps += 1
            self._batch_size = len(plan.sequences)
            if not self._compiled_step_changed():  # that step loaded it: not a sample
                self.scheduler.record_step(plan, elapsed)
            events = self.scheduler.update_from_output(plan, result)
            outputs = self._deliveries.assemble(events, self._stop_string)
            if outputs:
                self._post(outputs)
            if self._hooks.on_step is not None:
                self._hooks.on_step(
                    StepStats(
                        elapsed, len(plan.sequences), plan.num_batched_tokens, plan.num_decoding
                    )
                )
            self._publish_stats()
        self._fail_batch(list(self.scheduler.requests), reason="server shutting down")

    def _follow_compiled_step(self) -> None:
        """Idle while the calibration left waits for the compiled step's build or load:
        an empty step lets the engine see it end (it follows the build as it steps)."""
        if self._compiled_step_under_way:
            self.engine.step(StepPlan())
            self._compiled_step_changed()

    @property
    def _compiled_step_under_way(self) -> bool:
        return self.engine.compile_status in COMPILE_UNDER_WAY

    def _calibration_expired(self) -> bool:
        """Is the calibration left past its deadline?  Not while the compiled step builds
        or loads (the calibration waits for it: its deadlines count from the end)."""
        return (
            self._calibrating is not None
            and time.monotonic() >= self._calibration_ends_at
            and not self._compiled_step_under_way
        )

    def _idle_calibration_fits(self) -> bool:
        """Is there a calibration step to take now: no request held, the compiled step
        not building or loading, and enough slots that nothing holds for the next shape
        (the prefix cache's count too once it may empty them)?"""
        remaining = self._calibrating
        if remaining is None or self.scheduler.requests or self._compiled_step_under_way:
            return False
        kv = self.scheduler.kv
        if time.monotonic() >= self._calibration_evicts_at:
            return remaining.fits(kv.num_free_slots)
        return remaining.fits(len(kv.empty_slots()))

    def _calibrate(self) -> None:
        """One step of the calibration left, in empty slots (emptying cached ones, least
        recently used first, when it may and must)."""
        remaining = self._calibrating
        assert remaining is not None
        kv = self.scheduler.kv
        try:
            kv.evict_cached(remaining.slots_needed())  # nothing when enough are empty
            remaining.step(self.engine, kv.empty_slots())
        except Exception:
            logger.exception("a calibration step failed; the live fit goes on alone")
            self._end_calibration()
            return
        if remaining.done:
            self._end_calibration()

    def _end_calibration(self) -> None:
        """The calibration left is over (done, or given up: its measured shapes count)."""
        remaining = self._calibrating
        assert remaining is not None
        self._calibrating = None
        remaining.release(self.engine)
        self.scheduler.calibrate(remaining.observations())
        logger.info(
            "calibration %s while idle (%d of %d shapes): %s; seat limit %d",
            "finished" if remaining.done else "ended",
            len(remaining.measured),
            len(remaining.shapes),
            self.scheduler.cost.snapshot(),
            self.scheduler.seats.limit,
        )
        self._publish_stats()

    def _stop_string(self, request: Request) -> None:
        if not request.status.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def _compiled_step_changed(self) -> bool:
        """Whether the torch engine's compiled decode step came into use (or failed) in the
        step just run.  Its build or load is over: the engine has every thread again, and
        decodes faster once the step is in use.  What the steps beside the build taught
        the scheduler is forgotten (:meth:`Scheduler.engine_changed`; on two cores a
        five-minute build left a seat limit of 2 behind it), and the calibration left,
        which waited for the build, gets its time from now."""
        status = self.engine.compile_status
        if status == self._compile_status:
            return False
        if self._compile_status in COMPILE_UNDER_WAY and status not in COMPILE_UNDER_WAY:
            self.scheduler.engine_changed(decode=status == "ready")
            now = time.monotonic()
            self._calibration_evicts_at = max(
                self._calibration_evicts_at, now + CALIBRATION_PATIENCE_SECONDS
            )
            self._calibration_ends_at = max(
                self._calibration_ends_at, now + CALIBRATION_WITHIN_SECONDS
            )
            if self._calibrating is not None and status == "ready":
                self._calibrating.forget_decode()
        self._compile_status = status
        return True

    def _drain_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Apply every queued command (waiting for the first one when ``block``), then
        publish the stats if any was applied; False once asked to stop."""
        first = True
        while True:
            try:
                if first and block:
                    command = self._commands.get(timeout=timeout)
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                if not first:
                    self._publish_stats()
                return True
            first = False
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                self._deliveries.add(command.request, command.stream)
                self.scheduler.add_request(command.request)
            elif isinstance(command, _Abort):
                self._abort(command)
            elif command.pause:
                self.scheduler.pause(command.request_id)
            else:
                paused_seconds = self.scheduler.resume(command.request_id)
                if paused_seconds is not None and self._hooks.on_resume is not None:
                    self._hooks.on_resume(paused_seconds)

    def _abort(self, command: _Abort) -> None:
        request = self.scheduler.finish_request(command.request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return
        if self._hooks.on_abort is not None:
            self._hooks.on_abort(time.monotonic() - command.requested_at)
        delivery = self._deliveries.end(request, FinishReason.ABORT)
        if delivery is not None:
            self._post([delivery])

    def _fail_batch(self, request_ids: list[str], reason: str = "engine step failed") -> None:
        failed: list[Delivery] = []
        for rid in request_ids:
            request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            if request is not None:
                delivery = self._deliveries.end(request, FinishReason.ERROR, reason)
                if delivery is not None:
                    failed.append(delivery)
        if failed:
            self._post(failed)

    def _post(self, outputs: list[Delivery]) -> None:
        # A closed event loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    @staticmethod
    def _dispatch(outputs: list[Delivery]) -> None:
        for stream, output in outputs:
            stream.put(output)

    def _make_stats(self) -> CoreStats:
        sched = self.scheduler.make_stats()
        return CoreStats(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_paused=sched.num_paused,
            num_throttled=sched.num_throttled,
            num_waiting_by_priority=sched.num_waiting_by_priority,
            num_preemptions_total=sched.num_preemptions_total,
            preemptions_by_reason=sched.preemptions_by_reason,
            num_steps=self._num_steps,
            engine_up=self.engine_up,
            batch_size=self._batch_size if sched.num_running else 0,
            kv_cache=sched.kv_cache,
            kv_cache_bytes=self.engine.kv_cache_bytes,
            compile_status=self._compile_status,
            prefix_cache=sched.prefix_cache,
            speculation=sched.speculation,
            pacing=sched.pacing,
            sections={
                "seats": self.scheduler.seats.snapshot(),
                "cost_model": self.scheduler.cost.snapshot(),
                "prefill": self.scheduler.prefill.snapshot(),
                **self.engine.stats_sections,
                "calibration": (
                    {"complete": True}
                    if self._calibrating is None
                    else {"complete": False, **self._calibrating.snapshot()}
                ),
            },
        )

    def _publish_stats(self) -> None:
        stats = self._make_stats()
        with self._stats_lock:
            self._stats = stats

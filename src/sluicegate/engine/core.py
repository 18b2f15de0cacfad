"""The engine loop: one thread that plans, computes and hands results back.

The event loop never blocks on the engine.  It talks to this thread through a command
queue (add, abort) that is drained before every step, so an abort takes effect before
the next step is planned; results come back once per step through
``loop.call_soon_threadsafe``.  The scheduler's stats are published after every step and
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

from sluicegate.engine.base import Engine
from sluicegate.engine.detokenizer import TextAssembler
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.scheduler.request import FinishReason, Request, RequestStatus
from sluicegate.scheduler.scheduler import Scheduler, SchedulerStats, TokenEvent

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


@dataclass(slots=True)
class StepStats:
    """Figures of one engine step, for metrics."""

    step_seconds: float
    num_seqs: int
    num_batched_tokens: int


@dataclass(slots=True)
class CoreHooks:
    """What the engine thread reports as it goes (called on the engine thread)."""

    #: After every step.
    on_step: Callable[[StepStats], None] | None = None
    #: An abort took effect, this many seconds after it was asked for.
    on_abort: Callable[[float], None] | None = None
    #: A paused sequence was resumed after this many seconds.
    on_resume: Callable[[float], None] | None = None


@dataclass(slots=True)
class EngineCoreStats:
    scheduler: SchedulerStats
    num_steps: int
    engine_up: bool
    #: The engine's compiled decode step (:attr:`Engine.compile_status`).
    compile_status: str = "off"


class EngineCore:
    """Owns the scheduler and the engine; runs them on a dedicated thread."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: TextTokenizer,
        scheduler: Scheduler,
        loop: asyncio.AbstractEventLoop,
        hooks: CoreHooks | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._loop = loop
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._assemblers: dict[str, TextAssembler] = {}
        #: Per request: output tokens already committed before the assembler was built.
        self._committed_base: dict[str, int] = {}
        self._hooks = hooks or CoreHooks()
        self._thread = threading.Thread(target=self._run, name="sluicegate-engine", daemon=True)
        self._num_steps = 0
        #: The engine's compiled decode step as last seen.
        self._compile_status = engine.compile_status
        self.engine_up = True
        self._stats_lock = threading.Lock()
        self._stats = EngineCoreStats(scheduler.make_stats(), 0, True, self._compile_status)

    # ----------------------------------------------------- event-loop side API
    def start(self) -> None:
        self._thread.start()

    def add_request(self, request: Request, stream: RequestStream) -> None:
        self._commands.put(_Add(request, stream))

    def abort_request(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def pause_request(self, request_id: str) -> None:
        """Ask the scheduler to pause a sequence (idempotent: it owns the pause state)."""
        self._commands.put(_Flow(request_id, pause=True))

    def resume_request(self, request_id: str) -> None:
        self._commands.put(_Flow(request_id, pause=False))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout)
        self.engine.close()

    def stats(self) -> EngineCoreStats:
        with self._stats_lock:
            return self._stats

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        running = True
        while running:
            if self.scheduler.preempt_long_pauses() + self.scheduler.release_paced():
                self._publish_stats()
            # Nothing to compute (idle, or every sequence paused or throttled): sleep until a
            # command, a long pause due for preemption, or a throttled sequence's next token.
            block = not self.scheduler.has_schedulable_work
            timeout = self.scheduler.seconds_until_wake() if block else None
            running = self._drain_commands(block, timeout)
            if not running or not self.scheduler.has_schedulable_work:
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
            if not self._compiled_step_changed():  # that step loaded it: not a sample
                self.scheduler.record_step(plan, elapsed)
            events = self.scheduler.update_from_output(plan, result)
            outputs = self._assemble(events)
            if outputs:
                self._post(outputs)
            if self._hooks.on_step is not None:
                self._hooks.on_step(
                    StepStats(elapsed, len(plan.sequences), plan.num_batched_tokens)
                )
            self._publish_stats()
        self._fail_batch(list(self.scheduler.requests), reason="server shutting down")

    def _compiled_step_changed(self) -> bool:
        """Whether the torch engine's compiled decode step came into use (or failed) in the
        step just run.  From then on decode steps take less time than the cost model
        learnt: it relearns them."""
        status = self.engine.compile_status
        if status == self._compile_status:
            return False
        if status == "ready":
            self.scheduler.cost.forget_decode_steps()
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
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command)
            elif command.pause:
                self.scheduler.pause(command.request_id)
            else:
                paused_seconds = self.scheduler.resume(command.request_id)
                if paused_seconds is not None and self._hooks.on_resume is not None:
                    self._hooks.on_resume(paused_seconds)

    def _add(self, command: _Add) -> None:
        request = command.request
        self._streams[request.request_id] = command.stream
        # All known tokens, not only the prompt: a resumed request arrives with the output
        # it already delivered (prompt + committed tokens), and its text continues from
        # there.  Only tokens generated here are committed by this assembler.
        decoder = self.tokenizer.decode_stream(request.all_token_ids)
        self._assemblers[request.request_id] = TextAssembler(decoder, request.sampling.stop)
        self._committed_base[request.request_id] = request.num_output_tokens
        self.scheduler.add_request(request)

    def _abort(self, command: _Abort) -> None:
        request = self.scheduler.finish_request(command.request_id, RequestStatus.FINISHED_ABORTED)
        self._assemblers.pop(command.request_id, None)
        self._committed_base.pop(command.request_id, None)
        stream = self._streams.pop(command.request_id, None)
        if request is not None and self._hooks.on_abort is not None:
            self._hooks.on_abort(time.monotonic() - command.requested_at)
        if stream is not None and request is not None:
            out = RequestOutput(
                request.request_id, "", 0, request.num_prompt_tokens,
                request.num_output_tokens, FinishReason.ABORT,
            )  # fmt: skip
            self._post([(stream, out)])

    def _assemble(self, events: list[TokenEvent]) -> list[tuple[RequestStream, RequestOutput]]:
        outputs: list[tuple[RequestStream, RequestOutput]] = []
        for event in events:
            request = event.request
            token_id = event.new_token_id
            rid = request.request_id
            assembler = self._assemblers.get(rid)
            stream = self._streams.get(rid)
            if assembler is None or stream is None:
                continue
            text = ""
            committed_before = assembler.num_committed_tokens
            # Its last event: the scheduler finished it with this token, or a stop string
            # ends here (drafts verified in the same step may have added tokens after it).
            done = event.finished
            if token_id is not None:
                text = assembler.push(token_id, skip=event.is_stop_token)
                if assembler.stopped and not done:
                    request.finish_reason = FinishReason.STOP
                    if not request.status.is_finished:
                        self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                    del request.all_token_ids[request.num_prompt_tokens + event.num_output_tokens :]
                    done = True
            if done:
                text += assembler.flush()
            committed: list[int] = []
            if assembler.num_committed_tokens > committed_before:
                start = request.num_prompt_tokens + self._committed_base.get(rid, 0)
                committed = request.all_token_ids[
                    start + committed_before : start + assembler.num_committed_tokens
                ]
            if done:
                del self._assemblers[rid]
                del self._streams[rid]
                self._committed_base.pop(rid, None)
            outputs.append(
                (
                    stream,
                    RequestOutput(
                        request_id=rid,
                        text=text,
                        num_new_tokens=1 if token_id is not None else 0,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_output_tokens=event.num_output_tokens,
                        finish_reason=request.finish_reason if done else None,
                        committed_token_ids=committed,
                        num_cached_tokens=min(request.num_cached_tokens, request.num_prompt_tokens),
                    ),
                )
            )
        return outputs

    def _fail_batch(self, request_ids: list[str], reason: str = "engine step failed") -> None:
        failed: list[tuple[RequestStream, RequestOutput]] = []
        for rid in request_ids:
            request = self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            stream = self._streams.pop(rid, None)
            self._assemblers.pop(rid, None)
            self._committed_base.pop(rid, None)
            if request is not None and stream is not None:
                failed.append(
                    (
                        stream,
                        RequestOutput(
                            rid, "", 0, request.num_prompt_tokens, request.num_output_tokens,
                            FinishReason.ERROR, error=reason,
                        ),
                    )
                )  # fmt: skip
        if failed:
            self._post(failed)

    def _post(self, outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
        # A closed event loop means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    @staticmethod
    def _dispatch(outputs: list[tuple[RequestStream, RequestOutput]]) -> None:
        for stream, output in outputs:
            stream.put(output)

    def _publish_stats(self) -> None:
        stats = EngineCoreStats(
            self.scheduler.make_stats(), self._num_steps, self.engine_up, self._compile_status
        )
        with self._stats_lock:
            self._stats = stats

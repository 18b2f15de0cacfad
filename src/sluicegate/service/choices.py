"""An answer of ``n`` choices on the embedded core: one sequence per choice, one stream.

A request for ``n`` > 1 choices is one :class:`~sluicegate.service.generation.Generation`
(one id, one stream, one replay log) whose core runs ``n`` sequences: choice 0 under the
request's own id and seed, choice ``i`` under ``<id>#i`` with the seed ``seed + i``, so
that choice ``i`` is exactly what a request of one choice with that seed answers.
Admission charges ``n × max_tokens`` to the tenant's token bucket; the dispatcher gives
each sequence a seat and its worst-case KV, all of them at once or none.

Choice 0 goes to the engine when the request is dispatched, the others when its first
output arrives: its prompt is then computed and indexed by the prefix cache, and the
others reuse it instead of computing it ``n`` times (their ``cached_tokens`` show it).

:class:`Choices` owns what makes the sequences one answer: each choice's outputs go to
the one stream tagged with its index, a choice that ends says so (``choice_finish``), and
the stream ends, with usage summed, when the last one does.  Cancelling, evicting or
pausing the answer does so to every choice.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace

from sluicegate.engine.base import EngineCore
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.errors import APIError
from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.request import FinishReason, Request, Reuse

_INT64 = 1 << 64


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: ``seed + index``, wrapped into a signed 64-bit integer."""
    return (seed + index + _INT64 // 2) % _INT64 - _INT64 // 2


def choice_request_id(request_id: str, index: int) -> str:
    """The id of choice ``index``'s sequence (choice 0's is the request's own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def sibling_requests(first: Request) -> tuple[Request, ...]:
    """The sequences of choices 1 to ``n - 1`` of a request (``first`` is choice 0's, its
    pace and priority already set): the same prompt, each with its own seed."""
    sampling = first.sampling
    return tuple(
        Request(
            request_id=choice_request_id(first.request_id, index),
            prompt_token_ids=first.prompt_token_ids,
            sampling=replace(sampling, seed=choice_seed(sampling.seed, index)),
            priority=first.priority,
            arrival_time=first.arrival_time,
            pace=replace(first.pace),
            reuse=Reuse(namespace=first.reuse.namespace),
        )
        for index in range(1, sampling.n)
    )


def check_choices_fit(capacity: DispatchCapacity, requests: Sequence[Request]) -> None:
    """Refuse choices that could never be dispatched together: more seats than the
    engine has, or more KV than it holds (in the queue they would wait forever, and
    everything behind them with them)."""
    n = len(requests)
    if n > capacity.max_num_seqs:
        raise APIError(
            400,
            f"n={n} needs {n} sequences at once; this server runs at most "
            f"{capacity.max_num_seqs} (max_num_seqs). Use n <= {capacity.max_num_seqs}.",
            param="n",
            code="invalid_value",
        )
    need = sum(capacity.kv_tokens_for(r.max_total_tokens) for r in requests)
    if need > capacity.kv_capacity_tokens:
        first = requests[0]
        raise APIError(
            400,
            f"n={n} choices of prompt ({first.num_prompt_tokens}) + max_tokens "
            f"({first.sampling.max_tokens}) tokens need {need} tokens of KV cache at once; "
            f"this server holds {capacity.kv_capacity_tokens}. Lower max_tokens or n.",
            param="n",
            code="invalid_value",
        )


class _State(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    ENDED = enum.auto()


#: How a choice's own end is named (``choice_finish``); an abort or a failure ends the
#: whole stream instead.
_OWN_FINISHES = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)


class Choices:
    """The sequences of one answer of ``n`` choices, and its stream.  Owned by the event
    loop; built by the service, which calls :meth:`start` at dispatch."""

    def __init__(
        self, core: EngineCore, stream: RequestStream, requests: Sequence[Request]
    ) -> None:
        self._core = core
        #: The generation's stream (what the engine writes for it).
        self._stream = stream
        self.requests = tuple(requests)
        self._sinks = [_ChoiceSink(self, index) for index in range(len(self.requests))]
        self._states = [_State.WAITING] * len(self.requests)
        #: Each choice's output tokens as its outputs say, and the most prompt tokens a
        #: choice reused from the prefix cache: the stream's usage.
        self._num_output_tokens = [0] * len(self.requests)
        self._num_cached_tokens = 0
        #: How the choices that ended did (None: never started).
        self._reasons: dict[int, FinishReason | None] = {}
        #: The first failure's output: the stream ends with its error.
        self._failure: RequestOutput | None = None

    @property
    def num_output_tokens(self) -> int:
        """Output tokens of every choice so far."""
        return sum(r.num_output_tokens for r in self.requests)

    @property
    def running_ids(self) -> list[str]:
        """The ids of the sequences on the engine now."""
        return [
            r.request_id
            for r, state in zip(self.requests, self._states, strict=True)
            if state is _State.RUNNING
        ]

    def start(self) -> None:
        """Dispatched: choice 0 goes to the engine (the others follow its first output)."""
        self._run(0)

    def abort(self) -> None:
        """End every choice: those on the engine are aborted (each ends with an abort
        output), those not started yet give back their seats."""
        for index, state in enumerate(self._states):
            if state is _State.RUNNING:
                self._core.abort_request(self.requests[index].request_id)
            elif state is _State.WAITING:
                self._give_up(index)

    def put(self, index: int, output: RequestOutput) -> None:
        """An output of choice ``index``'s sequence (the engine's, on the event loop)."""
        if index == 0 and _State.WAITING in self._states:
            self._first_output(output)
        self._num_output_tokens[index] = output.num_output_tokens
        self._num_cached_tokens = max(self._num_cached_tokens, output.num_cached_tokens)
        output.index = index
        output.num_output_tokens = sum(self._num_output_tokens)
        output.num_cached_tokens = self._num_cached_tokens
        reason = output.finish_reason
        if reason is not None:
            self._states[index] = _State.ENDED
            self._reasons[index] = reason
            if reason in _OWN_FINISHES:
                output.choice_finish = reason.value
            elif reason is FinishReason.ERROR and self._failure is None:
                self._failure = output
                self.abort()  # the stream ends with the failure, now
            output.finish_reason = self._final_reason()
            if output.finish_reason is FinishReason.ERROR and self._failure is not output:
                assert self._failure is not None
                output.error, output.failure = self._failure.error, self._failure.failure
        self._stream.put(output)

    def _first_output(self, output: RequestOutput) -> None:
        """Choice 0's prompt is computed: the others start now, reusing it (or never, if
        choice 0 was aborted or failed before its first token)."""
        failed = output.finish_reason in (FinishReason.ABORT, FinishReason.ERROR)
        paused = self.requests[0].pause.paused
        for index, state in enumerate(self._states):
            if state is not _State.WAITING or index == 0:
                continue
            if failed:
                self._give_up(index)
                continue
            self._run(index)
            if paused:  # flow control paused the answer: every choice waits for its reader
                self._core.pause_request(self.requests[index].request_id)

    def _run(self, index: int) -> None:
        self._states[index] = _State.RUNNING
        self._core.add_request(self.requests[index], self._sinks[index])

    def _give_up(self, index: int) -> None:
        """A choice that never started: its seat and KV go back to the dispatcher."""
        self._states[index] = _State.ENDED
        self._reasons[index] = None
        self._core.capacity.release(self.requests[index].request_id)

    def _final_reason(self) -> FinishReason | None:
        """The stream's finish once every choice ended (None before): a failure, else an
        abort, else the reason of the choice that ended last."""
        if _State.ENDED not in self._states or any(s is not _State.ENDED for s in self._states):
            return None
        reasons = set(self._reasons.values())
        for worst in (FinishReason.ERROR, FinishReason.ABORT):
            if worst in reasons:
                return worst
        if None in reasons:
            return FinishReason.ABORT
        return next(r for r in reversed(self._reasons.values()) if r is not None)


class _ChoiceSink(RequestStream):
    """What one choice's sequence writes to: an adapter that hands each output on to its
    answer's :class:`Choices` (the engine core writes to a :class:`RequestStream`)."""

    def __init__(self, choices: Choices, index: int) -> None:
        super().__init__(choices.requests[index].request_id)
        self._choices = choices
        self._index = index

    def put(self, output: RequestOutput) -> None:
        self._choices.put(self._index, output)

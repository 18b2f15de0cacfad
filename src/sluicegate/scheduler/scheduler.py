"""Continuous batching under a token budget.

There are no prefill and decode phases: each request has ``num_computed_tokens`` and a
target (all of its known tokens), and every step hands out tokens under
``max_num_batched_tokens``: decoding sequences first, then prompts (running chunked
prefills and waiting requests) in their lanes' order, within the time the decoders leave
under their TPOT objective (stall-free prefill, ``scheduler/prefill.py``), in chunks.

The scheduler owns a sequence's pause state (flow control asks; a paused sequence is
skipped, and preempted when paused too long or when its slot is needed), its pace (one
capped by ``max_tokens_per_second`` that must sit out more than a step is *throttled*,
treated like a paused one; under ``qoe`` one far ahead of its reader *yields* steps,
``scheduler/pacing.py``) and engine capacity (:class:`DispatchCapacity`, which the
dispatcher asks before handing work over).  An idle sequence, paused or throttled,
lends its dispatch seat to queued work, so slow readers cannot hold every seat.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sluicegate.scheduler.capacity import DispatchCapacity
from sluicegate.scheduler.cost_model import StepCostModel, StepShape
from sluicegate.scheduler.idle import IdleSequences, is_idle
from sluicegate.scheduler.kv_cache import KVCacheManager
from sluicegate.scheduler.pacing import ReaderPacing
from sluicegate.scheduler.prefill import PrefillCandidate, PrefillPlanner
from sluicegate.scheduler.request import FinishReason, Request, RequestStatus
from sluicegate.scheduler.seat_limit import SeatLimitConfig, SeatLimiter
from sluicegate.scheduler.speculation import Speculator
from sluicegate.scheduler.state import (
    Counters,
    PreemptReason,
    SchedulerConfig,
    SchedulerStats,
    TokenEvent,
)
from sluicegate.scheduler.step import ScheduledSequence, StepPlan, StepResult
from sluicegate.scheduler.waiting import WaitingQueue

__all__ = ["PreemptReason", "Scheduler", "SchedulerConfig", "SchedulerStats", "TokenEvent"]

_LENGTH = RequestStatus.FINISHED_LENGTH


class Scheduler:
    """CPU-only bookkeeping; single-threaded (the engine thread owns it)."""

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_ids: tuple[int, ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        #: Wall time of the latest step: a sequence whose pace makes it sit out longer than
        #: this lends its seat.
        self._last_step_seconds = 0.0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(
            config.max_num_seqs,
            config.total_kv_blocks,
            config.kv_block_size,
            prefix_caching=config.prefix_caching,
            cache_answers=config.cache_answers,
        )
        #: What the dispatcher may still hand over; kept by this scheduler alone.
        self.capacity = DispatchCapacity(
            config.max_num_seqs, config.total_kv_blocks * config.kv_block_size, config.kv_block_size
        )
        if self.kv.prefix is not None:
            self.capacity.cached_prefix = self.kv.prefix.peek
        #: Step time from the batch's shape, learnt from every step.
        self.cost = StepCostModel()
        #: Stall-free prefill: its budget in each step, and the lanes' order.
        self.prefill = PrefillPlanner(config.prefill, self.cost, config.max_num_batched_tokens)
        #: How many sequences may decode at once under the TPOT objective.
        self.seats = SeatLimiter(
            SeatLimitConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                tpot_objective_seconds=config.tpot_objective_seconds,
                min_prefill_chunk_tokens=config.prefill.min_chunk_tokens,
            ),
            self.cost,
            clock,
            self.prefill,
        )
        #: Pace-aware scheduling: each reader's clock, and who sits out a step (qoe).
        self.pacing = ReaderPacing(config.pacing)
        #: Prompt-lookup speculative decoding: who drafts, and what drafts earned.
        self.speculator = Speculator(config.speculation, config.max_model_len)
        self.waiting = WaitingQueue()
        #: Paused and throttled sequences, and those parked (their KV freed while idle).
        self.idle = IdleSequences(self.capacity, self.waiting, clock)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._freed_slots: list[int] = []
        self._counters = Counters()
        self._finished_since_last_step: list[Request] = []

    # ----------------------------------------------------------------- intake
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if request.num_prompt_tokens == 0:
            raise ValueError("a request needs at least one prompt token")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (e.g. abort) a request wherever it is; frees its slot and blocks."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.idle.parked)

    @property
    def has_schedulable_work(self) -> bool:
        """False when everything left is paused or throttled: the engine thread may sleep
        (until :meth:`seconds_until_wake`).  Call :meth:`release_paced` first."""
        return len(self.waiting) > 0 or any(not is_idle(r) for r in self.running)

    # --------------------------------------------------------------- planning
    def schedule(self) -> StepPlan:
        self.release_paced()
        budget = self.config.max_num_batched_tokens
        plan = StepPlan(freed_kv_slots=self._freed_slots)
        self._freed_slots = []

        now = self._clock()
        self.pacing.plan(self.running, len(self.waiting), now)
        self.speculator.begin_step(
            sum(1 for r in self.running if not is_idle(r) and r.num_output_tokens)
        )
        # Decoding sequences, oldest first; an idle or yielding one, or one whose pace does
        # not allow a token yet, costs nothing.  When KV blocks run out, preempt (idle
        # ones first, then the newest).  Drafts only where there is room for them.
        decoded: list[tuple[Request, int]] = []
        placed: set[str] = set()
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            idx += 1
            if request.num_tokens - request.num_computed_tokens != 1 or self._sits_out(
                request, now
            ):
                continue
            drafts = self.speculator.drafts(request, budget)
            if not drafts or not self.kv.ensure_capacity(
                request.request_id, request.num_computed_tokens + 1 + len(drafts)
            ):
                drafts = []
                if not self._make_room(request, request.num_computed_tokens + 1, placed):
                    break  # the request preempted itself: nothing smaller fits
                idx = self.running.index(request) + 1  # victims before it left the list
            plan.sequences.append(self._scheduled(request, 1, drafts))
            decoded.append((request, 1 + len(drafts)))
            placed.add(request.request_id)
            budget -= 1 + len(drafts)

        # Then prompts (running chunked prefills, waiting requests) in their lanes' order,
        # within the token budget and the time the decoders leave (scheduler/prefill.py).
        share = self.seats.prefill_per_decode
        time_left = self.prefill.time_budget([r for r, _ in decoded], StepShape.of(plan), share)
        candidates = self._prefill_candidates(now)
        given: dict[str, int] = {}
        waiting_blocked = admitted = False
        for candidate in self.prefill.order(candidates, now):
            request = candidate.request
            if budget <= 0 or (waiting_blocked and not candidate.running):
                continue
            if candidate.running and request.status != RequestStatus.RUNNING:
                continue  # preempted for another's room this step
            if not candidate.running and admitted:
                self._refresh_hit(candidate)  # an admission before it may have taken it
            start = request.num_computed_tokens if candidate.running else candidate.start
            num_new = self.prefill.tokens_for(
                time_left, request, start, min(request.num_tokens - start, budget), now
            )
            if num_new <= 0:
                break  # the step's time is spent
            if candidate.running:
                if not self._make_room(request, start + num_new, placed):
                    continue
            elif self._admit(plan, candidate, num_new):
                admitted = True
            else:
                waiting_blocked = True  # no slot or blocks: nothing waiting starts
                continue
            plan.sequences.append(self._scheduled(request, num_new))
            # A long prompt decodes nothing yet: it lends its seat until nearly done.
            long = self.prefill.is_long(request, start + num_new)
            self.capacity.set_prefilling(request.request_id, long)
            time_left.spend(start, num_new)
            given[request.request_id] = num_new
            placed.add(request.request_id)
            budget -= num_new
        self.prefill.after_step(candidates, given, decoded, time_left, now)

        self._counters.steps += 1
        return plan

    def _prefill_candidates(self, now: float) -> list[PrefillCandidate]:
        """Running sequences still prefilling (not sitting out) and waiting requests,
        each from where it would start (a waiting one's prefix-cache hit)."""
        out = [
            PrefillCandidate(r, r.num_computed_tokens, running=True, rank=i)
            for i, r in enumerate(self.running)
            if r.num_tokens - r.num_computed_tokens > 1 and not self._sits_out(r, now)
        ]
        for i, request in enumerate(self.waiting.ordered(), start=len(self.running)):
            candidate = PrefillCandidate(request, request.num_computed_tokens, False, rank=i)
            out.append(self._refresh_hit(candidate))
        return out

    def _refresh_hit(self, candidate: PrefillCandidate) -> PrefillCandidate:
        """A waiting candidate's prefix-cache hit as the cache stands now, and its start."""
        prefix = self.kv.prefix
        hit = prefix.hit_for(candidate.request) if prefix is not None else None
        candidate.hit = hit
        candidate.start = candidate.request.num_computed_tokens if hit is None else hit.num_tokens
        return candidate

    def _make_room(self, request: Request, num_tokens: int, placed: set[str]) -> bool:
        """Blocks for ``num_tokens`` positions of a running sequence, preempting others
        (idle ones first, then the newest not yet in this step).  False when there is no
        room (it may have preempted itself)."""
        while not self.kv.ensure_capacity(request.request_id, num_tokens):
            victim = self._pick_victim(placed)
            if victim is None:
                return False
            self._preempt(victim, PreemptReason.KV_PRESSURE)
            if victim is request:
                return False
        return True

    def _admit(self, plan: StepPlan, candidate: PrefillCandidate, num_new: int) -> bool:
        """Start a waiting request: a slot (an idle sequence's, if none is free), blocks
        for its first chunk, and its prefix-cache hit (adopted or copied).  False when
        there is no room."""
        request, start, hit = candidate.request, candidate.start, candidate.hit
        if self.kv.num_free_slots == 0:
            # An idle sequence's slot is unused: hand it to waiting work (the idle
            # sequence keeps its tokens and re-prefills when its reader catches up or
            # its pace allows the next token).
            idle = self.idle.victim(self.running)
            if idle is None:
                return False
            self._preempt(idle, PreemptReason.KV_PRESSURE)
        if not self.kv.ensure_capacity(request.request_id, start + num_new):
            return False
        self.waiting.remove(request.request_id)
        adopt = hit.slot if hit is not None and hit.idle else None
        slot = self.kv.allocate_slot(adopt, keep_tokens=start)
        assert slot is not None
        if hit is not None and adopt is None:
            plan.kv_copies.append((hit.slot, slot, start))
        if self.kv.prefix is not None:
            self.kv.prefix.admitted(request, start, hit)
        request.num_computed_tokens = start
        request.kv_slot = slot
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        return True

    def _remember(self, request: Request) -> None:
        if self.kv.prefix is not None:
            self.kv.prefix.remember(request)

    def _scheduled(
        self, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledSequence:
        assert request.kv_slot is not None
        return ScheduledSequence(
            request_id=request.request_id,
            kv_slot=request.kv_slot,
            all_token_ids=request.all_token_ids,
            start_position=request.num_computed_tokens,
            num_new_tokens=num_new,
            sample=request.num_computed_tokens + num_new == request.num_tokens,
            sampling=request.sampling,
            num_prompt_tokens=request.num_prompt_tokens,
            draft_token_ids=drafts or [],
            compiled_from=request.reuse.compiled_from,
        )

    def _sits_out(self, request: Request, now: float) -> bool:
        """Idle, yielding to readers behind it, or its pace allows no token yet."""
        paced = request.pace.capped and now < request.pace.next_token_time
        decoding = request.num_computed_tokens + 1 >= request.num_tokens  # not a prefill
        return is_idle(request) or request.pace.yielding or (paced and decoding)

    def _pick_victim(self, placed: set[str]) -> Request | None:
        """Whose KV to free: an idle sequence, else the newest not in this step yet."""
        idle = self.idle.victim(self.running)
        if idle is not None:
            return idle
        return next((r for r in reversed(self.running) if r.request_id not in placed), None)

    # ------------------------------------------------------------ cost and seats
    def calibrate(self, observations: list[tuple[StepShape, float]]) -> None:
        """Seed the cost model with warm-up steps, then size the seats from it."""
        self.cost.calibrate(observations)
        self.seats.update(self.capacity.num_holding)
        self.capacity.set_seat_limit(self.seats.limit)

    def engine_changed(self, *, decode: bool) -> None:
        """The engine computes otherwise now (a compiled step's build or load ended; with
        ``decode``, that step is in use): the steps before taught nothing that holds."""
        self.cost.forget_steps(decode_anchors=decode)
        self.prefill.restart()
        self.seats.restart()
        self.seats.update(self.capacity.num_holding, len(self.waiting))
        self.capacity.set_seat_limit(self.seats.limit)

    def record_step(self, plan: StepPlan, seconds: float) -> None:
        """A step ran in ``seconds``: learn from it, and move the seat limit if due."""
        shape = StepShape.of(plan)
        self._last_step_seconds = seconds
        self.prefill.observe(shape, plan.num_decoding, seconds)
        self.cost.observe(shape, seconds)
        self.seats.on_step(shape, plan.num_decoding, seconds)
        if self.seats.update(self.capacity.num_holding, len(self.waiting)):
            self.capacity.set_seat_limit(self.seats.limit)

    # ------------------------------------------------------------ flow control
    def pause(self, request_id: str) -> bool:
        """Stop scheduling a sequence (its reader is behind); it keeps its KV for now.

        A paused sequence holds no dispatch capacity: waiting work may take its slot.
        """
        request = self.requests.get(request_id)
        return request is not None and self.idle.pause(request)

    def resume(self, request_id: str) -> float | None:
        """Schedule a paused sequence again; returns how long it was paused (None: it was not)."""
        request = self.requests.get(request_id)
        return None if request is None else self.idle.resume(request)

    def release_paced(self) -> int:
        """Take back the seats of throttled sequences whose pace allows a token now."""
        return self.idle.release_paced()

    def seconds_until_wake(self) -> float | None:
        """Until an idle sequence needs the engine thread: a long pause due for
        preemption or a throttled sequence's next token (None: nothing pending)."""
        due = [self.seconds_until_long_pause(), self.idle.seconds_until_next_token()]
        pending = [seconds for seconds in due if seconds is not None]
        return min(pending) if pending else None

    def preempt_long_pauses(self) -> int:
        """Free the KV of sequences paused longer than ``pause_preempt_seconds`` (they
        keep their tokens and re-prefill when their readers catch up); how many."""
        limit = self.config.pause_preempt_seconds
        if limit is None:
            return 0
        now = self._clock()
        due = [r for r in self.running if r.pause.paused and now - r.pause.since >= limit]
        for request in due:
            self._preempt(request, PreemptReason.LONG_PAUSE)
        return len(due)

    def seconds_until_long_pause(self) -> float | None:
        """Until the next long-pause preemption is due (None: none is pending)."""
        limit = self.config.pause_preempt_seconds
        if limit is None:
            return None
        started = [r.pause.since for r in self.running if r.pause.paused]
        if not started:
            return None
        return max(0.0, min(started) + limit - self._clock())

    def _preempt(self, request: Request, reason: PreemptReason) -> None:
        """Free a running sequence's KV; keep its tokens; it re-prefills when re-admitted."""
        self.running.remove(request)
        self._remember(request)
        self.kv.free(request.request_id, request.kv_slot)
        if request.kv_slot is not None:
            self._freed_slots.append(request.kv_slot)
        request.kv_slot = None
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        counts = self._counters.preemptions
        counts[reason.value] = counts.get(reason.value, 0) + 1
        self.idle.preempted(request)

    # ---------------------------------------------------------------- results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[TokenEvent]:
        """Advance each planned sequence; append sampled tokens (and the drafts verified
        with them); finish on EOS or length."""
        events: list[TokenEvent] = []
        for seq in plan.sequences:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += seq.num_new_tokens
            if (compiled_from := result.compiled_from.get(seq.request_id)) is not None:
                request.reuse.compiled_from = compiled_from
            if seq.start_position < request.num_prompt_tokens:
                self._remember(request)  # its prompt's blocks: for requests that share them
            if not seq.sample:
                continue
            tokens = [result.sampled_token_ids[seq.request_id]]
            if seq.draft_token_ids:
                tokens.extend(result.draft_sampled_token_ids[seq.request_id])
                tokens = self.speculator.verify(request, seq.draft_token_ids, tokens)
                # The accepted drafts' positions are computed (each equals its token).
                request.num_computed_tokens += len(tokens) - 1
            logprobs = result.logprobs.get(seq.request_id)
            for k, token_id in enumerate(tokens):
                request.all_token_ids.append(token_id)
                stop = request.is_stop_token(token_id, self.eos_token_ids)
                reason = self._after_token(request, stop)
                end = reason is not None
                event = TokenEvent(request, token_id, end, stop, request.num_output_tokens)
                if logprobs is not None:
                    event.logprobs = logprobs[k]
                events.append(event)
                if end:
                    break
        return events

    def _after_token(self, request: Request, is_stop_token: bool) -> FinishReason | None:
        """A sampled token was appended: pace the sequence, or finish it on a stop token
        or its length (returns why it finished)."""
        reason = FinishReason.STOP if is_stop_token else self._check_length(request)
        self.pacing.note_token(request, self._clock())
        if reason is None and request.pace.after_tokens(self._clock()) > self._last_step_seconds:
            # Its next token is more than a step away: it sits out and lends its seat.
            self.idle.set_throttled(request, True)
        if reason is not None:
            # The prompt it made the engine compute: cache hits are not prefill load.
            computed = request.num_prompt_tokens - min(
                request.reuse.num_cached_tokens, request.num_prompt_tokens - 1
            )
            self.seats.on_finished(computed, request.num_output_tokens)
            request.finish_reason = reason
            stopped = reason == FinishReason.STOP
            self._finish(request, RequestStatus.FINISHED_STOPPED if stopped else _LENGTH)
        return reason

    def _check_length(self, request: Request) -> FinishReason | None:
        if request.num_output_tokens >= request.sampling.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request.request_id)
        self._remember(request)
        self.kv.free(request.request_id, request.kv_slot)
        if request.kv_slot is not None:
            self._freed_slots.append(request.kv_slot)
        request.kv_slot = None
        request.status = status
        self.idle.finished(request)
        self.capacity.release(request.request_id)
        if request.finish_reason is None:
            request.finish_reason = FinishReason.of_status(status)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerStats:
        by_priority: dict[int, int] = {}
        for request in self.waiting:
            by_priority[request.priority] = by_priority.get(request.priority, 0) + 1
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_paused=sum(1 for r in self.running if r.pause.paused)
            + sum(1 for r in self.idle.parked.values() if r.pause.paused),
            num_throttled=len(self.idle.throttled),
            kv_cache=self.kv.stats(),
            num_preemptions_total=sum(self._counters.preemptions.values()),
            preemptions_by_reason=dict(self._counters.preemptions),
            num_waiting_by_priority=by_priority,
            prefix_cache=self.kv.prefix.snapshot() if self.kv.prefix is not None else None,
            speculation=self.speculator.snapshot() if self.config.speculation.enabled else None,
            pacing=self.pacing.snapshot() if self.config.pacing.enabled else None,
        )

"""The service: a request's way from the front door to the engine, and its end.

One :class:`Service` exists once the engine has loaded, with every stage it joins:
admission, the dispatcher and its fair queue, and the engine core (the thread that runs
the scheduler and the engine, or upstream mode's relay to a pool of servers).  It turns
a validated request into a :class:`Generation`, moves its :class:`Life` to its end
exactly once, records what the end leaves behind, and pauses, resumes or evicts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from sluicegate.admission.controller import Admitted
from sluicegate.admission.decision import Rejection, RejectReason
from sluicegate.admission.limits import BucketFactory
from sluicegate.admission.request_objective import RequestObjective
from sluicegate.admission.tenants import AuthError, Tenant
from sluicegate.config import Settings
from sluicegate.engine.base import CoreHooks, EngineCore, StepStats
from sluicegate.engine.factory import LoadedEngine, build_core, build_engine
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.engine.upstream.wire import UpstreamCall
from sluicegate.errors import APIError
from sluicegate.metrics.registry import Metrics
from sluicegate.pipeline.chain import StageChain
from sluicegate.pipeline.pipelines import Pipelines, check_pipeline_models
from sluicegate.queue.dispatcher import Dispatcher
from sluicegate.queue.ticket import Ticket
from sluicegate.scheduler.request import FinishReason, Request, Reuse, SamplingParams
from sluicegate.service.build import (
    apply_pace,
    build_admission,
    build_slo,
    log_auto_objective,
    prefix_namespace,
    queue_config,
    resolve_auto_objective,
    store_refusal,
)
from sluicegate.service.choices import Choices, check_choices_fit, sibling_requests
from sluicegate.service.generation import Generation, Life
from sluicegate.service.ownership import Owner, new_resume_token, resume_token_digest
from sluicegate.service.records import LatencyWindows, record_delivery, record_end
from sluicegate.store.errors import StoreUnavailable
from sluicegate.types import PriorityClass

logger = logging.getLogger(__name__)


class Service:
    """Admission, queue and engine core, joined.  Owned by the event loop."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        loaded: LoadedEngine,
        loop: asyncio.AbstractEventLoop,
        bucket_factory: BucketFactory | None = None,
        require_store: Callable[[], None] | None = None,
    ) -> None:
        """``require_store`` raises :class:`StoreUnavailable` when requests must be refused
        because the shared store is down (``store_failure_mode`` fail_closed)."""
        self.settings = settings
        self._require_store = require_store
        self.metrics = metrics
        self.tokenizer: TextTokenizer = loaded.tokenizer
        #: Sampling of a request that sets none (the model's recommended sampling).
        self.sampling_defaults = loaded.sampling_defaults
        hooks = CoreHooks(
            on_step=self._on_step,
            on_abort=metrics.cancel_latency_seconds.observe,
            on_resume=metrics.stream_pause_seconds.observe,
        )
        self._loop = loop
        self.core: EngineCore = build_core(settings, loaded, loop, hooks, metrics.registry)
        admission = build_admission(settings, bucket_factory)
        self.tenants = admission.tenants
        self.admission = admission.controller
        self.estimator = admission.estimator
        self.breaker = admission.breaker
        self.slo = build_slo(settings, self.core.estimate)
        self.dispatcher = Dispatcher(
            queue_config(settings),
            {t.name: t.weight for t in self.tenants.tenants},
            self.core.capacity,
            self.estimator,
            metrics,
            max_queue_wait_seconds=settings.max_queue_wait_seconds,
            submit=self._submit,
            on_refused=self._refused,
            breaker=self.breaker,
            slo=self.slo,
        )
        self.core.capacity.on_change = self._capacity_changed
        #: Live requests by id; an entry leaves when its request ends.
        self.generations: dict[str, Generation] = {}
        self.pipelines = Pipelines([])
        self.latency = LatencyWindows()

    @classmethod
    async def load(
        cls,
        settings: Settings,
        metrics: Metrics,
        bucket_factory: BucketFactory | None = None,
        require_store: Callable[[], None] | None = None,
    ) -> Service:
        """Load the engine off the event loop (so ``/health`` answers meanwhile), then start."""
        loaded = await asyncio.to_thread(build_engine, settings)
        service = cls(
            settings, metrics, loaded, asyncio.get_running_loop(), bucket_factory, require_store
        )
        service.pipelines = await asyncio.to_thread(Pipelines, settings.pipelines)
        core = service.core
        check_pipeline_models(service.pipelines, core.model_names, core.features.relays)
        await core.start(service._measured)
        service.dispatcher.start()
        metrics.engine_up.labels(metrics.engine).set(1)
        logger.info(
            "engine %s ready: model %s, max_model_len %d; default sampling: %s",
            settings.engine,
            service.model_name,
            core.max_model_len,
            service.sampling_defaults.describe(),
        )
        return service

    def _measured(self) -> None:
        """The core's estimate reflects measurements: size an automatic objective."""
        log_auto_objective(resolve_auto_objective(self.settings, self.core.estimate(), self.slo))

    @property
    def model_names(self) -> list[str]:
        """Every model served: the engine's, or what the upstreams serve."""
        return self.core.model_names

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def embedding_models(self) -> list[str]:
        """Embedding models the core relays to (upstream mode: the upstreams')."""
        return self.core.embedding_models

    async def relay_embeddings(self, model: str, body: bytes) -> tuple[int, bytes]:
        return await self.core.relay_embeddings(model, body)

    def model_max_len(self, model: str) -> int:
        """The context ``model`` takes (in front of upstreams: what they say of it)."""
        return self.core.model_max_len(model)

    @property
    def model_name(self) -> str:
        """The model of a request that names none (the first an upstream serves)."""
        names = self.model_names
        return names[0] if names else ""

    async def close(self) -> None:
        await self.dispatcher.stop()
        await self.core.close()

    # ------------------------------------------------------------ admission
    def authenticate(self, authorization: str | None) -> Tenant:
        try:
            return self.tenants.authenticate(authorization)
        except AuthError as exc:
            self.metrics.rejections_total.labels(RejectReason.AUTH.value).inc()
            raise exc.to_rejection().to_error() from None

    async def submit(
        self,
        tenant: Tenant,
        priority: str | None,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens_per_second: float | None = None,
        *,
        output_token_ids: Sequence[int] = (),
        compiled_from: int | None = None,
        resumed: bool = False,
        resume_token_sha256: str | None = None,
        request_charged: bool = False,
        rate_limits_charged: bool = False,
        upstream_call: UpstreamCall | None = None,
        chain: StageChain | None = None,
        arrival_time: float | None = None,
        objective: RequestObjective | None = None,
    ) -> Generation:
        """Admit and queue a request; it reaches the engine when the dispatcher has room.

        A ``resumed`` stream continues on this replica after ``output_token_ids`` (delivered
        elsewhere): it re-prefills them, and its tenant's rate limits are not charged again;
        it keeps its resume token (``resume_token_sha256``) and ``Reuse.compiled_from``.
        ``request_charged``: :meth:`charge_request` took its request as it arrived;
        ``rate_limits_charged``: a background job, whose buckets were charged at
        submission.  Raises the :class:`APIError` that refuses it.  A pipeline's request
        comes with its output stages (``chain``: the engine writes its head; the caller
        closes it if this raises) and arrived before its retrieval (``arrival_time``).
        ``objective``: what the request stated for itself (its TTFT objective, its deadline).
        """
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            all_token_ids=[*prompt_ids, *output_token_ids],
            reuse=Reuse(prefix_namespace(self.settings, tenant.name), compiled_from=compiled_from),
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        apply_pace(self.settings, tenant, request, max_tokens_per_second)
        priority_class = tenant.class_for(priority)
        request.priority = priority_class.rank
        # n > 1 on the embedded core: a sequence per choice (an upstream is sent n).
        siblings = () if self.core.features.relays else sibling_requests(request)
        if siblings:
            check_choices_fit(self.core.capacity, (request, *siblings))
        admitted = await self._admit(
            tenant,
            priority_class,
            request,
            rate_limited=not (resumed or rate_limits_charged),
            request_charged=request_charged,
        )
        ticket = Ticket(
            request,
            tenant,
            priority_class,
            admitted,
            time.monotonic(),
            siblings=siblings,
            objective=objective or RequestObjective(),
        )
        token = new_resume_token() if resume_token_sha256 is None else None
        digest = resume_token_digest(token) if token is not None else resume_token_sha256 or ""
        stream = RequestStream(request_id) if chain is None else chain.tail
        choices = None
        if siblings:
            produced = stream if chain is None else chain.head
            choices = Choices(self.core, produced, (request, *siblings))
        generation = Generation(
            request_id,
            request,
            stream,
            ticket,
            Owner(tenant.name, digest),
            priority_class.value,
            resume_token=token,
            num_resumed_tokens=len(output_token_ids),
            chain=chain,
            upstream_call=upstream_call,
            choices=choices,
        )
        self.generations[request_id] = generation
        try:
            await self.dispatcher.enqueue(ticket)
        except BaseException:
            # Refused, or the client left while a full queue made it wait: nothing to keep.
            self.dispatcher.cancel(ticket)
            del self.generations[request_id]
            raise
        if not resumed:
            self.metrics.prompt_tokens_total.inc(len(prompt_ids))
        return generation

    async def charge_request(self, tenant: Tenant) -> None:
        """Take the tenant's request as it arrives, before its body is read: a flood of
        large or invalid bodies is limited like any other requests.  Raises the 429 (or
        the store's 503) that refuses it."""
        try:
            self._check_store()
            refusal = await self.admission.charge_request(tenant)
        except StoreUnavailable as error:
            raise self._store_refusal(error) from None
        if refusal is not None:
            self.dispatcher.count_rejection(refusal)
            raise refusal.to_error()

    async def charge_tokens(self, tenant: Tenant, prompt_tokens: int, max_tokens: int) -> None:
        """Take a background job's tokens when it is submitted (it runs later uncharged)."""
        try:
            refusal = await self.admission.charge_tokens(tenant, prompt_tokens, max_tokens)
        except StoreUnavailable as error:
            raise self._store_refusal(error) from None
        if refusal is not None:
            self.dispatcher.count_rejection(refusal)
            raise refusal.to_error()

    async def _admit(
        self,
        tenant: Tenant,
        priority_class: PriorityClass,
        request: Request,
        *,
        rate_limited: bool,
        request_charged: bool,
    ) -> Admitted:
        try:
            self._check_store()
            admitted = await self.admission.admit_async(
                tenant,
                priority_class,
                request.num_prompt_tokens,
                # Every choice may generate max_tokens (the prompt is shared).
                request.sampling.max_tokens * request.sampling.n,
                rate_limited=rate_limited,
                request_charged=request_charged,
            )
        except StoreUnavailable as error:
            raise self._store_refusal(error) from None
        if isinstance(admitted, Rejection):
            self.dispatcher.count_rejection(admitted)
            raise admitted.to_error()
        return admitted

    def _check_store(self) -> None:
        if self._require_store is not None:
            self._require_store()

    def _store_refusal(self, error: StoreUnavailable) -> APIError:
        """store_failure_mode fail_closed: no shared state, no admission."""
        self.metrics.rejections_total.labels(RejectReason.STORE_UNAVAILABLE.value).inc()
        return store_refusal(error)

    # ------------------------------------------------------------ the end of a life
    def cancel(self, generation: Generation, status: str = "cancelled") -> None:
        """The client went away or cancelled: abort the sequence before the next step."""
        if generation.ended:
            return
        ticket = generation.ticket
        if ticket is not None and ticket.rejection is not None:
            # Refused from the queue, left before reading it: counted once, as refused.
            self.complete(generation, "refused")
            return
        self._let_go(generation)
        self.metrics.cancellations_total.inc()
        self._end(generation, Life.CANCELLED, status)

    def stop(self, generation: Generation, status: str) -> None:
        """Stop before the end, to be continued (drain, detach grace, lease lost).

        A resumable stream keeps its token reservation (its continuation is not charged
        again); its output ends with an abort, and its stream says how to resume.
        """
        if generation.ended:
            return
        if not self._let_go(generation):
            request = generation.request
            generation.stream.put(
                RequestOutput(
                    request.request_id, "", 0, request.num_prompt_tokens, 0, FinishReason.ABORT
                )
            )
        self._end(generation, Life.STOPPED, status)

    def complete(self, generation: Generation, status: str) -> None:
        """Its final output was delivered (``status``: the finish reason, or ``error``).

        An error that is the queue's refusal after admission (dropped, expired, deadline
        unreachable) is recorded as ``refused``: it is counted among the rejections too,
        and the engine did not fail."""
        if generation.ended:
            return
        ticket = generation.ticket
        if status == "error" and ticket is not None and ticket.rejection is not None:
            status = "refused"
        self._end(generation, Life.COMPLETED, status)

    def evicted(self, generation: Generation) -> None:
        """Its client stopped reading and was cut off (flow control aborted the sequence)."""
        if not generation.ended:
            self._end(generation, Life.CANCELLED, "evicted")

    def _let_go(self, generation: Generation) -> bool:
        """Take a live request out of the queue or the engine; False if it was queued."""
        ticket = generation.ticket
        if ticket is not None and self.dispatcher.cancel(ticket):
            return False
        if generation.choices is not None:
            generation.choices.abort()
        else:
            self.core.abort_request(generation.request_id)
        return True

    def _end(self, generation: Generation, life: Life, status: str) -> None:
        generation.life = life
        if generation.chain is not None:
            generation.chain.close()
        self.generations.pop(generation.request_id, None)
        if generation.ticket is not None:
            keep = life is Life.STOPPED and generation.resumable
            self.dispatcher.finished(generation.ticket, keep_reservation=keep)
        record_end(self.metrics, self.latency, generation, status)

    # ------------------------------------------------------------ output
    def delivered(self, generation: Generation, num_tokens: int, text: str = "") -> None:
        """``num_tokens`` tokens of ``generation`` (``text``) were written to its client."""
        record_delivery(
            self.metrics,
            generation,
            num_tokens,
            self.slo,
            text,
            self.settings.reading_tokens_per_second,
        )

    def position(self, generation: Generation) -> tuple[int, float]:
        """(0-based position, expected wait in seconds) of a queued request."""
        if generation.ticket is None:
            return 0, 0.0
        return self.dispatcher.position(generation.ticket)

    def failure(self, generation: Generation, output: RequestOutput) -> APIError:
        """Why a request ended with an error: refused after queueing, or the engine failed."""
        ticket = generation.ticket
        if ticket is not None and ticket.rejection is not None:
            return ticket.rejection.to_error()
        if output.failure is not None:
            return output.failure
        return APIError(
            500,
            f"The engine failed while generating: {output.error or 'unknown error'}. "
            "The request was not completed; it is safe to retry.",
            code="engine_error",
        )

    # ------------------------------------------------------------ flow control
    def pause(self, request_id: str) -> None:
        """A slow reader: ask the scheduler to pause its sequence (every choice's)."""
        for sequence_id in self._sequence_ids(request_id):
            self.core.pause_request(sequence_id)

    def resume(self, request_id: str) -> None:
        for sequence_id in self._sequence_ids(request_id):
            self.core.resume_request(sequence_id)

    def evict(self, request_id: str) -> None:
        """A stalled reader: abort its sequence (every choice's)."""
        generation = self.generations.get(request_id)
        if generation is not None and generation.choices is not None:
            generation.choices.abort()
        else:
            self.core.abort_request(request_id)
        self.metrics.streams_evicted_total.inc()

    def _sequence_ids(self, request_id: str) -> list[str]:
        """The engine's sequences of a request: one, or a running one per choice."""
        generation = self.generations.get(request_id)
        if generation is None or generation.choices is None:
            return [request_id]
        return generation.choices.running_ids

    # ------------------------------------------------------------ engine side
    def _submit(self, ticket: Ticket) -> None:
        generation = self.generations.get(ticket.request_id)
        if generation is None:  # cannot happen: an ending request leaves the queue first
            for request in ticket.requests:
                self.core.capacity.release(request.request_id)
            return
        if generation.choices is not None:
            generation.choices.start()
        else:
            self.core.add_request(ticket.request, generation.produced, generation.upstream_call)

    def _refused(self, ticket: Ticket) -> None:
        generation = self.generations.get(ticket.request_id)
        if generation is None or ticket.rejection is None:
            return
        request = ticket.request
        generation.stream.put(
            RequestOutput(
                request.request_id,
                "",
                0,
                request.num_prompt_tokens,
                0,
                FinishReason.ERROR,
                error=ticket.rejection.message,
            )
        )

    def _on_step(self, step: StepStats) -> None:  # the engine thread
        self.metrics.engine_step_seconds.observe(step.step_seconds)
        self.metrics.batch_size.observe(step.num_seqs)
        self.metrics.batch_tokens.observe(step.num_batched_tokens)
        if step.num_decoding:  # prompts alone (a first prefill, a warm-up) hold no stream up
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self._loop.call_soon_threadsafe(self.dispatcher.record_step, step.step_seconds)

    def _capacity_changed(self) -> None:  # the engine thread, or the event loop
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.dispatcher.wake)

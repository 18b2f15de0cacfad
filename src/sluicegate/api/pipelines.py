"""A pipeline request's way in: its input guard, its retrieval's timing, and the output
stages it is submitted with (``docs/pipelines.md``)."""

from __future__ import annotations

from sluicegate.admission.request_objective import RequestObjective
from sluicegate.admission.tenants import Tenant
from sluicegate.api.prepare import Prepared
from sluicegate.errors import APIError
from sluicegate.pipeline.chain import StageChain
from sluicegate.service.generation import Generation
from sluicegate.service.service import Service


async def open_stages(service: Service, prepared: Prepared) -> StageChain | None:
    """Check the prompt, then build the request's output stages (None: not a pipeline,
    or one without stages).  A prompt that trips the input guard is a 400 with code
    ``content_filter`` (Azure OpenAI's), before any work."""
    pipeline = prepared.pipeline
    if pipeline is None:
        return None
    metrics = service.metrics
    if prepared.retrieved is not None:
        metrics.retrieval_seconds.labels(pipeline.name).observe(prepared.retrieved.seconds)
    tokenizer = service.tokenizer
    trip = await pipeline.check_input(prepared.guarded_text, tokenizer.encode, tokenizer.decode)
    if trip is not None:
        pipeline.count_trip(trip, "input", metrics)
        raise APIError(
            400,
            f"The prompt was refused by the '{pipeline.name}' pipeline's input guard "
            f"({trip.check}). Rephrase the request.",
            param="messages",
            code="content_filter",
        )
    request_id = prepared.request_id
    sources = prepared.retrieved.sources if prepared.retrieved is not None else []
    return pipeline.chain(
        request_id,
        metrics,
        lambda: service.core.abort_request(request_id),
        sources,
        resumed=False,
    )


async def submit_prepared(
    service: Service,
    tenant: Tenant,
    prepared: Prepared,
    arrival: float,
    objective: RequestObjective | None = None,
) -> Generation:
    """Submit a prepared request (a pipeline's: checked, with its output stages, timed
    from ``arrival``, before its retrieval), with what it stated for itself."""
    req = prepared.req
    chain = await open_stages(service, prepared)
    try:
        generation = await service.submit(
            tenant,
            req.priority,
            prepared.request_id,
            prepared.prompt_ids,
            prepared.sampling,
            req.max_tokens_per_second,
            request_charged=True,
            upstream_call=prepared.upstream_call,
            chain=chain,
            arrival_time=None if prepared.pipeline is None else arrival,
            objective=objective,
        )
    except BaseException:
        if chain is not None:
            chain.close()
        raise
    if prepared.retrieved is not None:
        generation.retrieval_seconds = prepared.retrieved.seconds
    return generation

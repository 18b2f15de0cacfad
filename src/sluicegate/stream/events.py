"""How a resumable stream's events look: the chunk format kept with the stream (so a
replica that takes a stream over frames its continuation like the start), sampling
parameters as stored, and the final error events of a stream or a replay."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from sluicegate.engine.output import FlushPolicy, RequestOutput
from sluicegate.scheduler.request import SamplingParams
from sluicegate.store.errors import ReplayTrimmed, StoreError, StreamExpired
from sluicegate.stream.sse import DONE, sse_data
from sluicegate.types import JSONValue

Kind = Literal["chat", "completion"]


@dataclass(slots=True, frozen=True)
class StreamFormat:
    """How a stream's chunks look; kept in ``StreamMeta.extra`` so that a replica that
    takes the stream over frames its continuation exactly like the start."""

    kind: Kind
    created: int
    model: str
    include_usage: bool = False
    continuous_usage: bool = False
    flush_interval_seconds: float | None = None
    flush_max_tokens: int | None = None
    priority: str = "interactive"
    max_tokens_per_second: float | None = None
    #: Upstream mode: what the upstream is sent (a replica that takes the stream over
    #: continues it from this).
    upstream_call: dict[str, Any] | None = None
    #: A pipeline's stream (``model`` is the pipeline's name): the sources its answer was
    #: retrieved from (a takeover rebuilds its stages with them).
    sources: list[str] | None = None
    #: A response of the Responses API (``/v1/responses``), generated as a chat
    #: completion: its fixed fields (``template``), its input items and the conversation
    #: it continues (see :mod:`sluicegate.stream.response_events`).
    response: dict[str, Any] | None = None

    def chunk(
        self,
        stream_id: str,
        text: str,
        finish: str | None,
        use: dict[str, Any] | None,
        parts: RequestOutput | None = None,
    ) -> dict[str, Any]:
        """One ``chat.completion.chunk`` or ``text_completion`` object; ``parts``: the
        output whose choice index, tool calls, log probabilities and refusal it carries."""
        index = 0 if parts is None else parts.index
        tool_calls = [] if parts is None else parts.tool_calls
        refusal = "" if parts is None else parts.refusal
        logprobs = [] if parts is None else parts.logprobs
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if text or not (finish is not None or tool_calls or refusal):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            if refusal:
                delta["refusal"] = refusal
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": completion_logprobs(logprobs) if logprobs else None,
                "finish_reason": finish,
            }
            obj = "text_completion"
        return {
            "id": stream_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": use,
        }

    def first_chunk(
        self, stream_id: str, num_prompt_tokens: int, num_choices: int = 1
    ) -> bytes | None:
        """The opening chat chunk (the assistant role) as an SSE event; completions have
        none."""
        first = self.role_chunk(stream_id, num_prompt_tokens, num_choices)
        return None if first is None else sse_data(first)

    def role_chunk(
        self, stream_id: str, num_prompt_tokens: int, num_choices: int = 1
    ) -> dict[str, Any] | None:
        """The opening chat chunk: the assistant role of each of ``num_choices`` choices
        (clients build each choice's message from its first delta); completions have
        none."""
        if self.kind != "chat":
            return None
        first = self.chunk(stream_id, "", None, None)
        opening = first["choices"][0]
        opening["delta"] = {"role": "assistant", "content": ""}
        first["choices"] = [{**opening, "index": index} for index in range(num_choices)]
        if self.continuous_usage:
            first["usage"] = {
                "prompt_tokens": num_prompt_tokens,
                "completion_tokens": 0,
                "total_tokens": num_prompt_tokens,
            }
        return first

    def flush_policy(self, default: FlushPolicy) -> FlushPolicy:
        if self.flush_interval_seconds is None and self.flush_max_tokens is None:
            return default
        return FlushPolicy(
            interval_seconds=(
                default.interval_seconds
                if self.flush_interval_seconds is None
                else self.flush_interval_seconds
            ),
            max_tokens=self.flush_max_tokens or default.max_tokens,
            heartbeat_seconds=default.heartbeat_seconds,
        )

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "kind": self.kind,
            "created": self.created,
            "include_usage": self.include_usage,
            "continuous_usage": self.continuous_usage,
            "flush_interval_seconds": self.flush_interval_seconds,
            "flush_max_tokens": self.flush_max_tokens,
            "priority": self.priority,
            "max_tokens_per_second": self.max_tokens_per_second,
            "upstream_call": self.upstream_call,
            "sources": None if self.sources is None else list[JSONValue](self.sources),
            "response": self.response,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], model: str) -> StreamFormat:
        kind: Kind = "chat" if data.get("kind") == "chat" else "completion"
        return cls(
            kind=kind,
            created=int(data.get("created") or time.time()),
            model=model,
            include_usage=bool(data.get("include_usage")),
            continuous_usage=bool(data.get("continuous_usage")),
            flush_interval_seconds=_optional_float(data.get("flush_interval_seconds")),
            flush_max_tokens=_optional_int(data.get("flush_max_tokens")),
            priority=str(data.get("priority") or "interactive"),
            max_tokens_per_second=_optional_float(data.get("max_tokens_per_second")),
            upstream_call=call if isinstance(call := data.get("upstream_call"), dict) else None,
            sources=[str(x) for x in found]
            if isinstance(found := data.get("sources"), list)
            else None,
            response=found if isinstance(found := data.get("response"), dict) else None,
        )


def sampling_to_json(sampling: SamplingParams) -> dict[str, JSONValue]:
    """Everything but the seed (``StreamMeta.seed``), for :func:`sampling_from_json`."""
    out: dict[str, JSONValue] = {}
    for spec in dataclasses.fields(SamplingParams):
        if spec.name == "seed":
            continue
        value = getattr(sampling, spec.name)
        out[spec.name] = orjson.loads(orjson.dumps(value)) if isinstance(value, tuple) else value
    return out


def sampling_from_json(seed: int, data: Mapping[str, Any]) -> SamplingParams:
    """The inverse of :func:`sampling_to_json` (fields it lacks keep their defaults: a
    stream logged by an older replica)."""
    known = {spec.name for spec in dataclasses.fields(SamplingParams)}
    values: dict[str, Any] = {k: v for k, v in data.items() if k in known and k != "seed"}
    values["stop"] = tuple(str(s) for s in values.get("stop", ()))
    values["stop_token_ids"] = tuple(int(t) for t in values.get("stop_token_ids", ()))
    values["logit_bias"] = tuple((int(t), float(b)) for t, b in values.get("logit_bias", ()))
    return SamplingParams(seed=seed, **values)


def completion_logprobs(entries: list[dict[str, Any]], text_offset: int = 0) -> dict[str, Any]:
    """Chat-shaped log probabilities (``logprobs.content``) in the legacy completions
    shape: tokens, their log probabilities, the alternatives, and text offsets."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        # As OpenAI and vLLM give them: the alternatives and the sampled token (k + 1 at
        # most; the sampled token is often one of the k).
        "top_logprobs": [
            {top["token"]: top["logprob"] for top in entry.get("top_logprobs", ())}
            | ({} if _has_token(entry) else {entry["token"]: entry["logprob"]})
            for entry in entries
        ],
        "text_offset": offsets,
    }


def _has_token(entry: Mapping[str, Any]) -> bool:
    return any(top["token"] == entry["token"] for top in entry.get("top_logprobs", ()))


def usage(output: RequestOutput) -> dict[str, object]:
    """Token counts in OpenAI's ``usage`` shape (an upstream's own, when it gave them);
    prompt tokens reused from the prefix cache as ``prompt_tokens_details.cached_tokens``."""
    prompt, completion = output.reported_usage or (
        output.num_prompt_tokens,
        output.num_output_tokens,
    )
    counts: dict[str, object] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if output.num_cached_tokens:
        counts["prompt_tokens_details"] = {"cached_tokens": output.num_cached_tokens}
    return counts


def drain_notice(stream_id: str) -> dict[str, object]:
    """The final event of a stream cut short by shutdown."""
    return {
        "error": {
            "message": (
                "The server is shutting down and stopped this stream before it finished. "
                f"Resume it with GET /v1/streams/{stream_id} (with Last-Event-ID) "
                "on any replica, or retry the request."
            ),
            "type": "server_draining",
            "param": None,
            "code": "server_draining",
            "stream_id": stream_id,
        }
    }


def superseded_notice(stream_id: str) -> bytes:
    """The last event of a connection whose stream another connection resumed."""
    return error_event(
        "stream_superseded",
        "Another connection resumed this stream and receives the rest of it; this "
        f"connection ends here. To take it back, resume with GET /v1/streams/{stream_id} "
        "and Last-Event-ID.",
        stream_id=stream_id,
    )


def moved_notice(stream_id: str) -> bytes:
    """The last event of a stream whose lease another replica took (this one stalled)."""
    return error_event(
        "stream_moved",
        "Another replica continues this stream. Resume it with GET "
        f"/v1/streams/{stream_id} (with Last-Event-ID) on any replica.",
        stream_id=stream_id,
    )


def stall_error(stall_timeout_seconds: float) -> dict[str, dict[str, object]]:
    """What a client that accepted nothing for too long is told as it is cut off."""
    message = (
        f"The client accepted no data for {stall_timeout_seconds:g} seconds; the stream "
        "was closed and its generation cancelled."
    )
    code = "stream_stalled"
    return {"error": {"message": message, "type": code, "param": None, "code": code}}


def is_final_event(data: bytes) -> bool:
    """Whether a logged event ends its stream (it carries the ``[DONE]`` message)."""
    return data.endswith(DONE)


def error_event(status: str, message: str, **extra: JSONValue) -> bytes:
    """A final SSE error event in OpenAI's shape, with ``[DONE]``."""
    body: dict[str, JSONValue] = {
        "message": message,
        "type": status,
        "param": None,
        "code": status,
        **extra,
    }
    return sse_data({"error": body}) + DONE


def replay_error(error: StoreError) -> bytes:
    """The event that ends a replay the store cannot serve."""
    if isinstance(error, ReplayTrimmed):
        return error_event(
            "replay_trimmed", str(error), resumable_from_seq=error.resumable_from_seq
        )
    if isinstance(error, StreamExpired):
        return error_event("stream_expired", f"{error}. Send the request again.")
    message = f"The replay log cannot be read: {error}. Resume later."
    return error_event("store_unavailable", message)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)

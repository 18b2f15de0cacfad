"""One benchmark client: send a planned request on its own socket and time every token.

Each request runs on its own thread with a blocking socket, so a slow reader only ever
slows itself.  A slow reader is slow *at the socket*: a small ``SO_RCVBUF`` set before
connecting and paced ``recv`` calls of a few hundred bytes, so the server's send queue
really fills (see :mod:`sluicegate.bench.raw_client`).  A disconnecting client closes
its socket after ``k`` tokens.  Token counts per SSE event come from
``usage.completion_tokens`` when the server streams usage in every chunk (vLLM's
``continuous_usage_stats``), else one token per non-empty chunk.
"""

from __future__ import annotations

import contextlib
import email.utils
import math
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import orjson

from sluicegate.bench.raw_client import RawStream
from sluicegate.bench.records import REJECTION_STATUSES, Attempt, Outcome, Sample
from sluicegate.bench.scenario import Scenario
from sluicegate.bench.schedule import ClientClass, PlannedRequest, PromptModel, request_body

_MAX_ERROR_BODY_BYTES = 65536


@dataclass(slots=True, frozen=True)
class Target:
    """An OpenAI-compatible server: ``http[s]://host:port[/prefix]`` (a trailing /v1 is ok)."""

    host: str
    port: int
    tls: bool = False
    path_prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target must be an http(s) URL like http://127.0.0.1:8000; got {url}")
        tls = parts.scheme == "https"
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(parts.hostname, parts.port or (443 if tls else 80), tls, prefix)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}{self.path_prefix}"

    def path(self, endpoint: str) -> str:
        suffix = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        return self.path_prefix + suffix


@dataclass(slots=True)
class ClientContext:
    """What every client thread of one run shares."""

    target: Target
    scenario: Scenario
    model: str
    prompt_model: PromptModel
    run_start: float
    default_api_key: str | None = None
    #: Further servers sharing the load: request ``i`` (all its attempts) goes to
    #: ``(target, *more_targets)[i % n]`` (gateway replicas behind no balancer).
    more_targets: tuple[Target, ...] = ()
    #: Set when the run is cut: reads stop, retry waits end.
    stop: threading.Event = field(default_factory=threading.Event)
    _live: dict[int, socket.socket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def api_key(self, tenant: str) -> str | None:
        for t in self.scenario.tenants:
            if t.name == tenant:
                return t.api_key or self.default_api_key
        return self.default_api_key

    def register(self, key: int, sock: socket.socket) -> None:
        with self._lock:
            self._live[key] = sock

    def unregister(self, key: int) -> None:
        with self._lock:
            self._live.pop(key, None)

    def cut_all(self) -> int:
        """Stop the run: shut down every open socket (their readers see EOF)."""
        self.stop.set()
        with self._lock:
            socks = list(self._live.values())
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return len(socks)


def connect(
    target: Target, receive_buffer_bytes: int | None, timeout_seconds: float
) -> socket.socket:
    """A connected socket; a small receive buffer is set before connect (TCP window)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        target.host, target.port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        if receive_buffer_bytes is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.settimeout(timeout_seconds)
        sock.connect(address)
        if target.tls:
            context = ssl.create_default_context()
            sock = context.wrap_socket(sock, server_hostname=target.host)
    except BaseException:
        sock.close()
        raise
    return sock


def send_request(
    sock: socket.socket, target: Target, path: str, body: dict[str, Any], headers: dict[str, str]
) -> RawStream:
    """POST ``body`` as JSON and read the response head; the body is read from the stream."""
    payload = orjson.dumps(body)
    conn = h11.Connection(h11.CLIENT)
    request_headers = [
        ("host", f"{target.host}:{target.port}"),
        ("content-type", "application/json"),
        ("content-length", str(len(payload))),
        ("accept", "text/event-stream"),
        *headers.items(),
    ]
    head = conn.send(h11.Request(method="POST", target=path, headers=request_headers))
    sock.sendall(head + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
    stream = RawStream(sock, conn)
    while stream.status == 0:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(sock.recv(4096))
        elif isinstance(event, h11.Response):
            stream.status = event.status_code
            stream.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection before responding")
    return stream


def execute(planned: PlannedRequest, ctx: ClientContext) -> Sample:
    """Send one planned request, and retry it once at the advertised time after a refusal
    if the scenario's ``retry_after`` policy says so."""
    sample = Sample(planned)
    body = request_body(ctx.scenario, planned, ctx.model, ctx.prompt_model)
    headers = {}
    key = ctx.api_key(planned.tenant)
    if key:
        headers["authorization"] = f"Bearer {key}"
    now = time.monotonic()
    sample.send_lateness_seconds = now - ctx.run_start - planned.send_offset_seconds
    first = run_attempt(planned, ctx, body, headers)
    sample.attempts.append(first)
    policy = ctx.scenario.retry_after
    wait = first.retry_after_seconds
    due = first.retry_due_offset_seconds
    if (
        first.outcome is Outcome.REJECTED
        and policy.retry_once
        and wait is not None
        and due is not None
        and wait <= policy.max_wait_seconds
        # The advertised time counts from when the refusal arrived, not from now.
        and not ctx.stop.wait(max(0.0, ctx.run_start + due - time.monotonic()))
    ):
        sample.attempts.append(run_attempt(planned, ctx, body, headers))
    return sample


def run_attempt(
    planned: PlannedRequest, ctx: ClientContext, body: dict[str, Any], headers: dict[str, str]
) -> Attempt:
    """One HTTP attempt, timed from just before connecting."""
    limits = ctx.scenario.limits
    targets = (ctx.target, *ctx.more_targets)
    target = targets[planned.index % len(targets)]
    slow = planned.client_class is ClientClass.SLOW
    sent = time.monotonic()
    attempt = Attempt(sent_offset_seconds=sent - ctx.run_start)
    receive_buffer = ctx.scenario.slow_readers.receive_buffer_bytes if slow else None
    try:
        sock = connect(target, receive_buffer, limits.request_timeout_seconds)
    except OSError as exc:
        attempt.error = f"connect failed: {exc}"
        return attempt
    ctx.register(planned.index, sock)
    try:
        stream = send_request(sock, target, target.path(ctx.scenario.endpoint), body, headers)
        head_at = time.monotonic()
        attempt.status = stream.status
        if stream.status != 200:
            _read_refusal(stream, attempt, sent, head_at)
        else:
            _read_stream(stream, planned, ctx, attempt, sent)
    except TimeoutError:
        attempt.outcome = Outcome.TIMEOUT
        attempt.error = f"no data for {limits.request_timeout_seconds:g}s"
    except (OSError, h11.ProtocolError, ConnectionError) as exc:
        attempt.outcome = Outcome.ABORTED if ctx.stop.is_set() else Outcome.ERROR
        attempt.error = f"{type(exc).__name__}: {exc}"
    finally:
        ctx.unregister(planned.index)
        sock.close()
    if attempt.e2e_seconds is None:
        attempt.e2e_seconds = time.monotonic() - sent
    return attempt


def _read_refusal(stream: RawStream, attempt: Attempt, sent: float, head_at: float) -> None:
    """Read an error response to its end: the refusal's latency is sent to that end."""
    raw = b""
    for event in stream.events():
        raw += event.data + b"\n\n"
        if len(raw) > _MAX_ERROR_BODY_BYTES:
            break
    attempt.e2e_seconds = time.monotonic() - sent
    attempt.outcome = Outcome.REJECTED if attempt.status in REJECTION_STATUSES else Outcome.ERROR
    error = _error_object(raw.strip())
    attempt.error = _error_message(raw.strip(), error) or f"HTTP {attempt.status}"
    attempt.error_code = _error_code(error)
    attempt.retry_after_seconds = retry_after_seconds(stream.headers)
    attempt.refusal = stream.headers.get("x-sluicegate-refusal")
    if attempt.retry_after_seconds is not None:
        attempt.refused_after_seconds = head_at - sent


def retry_after_seconds(headers: Mapping[str, str], now_unix: float | None = None) -> float | None:
    """When to retry, from response headers (names lower-case): ``retry-after-ms``
    (milliseconds, fractions allowed; what OpenAI's SDKs read first), else ``Retry-After``
    (seconds, or an HTTP date).  None when neither is there or usable."""
    milliseconds = _non_negative(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return milliseconds / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _non_negative(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now_unix is None else now_unix))


def _non_negative(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _error_object(raw: bytes) -> Any:
    """The decoded JSON of an error body or event (``data: `` stripped); None if not JSON."""
    if raw.startswith(b"data: "):
        raw = raw[len(b"data: ") :]
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _error_message(raw: bytes, payload: Any) -> str | None:
    if payload is None:
        if raw.startswith(b"data: "):
            raw = raw[len(b"data: ") :]
        return raw[:200].decode(errors="replace") or None
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message"))
    return str(payload)[:200]


def _error_code(payload: Any) -> str | None:
    error = payload.get("error") if isinstance(payload, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return None if code is None else str(code)


def refusal_from_event(payload: dict[str, Any]) -> float | None:
    """An error event's ``retry_after_ms`` in seconds: the stream was refused after it
    was admitted (its deadline became unreachable).  None for another kind of error."""
    error = payload.get("error")
    milliseconds = _duration(error.get("retry_after_ms") if isinstance(error, dict) else None)
    return None if milliseconds is None else milliseconds / 1000.0


def _read_stream(
    stream: RawStream, planned: PlannedRequest, ctx: ClientContext, attempt: Attempt, sent: float
) -> None:
    """Read SSE events, pacing a slow reader and leaving early for a disconnecting one."""
    pace = planned.read_tokens_per_second
    chunk_bytes = ctx.scenario.slow_readers.read_chunk_bytes if pace else 65536
    leave_after = planned.disconnect_after_tokens
    busy_until = 0.0
    events = stream.events(max_read_bytes=chunk_bytes)
    while True:
        if pace is not None:
            # A reader at `pace` tokens/s reads more only once it has read what it has.
            delay = busy_until - time.monotonic()
            if delay > 0 and ctx.stop.wait(delay):
                raise ConnectionError("run stopped")
        event = next(events, None)
        if event is None:
            attempt.outcome = Outcome.ABORTED if ctx.stop.is_set() else Outcome.ERROR
            attempt.error = "the stream ended without data: [DONE]"
            return
        data = event.data
        if not data.startswith(b"data: "):
            continue  # an SSE comment (queue position, keep-alive)
        if data == b"data: [DONE]":
            attempt.outcome = Outcome.COMPLETED
            attempt.e2e_seconds = event.received_at - sent
            return
        payload = orjson.loads(data[len(b"data: ") :])
        if "error" in payload:
            _read_error_event(payload, data, attempt, event.received_at - sent)
            return
        num_new = _count_tokens(payload, attempt)
        if num_new <= 0:
            continue
        attempt.completion_tokens += num_new
        attempt.token_events.append((event.received_at - sent, num_new))
        if pace is not None:
            busy_until = max(busy_until, event.received_at) + num_new / pace
        if leave_after is not None and attempt.completion_tokens >= leave_after:
            attempt.outcome = Outcome.DISCONNECTED
            attempt.e2e_seconds = event.received_at - sent
            return


def _read_error_event(
    payload: dict[str, Any], data: bytes, attempt: Attempt, received_seconds: float
) -> None:
    """A final error event.  With ``retry_after_ms`` and before any token it is a refusal
    (an admitted request whose deadline became unreachable), like a 429."""
    attempt.error = _error_message(data, payload) or "error event"
    attempt.error_code = _error_code(payload)
    attempt.retry_after_seconds = refusal_from_event(payload)
    error = payload.get("error")
    refusal = error.get("refusal") if isinstance(error, dict) else None
    attempt.refusal = refusal if isinstance(refusal, str) else None  # the header's, in an event
    attempt.e2e_seconds = received_seconds
    if attempt.retry_after_seconds is not None:
        attempt.refused_after_seconds = received_seconds
    if attempt.retry_after_seconds is not None and not attempt.token_events:
        attempt.outcome = Outcome.REJECTED
        attempt.refused_in_stream = True
    else:
        attempt.outcome = Outcome.ERROR


def _count_tokens(payload: dict[str, Any], attempt: Attempt) -> int:
    """Tokens this chunk delivers; also notes usage and the finish reason."""
    choices = payload.get("choices") or []
    usage = payload.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
        attempt.prompt_tokens = int(usage["prompt_tokens"])
        timing = usage.get("sluicegate")
        if isinstance(timing, dict):
            attempt.server_ttft_seconds = _duration(timing.get("ttft_seconds"))
            attempt.ttft_objective_seconds = _duration(timing.get("ttft_objective_seconds"))
    if not choices:
        return 0  # the final usage-only chunk
    choice = choices[0]
    if choice.get("finish_reason"):
        attempt.finish_reason = str(choice["finish_reason"])
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"]) - attempt.completion_tokens
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return 1 if text else 0


def _duration(value: object) -> float | None:
    """A JSON duration: a finite number, not negative (None for anything else)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None

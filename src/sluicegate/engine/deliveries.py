"""What each sequence's sampled tokens become for its stream: text deltas (stop strings
applied), the token ids that text commits, and the final output.  The embedded core's,
on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluicegate.engine.detokenizer import TextAssembler
from sluicegate.engine.logprob_entries import TokenBytes, logprob_entry
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.scheduler.request import FinishReason, Request
from sluicegate.scheduler.state import TokenEvent
from sluicegate.scheduler.step import TokenLogprobs
from sluicegate.tools.parser import ToolCallParser

#: An output and the stream it goes to.
Delivery = tuple[RequestStream, RequestOutput]


@dataclass(slots=True)
class _Sequence:
    stream: RequestStream
    assembler: TextAssembler
    #: Output tokens already committed before this assembler was built (a resumed
    #: request's, delivered elsewhere).
    committed_base: int
    #: Log probabilities asked for: each token pushed but not yet committed, with its
    #: log probabilities (None for a stop token, which gets no entry).
    pending_logprobs: list[tuple[int, TokenLogprobs | None]] | None = None
    #: Tool calling: its text read as content and tool-call fragments.
    tools: ToolCallParser | None = None


class Deliveries:
    """Every live sequence's stream and text assembler."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._sequences: dict[str, _Sequence] = {}
        self._token_bytes = TokenBytes(tokenizer.tokenizer)

    def add(self, request: Request, stream: RequestStream) -> None:
        # All known tokens, not only the prompt: a resumed request arrives with the output
        # it already delivered (prompt + committed tokens), and its text continues from
        # there.  Only tokens generated here are committed by this assembler.
        decoder = self._tokenizer.decode_stream(request.all_token_ids)
        self._sequences[request.request_id] = _Sequence(
            stream,
            TextAssembler(decoder, request.sampling.stop),
            request.num_output_tokens,
            [] if request.sampling.logprobs is not None else None,
            _tool_parser(self._tokenizer, request),
        )

    def end(
        self, request: Request, reason: FinishReason, error: str | None = None
    ) -> Delivery | None:
        """Forget a sequence that ends without a token (aborted, failed): its last output."""
        sequence = self._sequences.pop(request.request_id, None)
        if sequence is None:
            return None
        output = RequestOutput(
            request.request_id,
            "",
            0,
            request.num_prompt_tokens,
            request.num_output_tokens,
            reason,
            error=error,
        )
        return sequence.stream, output

    def assemble(
        self, events: list[TokenEvent], stop_string: Callable[[Request], None]
    ) -> list[Delivery]:
        """The outputs of a step's token events.  ``stop_string`` finishes a request whose
        text reached one of its stop strings (the scheduler's to do)."""
        outputs: list[Delivery] = []
        for event in events:
            request = event.request
            sequence = self._sequences.get(request.request_id)
            if sequence is not None:
                outputs.append((sequence.stream, self._output(sequence, event, stop_string)))
        return outputs

    def _output(
        self, sequence: _Sequence, event: TokenEvent, stop_string: Callable[[Request], None]
    ) -> RequestOutput:
        request = event.request
        rid = request.request_id
        assembler = sequence.assembler
        token_id = event.new_token_id
        text = ""
        committed_before = assembler.num_committed_tokens
        # Its last event: the scheduler finished it with this token, or a stop string ends
        # here (drafts verified in the same step may have added tokens after it).
        done = event.finished
        if token_id is not None:
            if sequence.pending_logprobs is not None and not assembler.stopped:
                kept = None if event.is_stop_token else event.logprobs
                sequence.pending_logprobs.append((token_id, kept))
            text = assembler.push(token_id, skip=event.is_stop_token)
            if assembler.stopped and not done:
                request.finish_reason = FinishReason.STOP
                stop_string(request)
                del request.all_token_ids[request.num_prompt_tokens + event.num_output_tokens :]
                done = True
        if done:
            text += assembler.flush()
            del self._sequences[rid]
        committed: list[int] = []
        if assembler.num_committed_tokens > committed_before:
            start = request.num_prompt_tokens + sequence.committed_base
            committed = request.all_token_ids[
                start + committed_before : start + assembler.num_committed_tokens
            ]
        content, tool_calls, finish = text, [], request.finish_reason if done else None
        if sequence.tools is not None:
            parsed = sequence.tools.feed(text)
            if sequence.tools.repeated and not done:
                # It repeated one of its calls: the answer ends before the repeat.
                request.finish_reason = FinishReason.STOP
                stop_string(request)
                del request.all_token_ids[request.num_prompt_tokens + event.num_output_tokens :]
                self._sequences.pop(rid, None)
                done = True
                finish = request.finish_reason
            if done:
                whole = sequence.tools.num_calls and not sequence.tools.in_call
                parsed.content += sequence.tools.finish().content
                if whole and finish == FinishReason.STOP:
                    finish = request.finish_reason = FinishReason.TOOL_CALLS
            content, tool_calls = parsed.content, parsed.tool_calls
        return RequestOutput(
            request_id=rid,
            text=content,
            num_new_tokens=1 if token_id is not None else 0,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=event.num_output_tokens,
            finish_reason=finish,
            tool_calls=tool_calls,
            committed_token_ids=committed,
            num_cached_tokens=min(request.reuse.num_cached_tokens, request.num_prompt_tokens),
            logprobs=self._logprobs(
                sequence,
                assembler.num_committed_tokens - committed_before,
                len(text.encode()) if assembler.stopped else None,
            ),
        )

    def _logprobs(
        self, sequence: _Sequence, num_committed: int, stop_cut: int | None
    ) -> list[dict[str, Any]]:
        """The entries of the tokens just committed (their text is in this delta).  When a
        stop string cut the delta at ``stop_cut`` bytes, the tokens wholly inside the stop
        string get none: the entries are those of the text the client is sent."""
        pending = sequence.pending_logprobs
        if not pending or num_committed <= 0:
            return []
        released = pending[:num_committed]
        del pending[:num_committed]
        entries = []
        num_bytes = 0
        for token_id, logprobs in released:
            if stop_cut is not None and num_bytes >= stop_cut:
                break
            num_bytes += len(self._token_bytes(token_id))
            if logprobs is not None:
                entries.append(logprob_entry(token_id, logprobs, self._token_bytes))
        return entries


def _tool_parser(tokenizer: TextTokenizer, request: Request) -> ToolCallParser | None:
    """A parser for a request with tools; a resumed one's is first fed, silently, the
    text its client already has, so it continues where that text left off."""
    if request.sampling.tool_format is None:
        return None
    prompt = request.all_token_ids[: request.num_prompt_tokens]
    parser = ToolCallParser(request.sampling.seed, prompt)
    if request.num_output_tokens:
        parser.feed(tokenizer.decode(request.all_token_ids[request.num_prompt_tokens :]))
    return parser

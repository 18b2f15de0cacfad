"""What each sequence's sampled tokens become for its stream: text deltas (stop strings
applied), the token ids that text commits, and the final output.  The embedded core's,
on the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sluicegate.engine.detokenizer import TextAssembler
from sluicegate.engine.output import RequestOutput, RequestStream
from sluicegate.engine.tokenizer import TextTokenizer
from sluicegate.scheduler.request import FinishReason, Request
from sluicegate.scheduler.state import TokenEvent

#: An output and the stream it goes to.
Delivery = tuple[RequestStream, RequestOutput]


@dataclass(slots=True)
class _Sequence:
    stream: RequestStream
    assembler: TextAssembler
    #: Output tokens already committed before this assembler was built (a resumed
    #: request's, delivered elsewhere).
    committed_base: int


class Deliveries:
    """Every live sequence's stream and text assembler."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._sequences: dict[str, _Sequence] = {}

    def add(self, request: Request, stream: RequestStream) -> None:
        # All known tokens, not only the prompt: a resumed request arrives with the output
        # it already delivered (prompt + committed tokens), and its text continues from
        # there.  Only tokens generated here are committed by this assembler.
        decoder = self._tokenizer.decode_stream(request.all_token_ids)
        self._sequences[request.request_id] = _Sequence(
            stream, TextAssembler(decoder, request.sampling.stop), request.num_output_tokens
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
        return RequestOutput(
            request_id=rid,
            text=text,
            num_new_tokens=1 if token_id is not None else 0,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=event.num_output_tokens,
            finish_reason=request.finish_reason if done else None,
            committed_token_ids=committed,
            num_cached_tokens=min(request.reuse.num_cached_tokens, request.num_prompt_tokens),
        )

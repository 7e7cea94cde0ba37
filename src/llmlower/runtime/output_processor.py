"""Output processing: a sequence's chosen tokens become text deltas (detokenized, with stop strings held back),
finish reasons, logprobs and, when it finishes, its GenerationResult with usage and timing."""

from __future__ import annotations

import numpy as np

from .detokenizer import StreamDelta
from .outputs import GenerationDelta, GenerationResult, Timing, TokenLogprob, Usage
from .request import Request, RequestSequence


class OutputProcessor:
    """Streams the tokens of an engine's sequences: `max_context` ends a sequence that fills the context;
    `speculating` adds each result's speculation counts."""

    def __init__(self, max_context: int, speculating: bool) -> None:
        self.max_context = max_context
        self.speculating = speculating

    def process(
        self, sequence: RequestSequence, token: int, logprob: TokenLogprob | None, now: float
    ) -> GenerationDelta:
        """The delta of a sequence's newest token (appended, and accepted by its grammar): its text, its logprob,
        and whether the sequence finished (EOS, a stop, max_tokens, its grammar's end or the context), with the
        result of a finished one."""
        sequence.token_times.append(now)
        if logprob is not None:
            sequence.logprobs.append(logprob)
        delta = sequence.stream.add(token)
        if not delta.finished and sequence.constraint is not None and sequence.constraint.finished:
            delta = _joined(delta, sequence.stream.finish("stop"))  # a grammar may end without EOS
        if not delta.finished and len(sequence.token_ids) >= self.max_context:
            delta = _joined(delta, sequence.stream.finish("length"))
        request = sequence.request
        out = GenerationDelta(0, sequence.index, delta.text, token, delta.finish_reason, logprob, request.request_id)
        if delta.finished:
            sequence.finished = True
            out.result = self.result(sequence)
        return out

    def embedded(self, sequence: RequestSequence, embedding: np.ndarray, now: float) -> GenerationDelta:
        """The last delta of an embedding model's sequence whose prompt is computed: its result holds the
        embedding, and no tokens."""
        sequence.token_times.append(now)
        sequence.finished = True
        request = sequence.request
        result = GenerationResult(
            text="",
            token_ids=[],
            prompt_token_ids=request.prompt,
            finish_reason="stop",
            usage=Usage(sequence.prompt_len, 0, sequence.prompt_len, sequence.cached_tokens),
            timing=_timing(sequence),
            index=sequence.index,
            request_id=request.request_id,
            embedding=embedding.tolist(),
        )
        return GenerationDelta(0, sequence.index, "", -1, "stop", request_id=request.request_id, result=result)

    def result(self, sequence: RequestSequence) -> GenerationResult:
        """A finished sequence's completion: text, tokens, logprobs, usage and timing."""
        request = sequence.request
        timing = _timing(sequence)
        output = sequence.output
        usage = Usage(sequence.prompt_len, len(output), sequence.prompt_len + len(output), sequence.cached_tokens)
        return GenerationResult(
            text=sequence.stream.text,
            token_ids=list(output),
            prompt_token_ids=request.prompt,
            finish_reason=sequence.stream.finish_reason or "length",
            stop=sequence.stream.matched_stop,
            logprobs=sequence.logprobs if request.params.logprobs else None,
            usage=usage,
            timing=timing,
            index=sequence.index,
            request_id=request.request_id,
            speculation=sequence.speculation.to_dict() if self.speculating else None,
        )


def _timing(sequence: RequestSequence) -> Timing:
    """How long a finished sequence took, from its request's arrival to each of its token times."""
    request = sequence.request
    times = sequence.token_times
    gaps = np.diff(times).tolist()
    decode_time = times[-1] - times[0]
    return Timing(
        ttft_s=times[0] - request.arrival,
        decode_tokens_per_s=len(gaps) / decode_time if decode_time > 0 else 0.0,
        mean_token_latency_s=decode_time / len(gaps) if gaps else 0.0,
        total_s=times[-1] - request.arrival,
        queue_s=(request.scheduled_at or times[0]) - request.arrival,
        inter_token_latencies_s=gaps,
    )


def deliver(request: Request, delta: GenerationDelta) -> list[GenerationDelta]:
    """Send a delta to its caller: into the outbox of a generate/stream call's request, else back to step()'s
    caller (in the list returned)."""
    if request.outbox is not None:
        request.outbox.append(delta)
        return []
    return [delta]


def _joined(first: StreamDelta, second: StreamDelta) -> StreamDelta:
    """Two deltas of one step as one (the token's text, then what the grammar's end or the context limit
    released)."""
    return StreamDelta(first.text + second.text, second.finished, second.finish_reason, second.stop)

"""RequestOutputs -> the response JSON of vLLM's OpenAI-compatible server: completions and chat, whole or
as stream chunks, logprobs in each endpoint's format, and usage.

Logprobs as vLLM writes them: the completions format gives each position's token text, its logprob,
a dict of the sampled (or prompt) token plus the top `logprobs` alternatives, and the text offsets; the
chat format gives each token with its bytes and the top `top_logprobs` in rank order. Logprobs below
-9999 (-inf included, which JSON cannot carry) are written as -9999, as OpenAI does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from jaxserve.sampling import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jaxserve.tokenizer import Tokenizer

_MIN_LOGPROB = -9999.0

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What every part of one response needs besides the outputs.

    logprobs: alternatives shown per position (None: no logprobs). texts: each prompt's text for echo
    (None: decoded from its ids). tokens_as_ids: vLLM's return_tokens_as_token_ids ("token_id:123").
    """

    id: str
    created: int
    model: str
    tokenizer: Tokenizer
    n: int
    logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False
    texts: list[str | None] = field(default_factory=list)
    include_stop_str: bool = False
    tokens_as_ids: bool = False

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if self.tokens_as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text(self, sample: CompletionOutput) -> str:
        """The sample's text; with include_stop_str_in_output, the stop string that ended it too."""
        if self.include_stop_str and sample.finish_reason == "stop" and isinstance(sample.stop_reason, str):
            return sample.text + sample.stop_reason
        return sample.text

    def prompt_text(self, index: int, output: RequestOutput) -> str:
        text = self.texts[index] if index < len(self.texts) else None
        return text if text is not None else self.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


def _clip(logprob: float) -> float:
    return max(logprob, _MIN_LOGPROB)


def completion_logprobs(
    ctx: ResponseContext, token_ids: list[int], positions: list[PositionLogprobs | None], offset: int = 0
) -> Json:
    """The completions format; a position without logprobs (the prompt's first) has None entries."""
    num = ctx.logprobs or 0
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, position in zip(token_ids, positions, strict=True):
        chosen = position.get(token) if position is not None else None
        text = ctx.token_text(token, chosen)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if position is None or chosen is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clip(chosen.logprob))
        others = [item for item in _by_rank(position) if item[0] != token][:num]
        top_logprobs.append({ctx.token_text(t, lp): _clip(lp.logprob) for t, lp in [(token, chosen), *others]})
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def chat_logprobs(ctx: ResponseContext, token_ids: list[int], positions: list[PositionLogprobs]) -> Json:
    """The chat format: each token with its bytes and the top `logprobs` tokens in rank order."""
    num = ctx.logprobs or 0

    def entry(token: int, logprob: Logprob) -> Json:
        text = ctx.token_text(token, logprob)
        return {"token": text, "logprob": _clip(logprob.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        top = [entry(t, lp) for t, lp in _by_rank(position)[:num]]
        content.append({**entry(token, position[token]), "top_logprobs": top})
    return {"content": content}


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    return sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else float("inf"))


def prompt_logprobs_json(entries: list[PositionLogprobs | None] | None) -> list[Json | None] | None:
    """vLLM's prompt_logprobs: per prompt position None or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if position is None
        else {
            str(token): {"logprob": _clip(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in position.items()
        }
        for position in entries
    ]


def usage(outputs: list[RequestOutput], echo_only: bool = False) -> Json:
    """Tokens of every prompt (once each, whatever n) and of every choice; cached: from the prefix cache."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish_reason(ctx: ResponseContext, sample: CompletionOutput) -> str | None:
    return "length" if ctx.echo_only and sample.finished else sample.finish_reason


# ---- whole responses ---------------------------------------------------------------------------


def completion_response(ctx: ResponseContext, outputs: list[RequestOutput]) -> Json:
    """POST /v1/completions without streaming: the choices of every prompt, prompt i's at i * n + j."""
    choices = []
    for index, output in enumerate(outputs):
        for sample in output.outputs:
            text, token_ids = ctx.text(sample), list(sample.token_ids)
            positions: list[PositionLogprobs | None] = list(sample.logprobs or [])
            if ctx.echo_only:
                text, token_ids, positions = "", [], []
            if ctx.echo:
                text = ctx.prompt_text(index, output) + text
                token_ids = output.prompt_token_ids + token_ids
                prompt_positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
                positions = [*prompt_positions, *positions]
            choices.append(
                {
                    "index": index * ctx.n + sample.index,
                    "text": text,
                    "logprobs": completion_logprobs(ctx, token_ids, positions) if ctx.logprobs is not None else None,
                    "finish_reason": _finish_reason(ctx, sample),
                    "stop_reason": sample.stop_reason,
                    "prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs),
                }
            )
    return {
        "id": ctx.id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage(outputs, ctx.echo_only),
    }


def chat_response(ctx: ResponseContext, output: RequestOutput) -> Json:
    """POST /v1/chat/completions without streaming: one choice per sample."""
    choices = [
        {
            "index": sample.index,
            "message": {"role": "assistant", "content": ctx.text(sample)},
            "logprobs": chat_logprobs(ctx, sample.token_ids, sample.logprobs or [])
            if ctx.logprobs is not None
            else None,
            "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason,
        }
        for sample in output.outputs
    ]
    return {
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage([output]),
        "prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs),
    }


# ---- streams -----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Sent:
    """How much of one choice a stream has sent: characters of its text, of the echoed prompt, tokens, and
    whether it ended."""

    chars: int = 0
    echoed: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False


class _Stream:
    """What a stream has sent of each choice; each chunk carries the text (and logprobs) since the last."""

    def __init__(self, ctx: ResponseContext, continuous_usage: bool) -> None:
        self.ctx = ctx
        self._continuous_usage = continuous_usage
        self._sent: dict[int, _Sent] = {}
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> its newest output

    def _envelope(self, kind: str, choices: list[Json]) -> Json:
        chunk: Json = {"id": self.ctx.id, "object": kind, "created": self.ctx.created, "model": self.ctx.model}
        chunk["choices"] = choices
        if self._continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    def _progress(self, index: int, output: RequestOutput) -> list[tuple[_Sent, CompletionOutput, str, slice]]:
        """Each unfinished choice of the output: its record, its sample, its new text and new tokens."""
        self._latest[index] = output
        changes = []
        for sample in output.outputs:
            sent = self._sent.setdefault(index * self.ctx.n + sample.index, _Sent())
            if sent.done:
                continue
            text = self.ctx.text(sample)
            changes.append((sent, sample, text[sent.chars :], slice(sent.tokens, len(sample.token_ids))))
            sent.chars, sent.tokens, sent.done = len(text), len(sample.token_ids), sample.finished
        return changes

    def usage(self) -> Json:
        return usage([self._latest[i] for i in sorted(self._latest)], self.ctx.echo_only)


class CompletionStream(_Stream):
    """The chunks of a streamed /v1/completions request (one choice per chunk)."""

    def chunks(self, index: int, output: RequestOutput) -> list[Json]:
        ctx, chunks = self.ctx, []
        for sent, sample, delta, new in self._progress(index, output):
            offset = sent.echoed + sent.chars - len(delta)
            token_ids, positions = sample.token_ids[new], list((sample.logprobs or [])[new])
            if ctx.echo_only:
                delta, token_ids, positions = "", [], []
            if ctx.echo and not sent.started:
                prompt_text = ctx.prompt_text(index, output)
                delta, offset, sent.echoed = prompt_text + delta, 0, len(prompt_text)
                token_ids = output.prompt_token_ids + token_ids
                positions = [*(output.prompt_logprobs or [None] * len(output.prompt_token_ids)), *positions]
            sent.started = True
            if not (delta or sample.finished or (ctx.logprobs is not None and token_ids)):
                continue
            logprobs = completion_logprobs(ctx, token_ids, positions, offset) if ctx.logprobs is not None else None
            choice = {
                "index": index * ctx.n + sample.index,
                "text": delta,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(ctx, sample),
                "stop_reason": sample.stop_reason,
            }
            chunks.append(self._envelope("text_completion", [choice]))
        return chunks

    def usage_chunk(self) -> Json:
        return {**self._envelope("text_completion", []), "usage": self.usage()}


class ChatStream(_Stream):
    """The chunks of a streamed /v1/chat/completions request: first each choice's role, then its deltas."""

    def role_chunks(self) -> list[Json]:
        return [
            self._envelope(
                "chat.completion.chunk",
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            )
            for i in range(self.ctx.n)
        ]

    def chunks(self, output: RequestOutput) -> list[Json]:
        ctx, chunks = self.ctx, []
        for _, sample, delta, new in self._progress(0, output):
            token_ids = sample.token_ids[new]
            if not (delta or sample.finished or (ctx.logprobs is not None and token_ids)):
                continue
            logprobs = None
            if ctx.logprobs is not None:
                logprobs = chat_logprobs(ctx, token_ids, (sample.logprobs or [])[new])
            choice = {
                "index": sample.index,
                "delta": {"content": delta} if delta else {},
                "logprobs": logprobs,
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }
            chunks.append(self._envelope("chat.completion.chunk", [choice]))
        return chunks

    def usage_chunk(self) -> Json:
        return {**self._envelope("chat.completion.chunk", []), "usage": self.usage()}


def sse(data: Json | str) -> str:
    """One server-sent event: `data: <json>` (or `data: [DONE]`)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

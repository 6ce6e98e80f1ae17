"""Requests -> what the engine takes: prompt token ids and one SamplingParams per request.

Everything the engine would refuse, and everything it would accept but cannot serve (a prompt over
max_seq_len, a variant this server did not compile), is checked here, so a bad request is a 400 that
names its field before anything is queued. Range messages are SamplingParams' own, with the field
renamed where the request calls it otherwise (chat's max_completion_tokens, top_logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxserve.sampling import SamplingParams, validate_prompt_token_ids
from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from jaxserve.tokenizer import Tokenizer
from jaxserve.variants import has_penalty

# Request fields passed to SamplingParams under the same name when they are not None.
_SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "prompt_logprobs",
)
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What a request is checked against: the engine's length limit, vocabulary and compiled variants."""

    max_seq_len: int
    vocab_size: int
    prompt_logprobs: bool
    penalties: bool


@dataclass(frozen=True, slots=True)
class EngineInputs:
    """One HTTP request's engine work: a prompt per choice group, with the text echo shows (None: the
    prompt was token ids, decoded when needed), and the parameters every prompt shares.

    echo_only: max_tokens 0 with echo; the engine generates one token, which the response leaves out.
    """

    prompts: list[list[int]]
    texts: list[str | None]
    params: SamplingParams
    echo_only: bool = False


def completion_inputs(request: CompletionRequest, tokenizer: Tokenizer, limits: EngineLimits) -> EngineInputs:
    """A completions request's engine inputs; a 400 APIError names the field at fault. With echo and
    logprobs the prompt is scored too (prompt_logprobs = logprobs, as vLLM does)."""
    _check_stream_fields(request)
    if request.max_tokens == 0 and not request.echo:
        message = "max_tokens must be >= 1 (0 only with echo=true, which returns the prompt), got 0"
        raise bad_request(message, "max_tokens")
    echo_only = request.echo and request.max_tokens == 0
    kwargs = _sampling_kwargs(request)
    kwargs["max_tokens"] = 1 if echo_only else request.max_tokens
    if request.logprobs is not None:
        kwargs["logprobs"] = request.logprobs
        if request.echo and request.prompt_logprobs is None:
            kwargs["prompt_logprobs"] = request.logprobs
    params = _sampling_params(kwargs, {})
    _check_compiled(params, limits, "prompt_logprobs" if request.prompt_logprobs is not None else "echo")
    prompts = _completion_prompts(request, tokenizer)
    for index, (ids, _) in enumerate(prompts):
        _check_prompt(ids, f"prompt {index}" if len(prompts) > 1 else "the prompt", "prompt", limits)
        _check_length(len(ids), params.max_tokens, "max_tokens", limits)
    return EngineInputs([ids for ids, _ in prompts], [text for _, text in prompts], params, echo_only)


def chat_inputs(request: ChatCompletionRequest, tokenizer: Tokenizer, limits: EngineLimits) -> EngineInputs:
    """A chat request's engine inputs: the conversation through the chat template; a 400 APIError names the
    field at fault (a malformed message is the tokenizer's `validate_messages` error, on `messages`)."""
    _check_stream_fields(request)
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens_field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    kwargs = _sampling_kwargs(request)
    kwargs["max_tokens"] = getattr(request, max_tokens_field)
    if request.logprobs:
        kwargs["logprobs"] = request.top_logprobs or 0
    params = _sampling_params(kwargs, {"max_tokens": max_tokens_field, "logprobs": "top_logprobs"})
    _check_compiled(params, limits, "prompt_logprobs")
    try:
        ids = tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=request.add_generation_prompt, chat_template=request.chat_template
        )
    except (TypeError, ValueError) as error:
        raise bad_request(str(error), "messages") from None
    _check_prompt(ids, "the conversation", "messages", limits)
    _check_length(len(ids), params.max_tokens, max_tokens_field, limits)
    return EngineInputs([ids], [None], params)


def _check_stream_fields(request: SamplingFields) -> None:
    """vLLM's rules: stream_options only with stream, and prompt logprobs only without it."""
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    if request.stream and request.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not available with stream=true", "prompt_logprobs")


def _sampling_kwargs(request: SamplingFields) -> dict[str, Any]:
    return {name: getattr(request, name) for name in _SAMPLING_FIELDS if getattr(request, name) is not None}


def _sampling_params(kwargs: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs); its ValueError (which starts with the field's name) is a 400 naming the
    request's field."""
    try:
        return SamplingParams(**kwargs)
    except (TypeError, ValueError) as error:
        message = str(error)
        field = message.split(" ", 1)[0].split("[", 1)[0]
        public = renames.get(field, field)
        raise bad_request(public + message[len(field) :], public if field in kwargs else None) from None


def _check_compiled(params: SamplingParams, limits: EngineLimits, prompt_logprobs_field: str) -> None:
    """A request that needs a step variant this server did not compile is refused, naming the flag."""
    if params.prompt_logprobs is not None and not limits.prompt_logprobs:
        raise bad_request(
            f"{prompt_logprobs_field} needs prompt logprobs (echo with logprobs, or prompt_logprobs), which this "
            "server does not compute: start it with --enable-prompt-logprobs",
            prompt_logprobs_field,
        )
    if has_penalty(params) and not limits.penalties:
        name = next(n for n in _PENALTIES if getattr(params, n) != (1.0 if n == "repetition_penalty" else 0.0))
        raise bad_request(
            f"{name} needs the penalty steps, which this server was started without (--no-penalty-variants)", name
        )


def _completion_prompts(request: CompletionRequest, tokenizer: Tokenizer) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids and its text (None for token ids, or a prompt truncated to
    truncate_prompt_tokens: decoded when echoed)."""
    prompt = request.prompt
    items: list[Any] = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else list(prompt)
    if not items:
        raise bad_request("prompt is empty: give a string, token ids, or a list of them", "prompt")
    keep = request.truncate_prompt_tokens
    if keep is not None and keep < 1:
        raise bad_request(f"truncate_prompt_tokens must be None or an int >= 1, got {keep}", "truncate_prompt_tokens")
    prompts = []
    for item in items:
        if isinstance(item, str):
            try:
                ids = tokenizer.encode(item, add_special_tokens=request.add_special_tokens) if item else []
            except ValueError as error:  # e.g. a model without a tokenizer takes token ids only
                raise bad_request(str(error), "prompt") from None
            text: str | None = item
        else:
            ids, text = list(item), None
        if keep is not None and len(ids) > keep:
            ids, text = ids[-keep:], None
        prompts.append((ids, text))
    return prompts


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _check_prompt(ids: list[int], where: str, field: str, limits: EngineLimits) -> None:
    try:
        validate_prompt_token_ids(ids, limits.vocab_size)
    except ValueError as error:
        raise bad_request(f"{where}: {error}", field) from None
    if len(ids) + 1 > limits.max_seq_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_seq_len} tokens. However, {where} has {len(ids)} "
            "tokens, and the prompt and one new token must fit. Please reduce the length of the prompt.",
            field,
        )


def _check_length(num_prompt_tokens: int, max_tokens: int | None, field: str, limits: EngineLimits) -> None:
    """vLLM's rule: a max_tokens that the context cannot hold is refused, not cut."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > limits.max_seq_len:
        raise APIError(
            400,
            f"'{field}' is too large: {max_tokens}. This model's maximum context length is {limits.max_seq_len} "
            f"tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {limits.max_seq_len} - {num_prompt_tokens}).",
            field,
        )

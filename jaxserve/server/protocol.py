"""The request bodies of the OpenAI-compatible endpoints, with vLLM's field names and defaults.

Fields are parsed in pydantic's lax mode, as vLLM's server parses them ("0.5" is a float, 1.0 an int).
A field this server does not know is accepted and ignored with a warning, as vLLM does; a field vLLM
knows but this server cannot honour (UNSUPPORTED) is refused when it asks for anything but its default,
rather than ignored. Value ranges are SamplingParams' and are checked there (`params.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxserve.server.errors import bad_request


def _unset(value: Any) -> bool:
    return value is None or value is False or value == "" or value == [] or value == {}


# vLLM's request fields this server does not implement, each with the values that ask for nothing.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "suffix": _unset,
    "logit_bias": _unset,
    "best_of": lambda v: v in (None, 1),
    "use_beam_search": _unset,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "response_format": lambda v: _unset(v) or v == {"type": "text"},
    "structured_outputs": _unset,
    "guided_json": _unset,
    "guided_regex": _unset,
    "guided_choice": _unset,
    "guided_grammar": _unset,
    "allowed_token_ids": _unset,
    "bad_words": _unset,
    "logits_processors": _unset,
    "prompt_embeds": _unset,
    "priority": lambda v: v in (None, 0),
    "tools": _unset,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": _unset,
    "function_call": lambda v: v in (None, "none", "auto"),
    "continue_final_message": _unset,
    "chat_template_kwargs": _unset,
    "documents": _unset,
    "mm_processor_kwargs": _unset,
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "echo": _unset,  # chat's echo (the completions endpoint declares its own)
}


class _Request(BaseModel):
    """Undeclared fields land in `model_extra`; `ignored_fields` refuses the UNSUPPORTED ones."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        """The undeclared fields, ignored; raises a 400 for one in UNSUPPORTED that asks for something."""
        extra = self.model_extra or {}
        for name, value in extra.items():
            if name in UNSUPPORTED and not UNSUPPORTED[name](value):
                raise bad_request(f"{name} is not supported by this server (got {_short(value)})", name)
        return sorted(name for name in extra if name not in UNSUPPORTED)


class StreamOptions(BaseModel):
    """include_usage: a last chunk carries the usage (vLLM's default True once stream_options is given);
    continuous_usage_stats: every chunk carries the usage so far."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(_Request):
    """The fields the completions and chat endpoints share (OpenAI's and vLLM's sampling extensions).

    None means "the engine's default" (SamplingParams'); the ranges are SamplingParams'."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, a list of token ids, or a list of
    token-id lists (one choice group per prompt). echo: the prompt is prepended to each text (and, with
    logprobs, its tokens' logprobs to the logprobs); with max_tokens 0 nothing is generated."""

    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. messages go through the model's chat template (or `chat_template`);
    max_completion_tokens (or the older max_tokens) caps each answer (None: up to max_seq_len);
    logprobs with top_logprobs alternatives per token."""

    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    chat_template: str | None = None


class TokenizeRequest(_Request):
    """POST /tokenize: a `prompt` (encoded with add_special_tokens, default True) or chat `messages`
    (through the chat template; add_special_tokens default False)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def parse(model: type[_Request], body: Any) -> Any:
    """`body` (decoded JSON) as `model`; a validation error is a 400 naming the first field at fault."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        if field == "prompt" and first["type"] != "missing":
            message = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
            raise bad_request(f"{message}, got {_short(body.get('prompt'))}", "prompt") from None
        where = ".".join(str(part) for part in first["loc"])
        got = "" if first["type"] == "missing" else f" (got {_short(first.get('input'))})"
        raise bad_request(f"{where}: {first['msg']}{got}", field) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

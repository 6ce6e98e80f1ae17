"""What a prompt can be, checked once at the API boundary (host policy: no jax).

A prompt is a string, a sequence of token ids (Python or numpy integers), a 1-D numpy integer array,
or a vLLM-style dict: `{"prompt": text}` (TextPrompt) or `{"prompt_token_ids": ids}` (TokensPrompt).
`generate` takes one prompt or a list of them (a 2-D integer array is one prompt per row). Anything
else is a TypeError naming the prompt's index and its type; token ids outside the vocabulary and empty
prompts are the engine's ValueErrors.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.sampling import is_exact_ints

Prompt = str | list[int]

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def normalize_prompts(prompts: Any) -> list[Prompt]:
    """One prompt or a list of prompts, as a list of strings and token-id lists."""
    if _is_one_prompt(prompts):
        return [normalize_prompt(prompts, 0)]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        return [normalize_prompt(row, i) for i, row in enumerate(prompts)]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes | bytearray):
        raise TypeError(_describe(0, prompts))
    return [normalize_prompt(prompt, i) for i, prompt in enumerate(prompts)]


def normalize_prompt(prompt: Any, index: int = 0) -> Prompt:
    """A string, or a list of Python ints (their range is checked by the engine)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return _from_dict(prompt, index)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(
                f"prompt {index} is a numpy array of shape {prompt.shape} and dtype {prompt.dtype}; "
                "a prompt array must be 1-D with an integer dtype"
            )
        return prompt.tolist()
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        return _token_ids(prompt, index)
    raise TypeError(_describe(index, prompt))


def _is_one_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str | Mapping):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    is_sequence = isinstance(prompts, Sequence) and not isinstance(prompts, bytes | bytearray)
    return is_sequence and len(prompts) > 0 and all(_is_number(t) for t in prompts)


def _from_dict(prompt: Mapping, index: int) -> Prompt:
    keys = [k for k in _PROMPT_KEYS if k in prompt]
    unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
    if len(keys) != 1 or unknown:
        raise ValueError(
            f"prompt {index} is a dict with keys {sorted(str(k) for k in prompt)}; it must hold exactly one of "
            f"{list(_PROMPT_KEYS)} (vLLM's TextPrompt / TokensPrompt) and nothing else"
        )
    value = prompt[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise TypeError(f"prompt {index}: 'prompt' must be a str, got {type(value).__name__}")
        return value
    if isinstance(value, np.ndarray) or (isinstance(value, Sequence) and not isinstance(value, str | bytes)):
        return normalize_prompt(value, index)
    raise TypeError(f"prompt {index}: 'prompt_token_ids' must be a list of ints, got {type(value).__name__}")


def _token_ids(prompt: Sequence, index: int) -> list[int]:
    if is_exact_ints(prompt):
        return list(prompt)  # the common case, in C: a copy the caller's later edits do not reach
    for position, token in enumerate(prompt):
        if isinstance(token, bool | np.bool_) or not isinstance(token, numbers.Integral):
            raise TypeError(
                f"prompt {index}: token ids must be ints, got {token!r} ({type(token).__name__}) at position {position}"
            )
    return [int(t) for t in prompt]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Number | np.generic) and not isinstance(value, str)


def _describe(index: int, prompt: Any) -> str:
    kind = type(prompt).__name__
    hint = ": decode it to a str, or pass token ids" if isinstance(prompt, bytes | bytearray) else ""
    return (
        f"prompt {index} is a {kind}{hint}; a prompt is a str, a list of token ids, a 1-D integer numpy array, "
        "or a dict {'prompt': str} / {'prompt_token_ids': [int, ...]}"
    )

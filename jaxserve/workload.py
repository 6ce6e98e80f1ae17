"""The requests a benchmark runs (`jaxserve bench`): random token-id prompts of fixed lengths, JSONL dataset
files, the warm-up and latency batches, and how the requests sample.

Host policy: no jax here. Random prompts are drawn from a seed, the warm-up's and each latency batch's from
a stream of their own, so that the prefix cache never serves a timed prompt from an earlier one. Every
request runs with ignore_eos and max_tokens = its output length, so it makes exactly that many tokens.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.sampling import SamplingParams

# Random prompt ids are drawn from [_LOW_TOKEN_ID, min(vocab, _HIGH_TOKEN_ID)), as benchmarks/engine.py
# draws them: clear of the low ids where tokenizers keep their special tokens.
_LOW_TOKEN_ID, _HIGH_TOKEN_ID = 100, 32000
# The warm-up generate: this many requests (the workload's first ones' lengths), this many tokens each.
WARMUP_REQUESTS, WARMUP_TOKENS = 8, 4


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests as token ids, and how many tokens each one generates."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_seq_len(self) -> int:
        """The longest request: prompt + output tokens."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))


def random_prompts(num: int, length: int, vocab_size: int, seed: int | Sequence[int]) -> list[list[int]]:
    """`num` prompts of `length` random token ids; the same seed gives the same prompts."""
    rng = np.random.default_rng(seed)
    return [rng.integers(*_token_range(vocab_size), length).tolist() for _ in range(num)]


def _token_range(vocab_size: int) -> tuple[int, int]:
    return min(_LOW_TOKEN_ID, vocab_size - 1), min(vocab_size, _HIGH_TOKEN_ID)


def random_workload(num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> Workload:
    return Workload(random_prompts(num_requests, input_len, vocab_size, seed), [output_len] * num_requests)


def warmup_workload(workload: Workload, vocab_size: int, seed: int = 0) -> Workload:
    """A few requests shaped like the workload's first ones, of other random ids, a few tokens each."""
    count = min(WARMUP_REQUESTS, workload.num_requests)
    rng = np.random.default_rng((seed, 1))
    prompts = [rng.integers(*_token_range(vocab_size), len(p)).tolist() for p in workload.prompts[:count]]
    return Workload(prompts, [min(WARMUP_TOKENS, n) for n in workload.output_lens[:count]])


def latency_batches(
    batch_size: int, input_len: int, output_len: int, vocab_size: int, seed: int, count: int
) -> list[Workload]:
    """`count` batches of random prompts, batch i drawn from the stream (seed, i)."""
    return [
        Workload(random_prompts(batch_size, input_len, vocab_size, (seed, i)), [output_len] * batch_size)
        for i in range(count)
    ]


@dataclass(frozen=True, slots=True)
class DatasetEntry:
    """One line of a dataset file: where it is ("file:line"), its prompt, its output length if given."""

    where: str
    prompt: str | list[int]
    output_len: int | None


def read_dataset(path: str | os.PathLike, num_requests: int | None = None) -> list[DatasetEntry]:
    """The requests of a JSONL file (blank lines skipped), the first `num_requests` of them when given.

    Each line is a JSON object with "prompt" (text) or "prompt_token_ids" (a list of ints), and optionally
    "output_len" or "max_tokens" (an int >= 1); other keys are ignored. A missing file is a
    FileNotFoundError, a malformed line a ValueError naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path.absolute()} does not exist or is not a file")
    entries = []
    with path.open(encoding="utf-8") as lines:
        try:
            for number, text in enumerate(lines, start=1):
                if text.strip():
                    entries.append(parse_dataset_line(text, f"{path}:{number}"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text ({error.reason} after line {len(entries)})") from None
    if not entries:
        raise ValueError(f"{path}: no requests (the file has no non-blank line)")
    if num_requests is not None and num_requests > len(entries):
        raise ValueError(f"--num-requests {num_requests} is more than the {len(entries)} requests in {path}")
    return entries[:num_requests]


def parse_dataset_line(text: str, where: str) -> DatasetEntry:
    """One dataset line (see `read_dataset`); `where` names it in the errors."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if ("prompt" in record) == ("prompt_token_ids" in record):
        raise ValueError(f'{where}: needs exactly one of "prompt" (text) and "prompt_token_ids"')
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    else:
        prompt = record["prompt_token_ids"]
        if not isinstance(prompt, list) or not prompt or not all(_is_int(t) and t >= 0 for t in prompt):
            raise ValueError(f'{where}: "prompt_token_ids" must be a non-empty list of ints >= 0, got {prompt!r}')
    keys = [key for key in ("output_len", "max_tokens") if key in record]
    if len(keys) > 1:
        raise ValueError(f'{where}: give one of "output_len" and "max_tokens", not both')
    output_len = record[keys[0]] if keys else None
    if output_len is not None and not (_is_int(output_len) and output_len >= 1):
        raise ValueError(f'{where}: "{keys[0]}" must be an int >= 1, got {output_len!r}')
    return DatasetEntry(where, prompt, output_len)


def dataset_workload(entries: Sequence[DatasetEntry], tokenizer: Any, vocab_size: int, output_len: int) -> Workload:
    """The entries as token ids (text through the tokenizer, as `LLM.generate` encodes it); `output_len`
    for the entries that give none. A token id outside the vocabulary is a ValueError naming the line."""
    prompts = []
    for entry in entries:
        if isinstance(entry.prompt, str):
            try:
                ids = list(tokenizer.encode(entry.prompt))
            except ValueError as error:
                raise ValueError(f"{entry.where}: {error}") from None
        else:
            ids = entry.prompt
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{entry.where}: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size - 1}]")
        prompts.append(ids)
    return Workload(prompts, [output_len if e.output_len is None else e.output_len for e in entries])


def engine_max_seq_len(workload_max: int, user_value: int | None, model_limit: int) -> int:
    """max_seq_len for the benchmark's engine: the longest request's unless the user gives one."""
    if workload_max > model_limit:
        raise ValueError(
            f"the longest request needs {workload_max} tokens (prompt + output); the model allows {model_limit}"
        )
    if user_value is not None and user_value < workload_max:
        raise ValueError(f"--max-seq-len {user_value} is shorter than the longest request ({workload_max} tokens)")
    return workload_max if user_value is None else user_value


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How the benchmark's requests sample; seed: request i samples with seed + i (None: the engine's PRNG)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None

    def params(self, output_lens: Sequence[int]) -> list[SamplingParams]:
        return [
            SamplingParams(
                max_tokens=n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=None if self.seed is None else self.seed + i,
                ignore_eos=True,
            )
            for i, n in enumerate(output_lens)
        ]


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)

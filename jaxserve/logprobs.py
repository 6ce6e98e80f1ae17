"""Logprobs on the device: `TokenLogprobs`, the one type for sampled and prompt tokens alike, computed
from one log_softmax.

They are the raw model distribution's (vLLM's default "raw_logprobs"): log_softmax of the logits the
sampler sees before penalties and temperature, min_tokens bans included for sampled tokens; prompt
tokens are scored over the raw logits. The host turns a row into vLLM's per-position
`{token_id: Logprob}` dict (`outputs.position_logprobs`).

Shape legend: R rows (sequences for sampled tokens, flat tokens for prompt tokens), V vocab,
N top logprobs, T tokens, D model dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.sampler import two_stage_top_k

# Tokens per slice of the prompt-logprobs computation: the logits of one slice ([slice, V] float32) are
# all it holds at once.
PROMPT_LOGPROBS_SLICE = 512


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Per row: the logprob and rank of one chosen token, and the N most likely tokens, best first.

    rank is 1 + the number of tokens with a larger logit, over the whole vocabulary. The leaves are
    device arrays in a step's output and numpy arrays once read back (`jax.device_get`).
    """

    logprob: Float[Array, " R"]
    rank: Int[Array, " R"]
    top_logprobs: Float[Array, "R N"]
    top_ids: Int[Array, "R N"]


def token_logprobs(logits: Float[Array, "R V"], token_ids: Int[Array, " R"], num_top: int) -> TokenLogprobs:
    """Logprob and rank of each row's token, and the `num_top` (static) best, from one log_softmax."""
    logits = logits.astype(jnp.float32)
    token_ids = token_ids.astype(jnp.int32)[:, None]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen_logit = jnp.take_along_axis(logits, token_ids, axis=-1)
    rank = 1 + jnp.sum(logits > chosen_logit, axis=-1, dtype=jnp.int32)
    chosen = jnp.take_along_axis(logprobs, token_ids, axis=-1)[:, 0]
    if num_top == 0:
        empty = no_token_logprobs(logits.shape[0], 0)
        return TokenLogprobs(chosen, rank, empty.top_logprobs, empty.top_ids)
    top_logprobs, top_ids = two_stage_top_k(logprobs, num_top)  # lax.top_k's result without its full sort
    return TokenLogprobs(chosen, rank, top_logprobs, top_ids)


def no_token_logprobs(num_rows: int, num_top: int) -> TokenLogprobs:
    """Zeros of TokenLogprobs' shapes: a step in which no row asked for logprobs."""
    return TokenLogprobs(
        jnp.zeros(num_rows, jnp.float32),
        jnp.zeros(num_rows, jnp.int32),
        jnp.zeros((num_rows, num_top), jnp.float32),
        jnp.zeros((num_rows, num_top), jnp.int32),
    )


def prompt_token_logprobs(
    compute_logits: Callable[[Float[Array, "S D"]], Float[Array, "S V"]],
    hidden: Float[Array, "T D"],
    targets: Int[Array, " T"],
    num_top: int,
) -> TokenLogprobs:
    """TokenLogprobs of each flat token's target (the next prompt token; negative: none, logprob and
    rank 0), PROMPT_LOGPROBS_SLICE tokens at a time so only one slice's logits exist at once."""
    num_tokens = hidden.shape[0]
    size = math.gcd(num_tokens, PROMPT_LOGPROBS_SLICE)

    def one_slice(args: tuple[Array, Array]) -> TokenLogprobs:
        h, t = args
        scored = token_logprobs(compute_logits(h), jnp.maximum(t, 0), num_top)
        valid = t >= 0
        return TokenLogprobs(
            jnp.where(valid, scored.logprob, 0.0), jnp.where(valid, scored.rank, 0), scored.top_logprobs, scored.top_ids
        )

    slices = (hidden.reshape(num_tokens // size, size, -1), targets.reshape(num_tokens // size, size))
    out = jax.lax.map(one_slice, slices)
    return jax.tree.map(lambda x: x.reshape(num_tokens, *x.shape[2:]), out)

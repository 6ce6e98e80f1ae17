"""On-device sampling: penalties, temperature, top-k / top-p / min-p and per-request seeds.

Everything here is a pure function of device arrays that the runner traces inside its compiled step,
with no data-dependent shapes. Work a batch does not need (the filters' sort, the draw) is skipped with
lax.cond; the `greedy_only` variant has none (why that matters on a GPU: docs/benchmarks.md, "Third 8B
run"). The host side (validation of SamplingParams, stop conditions) lives in `sampling.py`, the
per-row arrays in `inputs.SamplingInputs` (registered here as a pytree); logprobs in `logprobs.py`.
This module only turns one step's logits into tokens.

Semantics follow vLLM:
- order: penalties -> temperature -> top-k -> top-p -> min-p -> sample;
- a row is greedy when its temperature is below 1e-5 or its top_k is 1; a greedy row takes the argmax
  of its penalised logits, so top_k=1 equals greedy exactly, ties included;
- top-k keeps the k largest logits, top-p the smallest set of most likely tokens whose probability
  (renormalised after top-k) reaches top_p, min-p the tokens whose probability is at least min_p times
  the most likely one's. All three are cut from one descending sort per row and applied as one logit
  threshold, so a token tied with the last kept token is kept too;

Shape legend: B sequences (rows), V vocab, S token-history length. A one-letter shape is written " B":
jaxtyping ignores the space, and linters no longer read it as a name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.inputs import SamplingInputs, TokenHistory

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by a smaller value only
# risks overflow, and the distribution is already a point mass in float32.
GREEDY_TEMPERATURE = 1e-5

jax.tree_util.register_dataclass(SamplingInputs)
jax.tree_util.register_dataclass(TokenHistory)


def sample(
    logits: Float[Array, "B V"],
    params: SamplingInputs,
    key: Array,
    *,
    history: TokenHistory | None = None,
    greedy_only: bool = False,
) -> Int[Array, " B"]:
    """One token per row (see the module docstring for the semantics).

    `key` is this step's PRNG key (a typed key or raw uint32 key data); unseeded rows use it folded
    with their row index, so the runner must pass a fresh key every step.

    `history` holds each row's prompt then output token ids, padded with the sentinel V (out of range,
    dropped by the scatters). Without it the penalties are skipped: a separate compiled variant, which
    spares the host building and sending the [B, S] history, and returns the same tokens when every
    row's penalties are neutral. With a history they are applied to every row (neutral rows come out
    bit-identical): the caller passes one only when some row has a penalty.

    `greedy_only` (static): the caller promises every row is greedy; the step is an argmax with no
    conditional.
    """
    logits = logits.astype(jnp.float32)
    # Work the batch does not need is skipped with lax.cond. Measured on an H200 for 256 rows of a 49k
    # vocabulary: the sort takes 0.9 ms (2.1 ms at 128k) against 0.07 ms for an argmax.
    penalised = logits if history is None else apply_penalties(logits, params, history)
    if greedy_only:
        return jnp.argmax(penalised, axis=-1).astype(jnp.int32)

    is_greedy = (params.temperature < GREEDY_TEMPERATURE) | (params.top_k == 1)
    scaled = penalised / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
    vocab = logits.shape[-1]
    has_filter = ((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0) | (params.min_p > 0.0)
    threshold = jax.lax.cond(
        jnp.any(has_filter & ~is_greedy), _filter_threshold, _keep_all, scaled, params.top_k, params.top_p, params.min_p
    )
    filtered = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    sampled = jax.lax.cond(jnp.any(~is_greedy), _gumbel_max, _no_draw, filtered, params, key)
    return jnp.where(is_greedy, jnp.argmax(penalised, axis=-1), sampled).astype(jnp.int32)


def apply_penalties(logits: Float[Array, "B V"], params: SamplingInputs, history: TokenHistory) -> Float[Array, "B V"]:
    """Repetition, frequency and presence penalties; neutral values leave a row's logits bit-identical.

    Repetition (Hugging Face / vLLM): over prompt and output tokens, a positive logit is divided by the
    penalty and a negative one multiplied. Frequency and presence (OpenAI): over output tokens only,
    subtract frequency_penalty x count and presence_penalty x [count > 0].
    """
    token_history, num_prompt_tokens = history.token_ids, history.num_prompt_tokens
    batch, vocab = logits.shape
    history_len = token_history.shape[1]
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, history_len))
    is_output = jnp.arange(history_len)[None, :] >= num_prompt_tokens[:, None]
    # The sentinel V is out of range and mode="drop" discards it; a negative id would wrap around instead.
    seen = jnp.zeros((batch, vocab), jnp.bool_).at[rows, token_history].set(True, mode="drop")
    counts = (
        jnp.zeros((batch, vocab), jnp.float32).at[rows, token_history].add(is_output.astype(jnp.float32), mode="drop")
    )

    repetition = params.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
    penalised = jnp.where(seen, repeated, logits)
    penalised = penalised - params.frequency_penalty[:, None] * counts
    return penalised - params.presence_penalty[:, None] * (counts > 0)


def _filter_threshold(
    scaled: Float[Array, "B V"], top_k: Int[Array, " B"], top_p: Float[Array, " B"], min_p: Float[Array, " B"]
) -> Float[Array, " B"]:
    """The smallest temperature-scaled logit a row keeps after top-k, top-p and min-p.

    Each filter keeps a prefix of the descending order, so their intersection is the prefix up to the
    first position any of them drops, and its last logit is the threshold.
    """
    vocab = scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1, descending=True)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth_largest = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    in_top_k = ordered >= kth_largest

    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], axis=-1)
    # top_p = 1 must keep every token even where float32 rounding pushes the cumulative sum to 1 early.
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)

    # p >= min_p * p_max  <=>  z - z_max >= log(min_p); min_p = 0 gives -inf, which keeps everything.
    in_min_p = ordered - ordered[:, :1] >= jnp.log(min_p)[:, None]

    kept = in_top_k & in_top_p & in_min_p
    # First dropped position, not sum(kept): a cumulative sum is not guaranteed monotone in float32.
    num_kept = jnp.where(kept.all(axis=-1), vocab, jnp.argmin(kept, axis=-1))
    num_kept = jnp.maximum(num_kept, 1)
    return jnp.take_along_axis(ordered, (num_kept - 1)[:, None], axis=-1)[:, 0]


def _gumbel_max(filtered: Float[Array, "B V"], params: SamplingInputs, key: Array) -> Int[Array, " B"]:
    """One exact draw per row from softmax(filtered).

    argmax(z + Gumbel noise) needs no cumulative sum, whose float32 rounding would distort the
    probabilities of tail tokens (an inverse-CDF draw over a large vocabulary would).
    """
    keys = _row_keys(params, key)
    noise = jax.vmap(lambda row_key: jax.random.gumbel(row_key, filtered.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)


def _no_draw(filtered: Float[Array, "B V"], params: SamplingInputs, key: Array) -> Int[Array, " B"]:
    return jnp.zeros(filtered.shape[:1], jnp.int32)


def _keep_all(scaled: Float[Array, "B V"], *filters: object) -> Float[Array, " B"]:
    return jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype)


def _row_keys(params: SamplingInputs, key: Array) -> Array:
    """One PRNG key per row: from (seed, generation_index) for seeded rows, else the step key and the row."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    impl = jax.random.key_impl(key)
    seeded = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed, impl=impl), index))(
        params.seed, params.generation_index
    )
    unseeded = jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(params.seed.shape[0]))
    return jnp.where(params.has_seed, seeded, unseeded)

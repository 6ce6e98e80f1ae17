"""On-device sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds and logprobs.

Everything here is a pure function of device arrays that the runner traces inside its compiled step,
with no data-dependent shapes. Work a batch does not need (the filters' sort, the draw) is skipped with
lax.cond, which on a GPU makes the step's call wait for the device (see `sample`); the `greedy_only`
variant has no conditional. The host side (validation of SamplingParams, stop conditions)
lives in `sampling.py`; this module only turns one step's logits into tokens.

Semantics follow vLLM:
- order: penalties -> temperature -> top-k -> top-p -> min-p -> sample;
- a row is greedy when its temperature is below 1e-5 or its top_k is 1; a greedy row takes the argmax
  of its penalised logits, so top_k=1 equals greedy exactly, ties included;
- top-k keeps the k largest logits, top-p the smallest set of most likely tokens whose probability
  (renormalised after top-k) reaches top_p, min-p the tokens whose probability is at least min_p times
  the most likely one's. All three are cut from one descending sort per row and applied as one logit
  threshold, so a token tied with the last kept token is kept too;
- logprobs are those of the raw model distribution, log_softmax(logits) before penalties and
  temperature (vLLM's default "raw_logprobs"), for the sampled token and the top-n alternatives.

Shape legend: B sequences (rows), V vocab, S token-history length, N top logprobs, T tokens. A
one-letter shape is written " B": jaxtyping ignores the space, and linters no longer read it as a name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by a smaller value only
# risks overflow, and the distribution is already a point mass in float32.
GREEDY_TEMPERATURE = 1e-5

# The dtypes of the compiled step's sampling inputs: fixed, so that no batch can change the signature.
_DTYPES: dict[str, type[np.generic]] = {
    "temperature": np.float32,
    "top_k": np.int32,
    "top_p": np.float32,
    "min_p": np.float32,
    "repetition_penalty": np.float32,
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "seed": np.uint32,
    "has_seed": np.bool_,
    "generation_index": np.int32,
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters of one step; every field is an array with leading dimension B.

    Neutral values switch a feature off for that row: temperature 0 (greedy), top_k 0 (or >= V),
    top_p 1, min_p 0, repetition_penalty 1, presence_penalty 0, frequency_penalty 0. A row with
    `has_seed` draws from a key derived only from (seed, generation_index), where generation_index is
    the index of the token being generated in that request (0 for the first), so its samples do not
    depend on the batch around it. Padding rows should carry neutral values (see `neutral`).
    """

    temperature: Float[Array, " B"]
    top_k: Int[Array, " B"]
    top_p: Float[Array, " B"]
    min_p: Float[Array, " B"]
    repetition_penalty: Float[Array, " B"]
    presence_penalty: Float[Array, " B"]
    frequency_penalty: Float[Array, " B"]
    seed: UInt32[Array, " B"]
    has_seed: Bool[Array, " B"]
    generation_index: Int[Array, " B"]

    @classmethod
    def from_arrays(cls, **arrays: object) -> SamplingTensors:
        """Builds the tensors from host arrays (one per field), cast to the dtypes the compiled step expects.

        Fixed dtypes keep the step's input signature stable, so a new batch never triggers a compile.
        Seeds are taken modulo 2**32 (the PRNG seed width with 64-bit mode off).
        """
        names = [f.name for f in dataclasses.fields(cls)]
        if sorted(arrays) != sorted(names):
            missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
            raise ValueError(f"SamplingTensors.from_arrays: missing fields {missing}, unknown fields {extra}")
        host = {name: np.asarray(arrays[name]) for name in names}
        host["seed"] = (host["seed"].astype(np.int64) % 2**32).astype(np.uint32)
        batch = host["temperature"].shape
        for name in names:
            if host[name].shape != batch or len(batch) != 1:
                raise ValueError(f"SamplingTensors field {name} has shape {host[name].shape}; expected (B,) = {batch}")
        return cls(**{name: jnp.asarray(host[name], dtype=_DTYPES[name]) for name in names})

    @classmethod
    def neutral(cls, batch_size: int) -> SamplingTensors:
        """Greedy rows with every feature off: padding rows, warmup and greedy-only batches."""
        if batch_size < 1:
            raise ValueError(f"SamplingTensors.neutral: batch_size must be >= 1, got {batch_size}")
        neutral = {"top_p": 1.0, "repetition_penalty": 1.0}
        return cls.from_arrays(**{name: np.full(batch_size, neutral.get(name, 0)) for name in _DTYPES})


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """Sampled tokens and their raw logprobs; `top_*` hold the N most likely tokens, best first."""

    token_ids: Int[Array, " B"]
    logprobs: Float[Array, " B"]
    top_logprobs: Float[Array, "B N"]
    top_token_ids: Int[Array, "B N"]


def sample(
    logits: Float[Array, "B V"],
    params: SamplingTensors,
    key: Array,
    *,
    num_top_logprobs: int = 0,
    token_history: Int[Array, "B S"] | None = None,
    num_prompt_tokens: Int[Array, " B"] | None = None,
    greedy_only: bool = False,
) -> SamplerOutput:
    """Samples one token per row (see the module docstring for the semantics).

    `key` is this step's PRNG key (a typed key or raw uint32 key data); unseeded rows use it folded
    with their row index, so the runner must pass a fresh key every step. `num_top_logprobs` is static.

    `token_history` holds each row's prompt then output token ids, padded with the sentinel V (out of
    range, dropped by the scatters); positions below `num_prompt_tokens[b]` are prompt tokens. Without
    it the penalties are skipped: a separate compiled variant, which spares the host building and
    sending the [B, S] history, and returns the same tokens when every row's penalties are neutral. With a
    history they are applied to every row (neutral rows come out bit-identical): the caller passes one
    only when some row has a penalty.

    `greedy_only` (static): the caller promises every row is greedy; the step is an argmax with no
    conditional, so its call does not wait for the device (see below).
    """
    if (token_history is None) != (num_prompt_tokens is None):
        raise ValueError("sample: pass token_history and num_prompt_tokens together, or neither")
    logits = logits.astype(jnp.float32)
    # Work the batch does not need is skipped with lax.cond. Measured on an H200 for 256 rows of a 49k
    # vocabulary: the sort takes 0.9 ms (2.1 ms at 128k) against 0.07 ms for an argmax, and the conds
    # cost about 0.04 ms of device time. But XLA's GPU conditional with real work in its branches copies
    # its predicate to the host and blocks the host until the device gets there (ConditionalThunk;
    # measured in docs/benchmarks.md, third 8B run), so the step call returns only after the forward
    # pass. Hence `greedy_only`, a static variant without conditionals, for all-greedy batches.
    penalised = logits
    if token_history is not None:
        penalised = apply_penalties(logits, params, token_history, num_prompt_tokens)
    if greedy_only:
        token_ids = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
        logprobs, top_logprobs, top_token_ids = compute_logprobs(logits, token_ids, num_top_logprobs)
        return SamplerOutput(token_ids, logprobs, top_logprobs, top_token_ids)

    is_greedy = (params.temperature < GREEDY_TEMPERATURE) | (params.top_k == 1)
    scaled = penalised / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
    vocab = logits.shape[-1]
    has_filter = ((params.top_k > 0) & (params.top_k < vocab)) | (params.top_p < 1.0) | (params.min_p > 0.0)
    threshold = jax.lax.cond(
        jnp.any(has_filter & ~is_greedy), _filter_threshold, _keep_all, scaled, params.top_k, params.top_p, params.min_p
    )
    filtered = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    sampled = jax.lax.cond(jnp.any(~is_greedy), _gumbel_max, _no_draw, filtered, params, key)
    token_ids = jnp.where(is_greedy, jnp.argmax(penalised, axis=-1), sampled).astype(jnp.int32)

    logprobs, top_logprobs, top_token_ids = compute_logprobs(logits, token_ids, num_top_logprobs)
    return SamplerOutput(token_ids, logprobs, top_logprobs, top_token_ids)


def apply_penalties(
    logits: Float[Array, "B V"],
    params: SamplingTensors,
    token_history: Int[Array, "B S"],
    num_prompt_tokens: Int[Array, " B"],
) -> Float[Array, "B V"]:
    """Repetition, frequency and presence penalties; neutral values leave a row's logits bit-identical.

    Repetition (Hugging Face / vLLM): over prompt and output tokens, a positive logit is divided by the
    penalty and a negative one multiplied. Frequency and presence (OpenAI): over output tokens only,
    subtract frequency_penalty x count and presence_penalty x [count > 0].
    """
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


def compute_logprobs(
    logits: Float[Array, "T V"], token_ids: Int[Array, " T"], num_top: int
) -> tuple[Float[Array, " T"], Float[Array, "T N"], Int[Array, "T N"]]:
    """Raw log_softmax of `logits` at `token_ids`, and the `num_top` (static) largest logprobs with their ids.

    Used for the sampled tokens and, by the runner, for prompt logprobs (row t scores token t + 1).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, token_ids[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if num_top == 0:
        rows = logprobs.shape[0]
        return chosen, jnp.zeros((rows, 0), jnp.float32), jnp.zeros((rows, 0), jnp.int32)
    top_logprobs, top_token_ids = jax.lax.top_k(logprobs, num_top)
    return chosen, top_logprobs, top_token_ids.astype(jnp.int32)


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


def _gumbel_max(filtered: Float[Array, "B V"], params: SamplingTensors, key: Array) -> Int[Array, " B"]:
    """One exact draw per row from softmax(filtered).

    argmax(z + Gumbel noise) needs no cumulative sum, whose float32 rounding would distort the
    probabilities of tail tokens (an inverse-CDF draw over a large vocabulary would).
    """
    keys = _row_keys(params, key)
    noise = jax.vmap(lambda row_key: jax.random.gumbel(row_key, filtered.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)


def _no_draw(filtered: Float[Array, "B V"], params: SamplingTensors, key: Array) -> Int[Array, " B"]:
    return jnp.zeros(filtered.shape[:1], jnp.int32)


def _keep_all(scaled: Float[Array, "B V"], *filters: object) -> Float[Array, " B"]:
    return jnp.full(scaled.shape[:1], -jnp.inf, scaled.dtype)


def _row_keys(params: SamplingTensors, key: Array) -> Array:
    """One PRNG key per row: from (seed, generation_index) for seeded rows, else the step key and the row."""
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    impl = jax.random.key_impl(key)
    seeded = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.key(seed, impl=impl), index))(
        params.seed, params.generation_index
    )
    unseeded = jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(params.seed.shape[0]))
    return jnp.where(params.has_seed, seeded, unseeded)

"""On-device sampling: penalties, temperature, top-k / top-p / min-p and per-request seeds.

Everything here is a pure function of device arrays that the runner compiles as the step's sampler,
with no data-dependent shapes and no device-side conditional: a `lax.cond` makes the call that
launches it wait for the device to reach the predicate (docs/log/2026-benchmarks.md, "Third 8B run"), which
would stall the host behind every sampling step. What a batch needs is chosen on the host instead,
as the sampler mode (`SamplerMode`, part of `variants.StepVariant`):

- GREEDY: every row is greedy and none asks for top logprobs: an argmax.
- CANDIDATES: the filters are cut from each row's NUM_CANDIDATES most likely tokens, found in two
  cheap stages (`two_stage_top_k`); exact whenever every row's top-k fits the candidates and every top-p row
  has such a top-k (the host checks, `StepConfig.sampler_mode`); min-p needs only the maximum.
- SORTED: the filters are cut from a descending sort of each row's whole vocabulary (any top-p).
The host side (validation of SamplingParams, stop conditions) lives in `sampling.py`, the per-row
arrays in `step_inputs.SamplingInputs`; logprobs in `logprobs.py`.

Semantics follow vLLM:
- order: penalties -> temperature -> top-k -> top-p -> min-p -> sample;
- a row is greedy when its temperature is below 1e-5 or its top_k is 1; a greedy row takes the argmax
  of its penalised logits, so top_k=1 equals greedy exactly, ties included;
- top-k keeps the k largest logits, top-p the smallest set of most likely tokens whose probability
  (renormalised after top-k) reaches top_p, min-p the tokens whose probability is at least min_p times
  the most likely one's. The three are applied as one logit threshold, so a token tied with the last
  kept token is kept too;

Shape legend: B sequences (rows), V vocab, S token-history length, K candidates. A one-letter shape
is written " B": jaxtyping ignores the space, and linters no longer read it as a name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxserve.step_inputs import SamplingInputs, TokenHistory, register_device_pytrees
from jaxserve.variants import NUM_CANDIDATES, SamplerMode

# Below this temperature a row is greedy (vLLM's _SAMPLING_EPS): dividing by a smaller value only
# risks overflow, and the distribution is already a point mass in float32.
GREEDY_TEMPERATURE = 1e-5
# Vocabulary entries per chunk in `top_k`'s first stage.
TOP_K_CHUNK = 128

register_device_pytrees()  # SamplingInputs and TokenHistory are declared pytrees in the jax-free step_inputs.py


def sample(
    logits: Float[Array, "B V"],
    params: SamplingInputs,
    key: Array,
    *,
    mode: SamplerMode,
    history: TokenHistory | None = None,
) -> Int[Array, " B"]:
    """One token per row (see the module docstring for the semantics and the modes).

    `key` is this step's PRNG key (a typed key or raw uint32 key data); unseeded rows use it folded
    with their row index, so the runner must pass a fresh key every step.

    `history` holds each row's prompt then output token ids, padded with the sentinel V (out of range,
    dropped by the scatters). Without it the penalties are skipped: a separate compiled variant, which
    spares the host building and sending the [B, S] history, and returns the same tokens when every
    row's penalties are neutral. With a history they are applied to every row (neutral rows come out
    bit-identical): the caller passes one only when some row has a penalty.
    """
    return sample_with_logits(logits, params, key, mode=mode, history=history)[0]


def sample_with_logits(
    logits: Float[Array, "B V"],
    params: SamplingInputs,
    key: Array,
    *,
    mode: SamplerMode,
    history: TokenHistory | None = None,
) -> tuple[Int[Array, " B"], Float[Array, "B V"]]:
    """`sample`'s tokens and the logits each row's token is drawn from (vLLM's "processed" logits):
    a greedy row's penalised logits (its argmax), a sampling row's penalised, temperature-scaled logits
    with -inf outside what its top-k / top-p / min-p keep. A row gets the same in every mode."""
    logits = logits.astype(jnp.float32)
    penalised = logits if history is None else apply_penalties(logits, params, history)
    greedy_tokens = jnp.argmax(penalised, axis=-1).astype(jnp.int32)
    if mode is SamplerMode.GREEDY:
        return greedy_tokens, penalised

    is_greedy = (params.temperature < GREEDY_TEMPERATURE) | (params.top_k == 1)
    scaled = penalised / jnp.where(is_greedy, 1.0, params.temperature)[:, None]
    vocab = scaled.shape[-1]
    if mode is SamplerMode.SORTED:
        ordered = jnp.sort(scaled, axis=-1, descending=True)
    else:
        ordered, _ = two_stage_top_k(scaled, min(NUM_CANDIDATES, vocab))
    threshold = _filter_threshold(ordered, vocab, params.top_k, params.top_p, params.min_p)
    filtered = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    tokens = jnp.where(is_greedy, greedy_tokens, _gumbel_max(filtered, params, key))
    return tokens, jnp.where(is_greedy[:, None], penalised, filtered)


def two_stage_top_k(x: Float[Array, "B V"], k: int) -> tuple[Float[Array, "B k"], Int[Array, "B k"]]:
    """`jax.lax.top_k(x, k)` (same values, same ids, ties to the lower id) in two cheaper stages.

    XLA's GPU top-k sorts whole rows for k beyond a few, 2.2 ms for 256 x 128256. Here: the maximum
    of every TOP_K_CHUNK-wide chunk, the k chunks with the largest maxima (a top-k over V / 128
    values), then a top-k over those chunks' k * 128 entries. Exact: each of the k largest entries
    lies in a chunk whose maximum is at least that entry, and fewer than k chunks can have a larger
    maximum without k entries above it.
    """
    batch, vocab = x.shape
    num_chunks = -(-vocab // TOP_K_CHUNK)
    if num_chunks <= k:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    padded = jnp.pad(x, ((0, 0), (0, num_chunks * TOP_K_CHUNK - vocab)), constant_values=-jnp.inf)
    chunks = padded.reshape(batch, num_chunks, TOP_K_CHUNK)
    _, best_chunks = jax.lax.top_k(jnp.max(chunks, axis=-1), k)
    best_chunks = jnp.sort(best_chunks, axis=-1)  # ascending ids: ties resolve to the lower id, as lax.top_k's
    entries = jnp.take_along_axis(chunks, best_chunks[:, :, None], axis=1).reshape(batch, k * TOP_K_CHUNK)
    values, where = jax.lax.top_k(entries, k)
    ids = jnp.take_along_axis(best_chunks, where // TOP_K_CHUNK, axis=-1) * TOP_K_CHUNK + where % TOP_K_CHUNK
    return values, ids.astype(jnp.int32)


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
    ordered: Float[Array, "B K"],
    vocab: int,
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    min_p: Float[Array, " B"],
) -> Float[Array, " B"]:
    """The smallest temperature-scaled logit a row keeps after top-k, top-p and min-p, from its K largest
    logits in descending order: the whole sorted vocabulary (SORTED), or the NUM_CANDIDATES best
    (CANDIDATES: exact when the row's top-k, if any, is at most K and its top-p comes with one).

    The three filters are thresholds on the logit, and a row keeps the logits at or above the largest:
    top-k's is the k-th largest; top-p's the last logit of the descending prefix whose mass, renormalised
    over the top-k survivors, reaches top_p; min-p's the maximum plus log(min_p). A filter that is off
    gives -inf. (Entries beyond the K given that tie with the k-th do not count in the top-p mass.)
    """
    size = ordered.shape[-1]
    has_top_k = (top_k > 0) & (top_k < vocab)
    kth_largest = jnp.take_along_axis(ordered, (jnp.clip(top_k, 1, size) - 1)[:, None], axis=-1)
    kth_largest = jnp.where(has_top_k[:, None], kth_largest, -jnp.inf)
    in_top_k = ordered >= kth_largest

    probs = jax.nn.softmax(jnp.where(in_top_k, ordered, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # top_p = 1 must keep every token even where float32 rounding pushes the cumulative sum to 1 early.
    kept = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    # First dropped position, not sum(kept): a cumulative sum is not guaranteed monotone in float32.
    num_kept = jnp.maximum(jnp.where(kept.all(axis=-1), size, jnp.argmin(kept, axis=-1)), 1)
    top_p_threshold = jnp.take_along_axis(ordered, (num_kept - 1)[:, None], axis=-1)[:, 0]
    top_p_threshold = jnp.where(top_p < 1.0, top_p_threshold, -jnp.inf)
    # p >= min_p * p_max  <=>  z >= z_max + log(min_p); min_p = 0 gives -inf, which keeps everything.
    min_p_threshold = ordered[:, 0] + jnp.log(min_p)
    return jnp.maximum(jnp.maximum(kth_largest[:, 0], top_p_threshold), min_p_threshold)


def _gumbel_max(filtered: Float[Array, "B V"], params: SamplingInputs, key: Array) -> Int[Array, " B"]:
    """One exact draw per row from softmax(filtered).

    argmax(z + Gumbel noise) needs no cumulative sum, whose float32 rounding would distort the
    probabilities of tail tokens (an inverse-CDF draw over a large vocabulary would).
    """
    keys = _row_keys(params, key)
    noise = jax.vmap(lambda row_key: jax.random.gumbel(row_key, filtered.shape[-1:], jnp.float32))(keys)
    return jnp.argmax(filtered + noise, axis=-1).astype(jnp.int32)


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

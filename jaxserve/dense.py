"""Dense reference generator: the simplest correct generation loop over a model family.

The paged engine is tested against it. It prefills every prompt in one flat batch (each prompt is
its own sequence in a contiguous `DenseKVCache`), then decodes all sequences together, one jitted
step per token. No buckets, no paging, no overlap: a reference, not the fast path.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve.models.attention import DenseAttentionMetadata, DenseKVCache, init_dense_cache
from jaxserve.models.quant import FP8_DTYPE
from jaxserve.models.registry import ModelFamily


def sample_tokens(
    logits: Float[Array, "B V"], key: jax.Array, temperature: Float[Array, ""], top_p: Float[Array, ""]
) -> Int[Array, " B"]:
    """Greedy when temperature == 0, else softmax(logits / temperature) restricted to the top-p nucleus.

    The nucleus keeps the most likely tokens whose preceding cumulative probability is below
    top_p, so the most likely token is always kept. temperature and top_p are traced values: one
    compiled step serves every sampling setting.
    """
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    threshold = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1)
    nucleus = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
    sampled = jax.random.categorical(key, nucleus, axis=-1)
    return jnp.where(temperature == 0.0, greedy, sampled).astype(jnp.int32)


@partial(jax.jit, static_argnames=("family", "cfg"))
def _step(
    weights: Any,
    token_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    seq_ids: Int[Array, " T"],
    sample_rows: Int[Array, " B"],
    kv_cache: DenseKVCache,
    key: jax.Array,
    temperature: Float[Array, ""],
    top_p: Float[Array, ""],
    *,
    family: ModelFamily,
    cfg: Any,
) -> tuple[Int[Array, " B"], DenseKVCache]:
    """One forward over a flat batch, then one sampled token per sequence from its `sample_rows` row."""
    hidden, kv_cache = family.forward(weights, token_ids, positions, kv_cache, DenseAttentionMetadata(seq_ids), cfg)
    logits = family.compute_logits(weights, hidden[sample_rows], cfg)
    return sample_tokens(logits, key, temperature, top_p), kv_cache


def _validate(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float) -> None:
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got none")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must hold at least one token, got an empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def generate_dense(
    family: ModelFamily,
    cfg: Any,
    weights: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    quantize_lm_head: bool = False,
) -> list[list[int]]:
    """The new tokens of each prompt: max_new_tokens of them, or fewer ending with an EOS token.

    `weights` in the checkpoint layout (what loaders and `init_weights` return); `quantization`: their linear
    layers quantized as the engine's `EngineConfig.quantization` quantizes them (the same products), and the
    lm_head with `quantize_lm_head` (`EngineConfig.quantize_lm_head`);
    `kv_cache_dtype` "fp8": the cache holds K and V as the engine's FP8 pool does (`KvCacheConfig.dtype`)."""
    _validate(prompts, max_new_tokens, temperature, top_p)
    weights = family.to_serving(weights, cfg, quantization=quantization, quantize_lm_head=quantize_lm_head)
    sampling = (np.float32(temperature), np.float32(top_p))
    step = partial(_step, family=family, cfg=cfg)
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    batch = len(prompts)
    cache_dtype = FP8_DTYPE if kv_cache_dtype == "fp8" else weights.embed.dtype
    kv_cache = init_dense_cache(cfg, batch, int(lengths.max()) + max_new_tokens, cache_dtype)
    keys = jax.random.split(jax.random.key(seed), max_new_tokens)

    # Prefill: all prompts in one flat batch, sampling from each prompt's last token.
    token_ids = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    seq_ids = np.repeat(np.arange(batch, dtype=np.int32), lengths)
    next_tokens, kv_cache = step(
        weights, token_ids, positions, seq_ids, (np.cumsum(lengths) - 1).astype(np.int32), kv_cache, keys[0], *sampling
    )

    eos = set(eos_token_ids)
    outputs: list[list[int]] = [[] for _ in prompts]
    finished = [False] * batch
    rows = np.arange(batch, dtype=np.int32)
    for i in range(max_new_tokens):
        tokens = np.asarray(next_tokens)
        for b in range(batch):
            if not finished[b]:
                outputs[b].append(int(tokens[b]))
                finished[b] = int(tokens[b]) in eos or len(outputs[b]) == max_new_tokens
        if all(finished):
            break
        # Finished sequences keep decoding (their tokens are dropped): one batch shape, one compile.
        next_tokens, kv_cache = step(weights, tokens, lengths + i, rows, rows, kv_cache, keys[i + 1], *sampling)
    return outputs

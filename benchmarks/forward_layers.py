"""Device time of one decode step's forward for a Llama-3.1-8B-shaped model: layers scanned with
`lax.scan` over stacked weights (what models/llama.py does) against a Python loop over per-layer
weight buffers, plus the full step over the same batch. Answers whether slicing a layer's weights
out of the stacked arrays costs a copy per layer.

    python benchmarks/forward_layers.py --batch 256 --context 192
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import LLAMA_3_1_8B, timed_ms

from models import llama, registry
from models.attention import PagedAttentionMetadata, init_paged_cache
from models.common import gated_mlp, rms_norm, rope_frequencies


def unrolled_forward(weights, layers, token_ids, positions, kv_cache, meta, cfg):
    """models.llama.forward with a Python loop over separate per-layer weight pytrees."""
    x = jnp.take(weights.embed, token_ids, axis=0)
    cos, sin = rope_frequencies(cfg.rope, cfg.head_dim, positions)
    for index, layer in enumerate(layers):
        normed = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        attn, kv_cache = llama.attention_block(
            layer, normed, positions, cos, sin, kv_cache, jnp.int32(index), meta, cfg
        )
        h = x + attn
        x = h + gated_mlp(rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate, layer.w_up, layer.w_down)
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), kv_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--backend", default="pallas")
    args = parser.parse_args()
    family, cfg = registry.resolve(LLAMA_3_1_8B)
    weights = family.init_weights(cfg, jax.random.key(0), jnp.bfloat16)
    layers = [jax.tree_util.tree_map(lambda w, i=i: w[i] + 0, weights.layers) for i in range(cfg.num_layers)]
    B, ctx, block = args.batch, args.context, 16
    per_seq = -(-ctx // block)
    num_blocks = B * per_seq + 1
    cache = init_paged_cache(cfg, num_blocks, block, jnp.bfloat16)
    table = (1 + np.random.default_rng(0).permutation(B * per_seq)).reshape(B, per_seq).astype(np.int32)
    meta = PagedAttentionMetadata(
        slot_mapping=jnp.asarray(table[:, (ctx - 1) // block] * block + (ctx - 1) % block),
        block_table=jnp.asarray(table),
        kv_lens=jnp.full(B, ctx, jnp.int32),
        cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32),
        num_seqs=jnp.int32(B),
        backend=args.backend,
    )
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32000, B), jnp.int32)
    positions = jnp.full(B, ctx - 1, jnp.int32)

    scanned = jax.jit(
        lambda w, c: family.compute_logits(w, family.forward(w, tokens, positions, c, meta, cfg)[0], cfg),
        donate_argnames=("c",),
    )
    unrolled = jax.jit(
        lambda w, ls, c: family.compute_logits(w, unrolled_forward(w, ls, tokens, positions, c, meta, cfg)[0], cfg),
        donate_argnames=("c",),
    )
    a = scanned(weights, cache)
    cache = init_paged_cache(cfg, num_blocks, block, jnp.bfloat16)
    b = unrolled(weights, layers, cache)
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(weights))
    kv_bytes = 2 * cfg.num_layers * B * ctx * cfg.num_kv_heads * cfg.head_dim * 2
    cache = init_paged_cache(cfg, num_blocks, block, jnp.bfloat16)
    t_scan = timed_ms(lambda c: scanned(weights, c), cache)
    cache = init_paged_cache(cfg, num_blocks, block, jnp.bfloat16)
    t_unrolled = timed_ms(lambda c: unrolled(weights, layers, c), cache)
    floor = (weight_bytes + kv_bytes) / 4.25e12 * 1e3
    print(f"B={B} context={ctx}: weights {weight_bytes / 1e9:.1f} GB + KV {kv_bytes / 1e9:.2f} GB", end=" ")
    print(f"-> floor {floor:.2f} ms at 4.25 TB/s")
    print(
        f"scan over stacked layers: {t_scan:.2f} ms; python loop over per-layer buffers: {t_unrolled:.2f} ms", end=" "
    )
    print(f"(logits rel diff {err:.1e})")


if __name__ == "__main__":
    main()

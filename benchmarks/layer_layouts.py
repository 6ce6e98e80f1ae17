"""Compile time and device time of one decode forward (+ logits + argmax) of the Llama-3.1-8B shape under
different layer layouts and XLA options: which one reads each weight once and compiles in seconds.

Layouts:
    scan        lax.scan over the stacked [L, ...] weights (what jaxserve/models/llama.py did)
    loop        a Python loop over per-layer weight buffers (separate arrays, no slicing)
    loop_fused  the same with q/k/v in one [D, (H + 2K) Dh] matrix and gate/up in one [D, 2F] matrix

Each configuration is `layout[:option=value,...]`, options being XLA debug options passed to this
executable only (`compile(compiler_options=...)`), e.g. `loop:xla_gpu_enable_triton_gemm=false`.

    python benchmarks/layer_layouts.py --batches 1,256 --configs scan,loop,loop:xla_gpu_enable_triton_gemm=false
    python benchmarks/layer_layouts.py --batches 1,64,128,256 --configs loop --parallel-compile 4

Prints one JSON line per (configuration, batch): compile seconds, device ms per call, the largest logit
difference against the first configuration, and the bytes floor at 4.25 TB/s.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from common import timed_ms

from jaxserve.models import llama, registry, shapes
from jaxserve.models.attention import PagedAttentionMetadata, attention, init_paged_cache
from jaxserve.models.common import apply_rope, gated_mlp, rms_norm, rope_frequencies

BLOCK = 16


def loop_forward(weights, layers, token_ids, positions, kv_cache, meta, cfg):
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


def fused_forward(weights, layers, token_ids, positions, kv_cache, meta, cfg):
    h_, k_, dh, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    x = jnp.take(weights.embed, token_ids, axis=0)
    cos, sin = rope_frequencies(cfg.rope, cfg.head_dim, positions)
    for index, layer in enumerate(layers):
        normed = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        qkv = normed @ layer["wqkv"]
        q = qkv[:, : h_ * dh].reshape(-1, h_, dh)
        k = qkv[:, h_ * dh : (h_ + k_) * dh].reshape(-1, k_, dh)
        v = qkv[:, (h_ + k_) * dh :].reshape(-1, k_, dh)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, kv_cache = attention(
            q, k, v, positions, kv_cache, jnp.int32(index), meta, sm_scale=dh**-0.5, sliding_window=None
        )
        h = x + out.reshape(out.shape[0], -1) @ layer["wo"]
        gu = rms_norm(h, layer["mlp_norm"], cfg.rms_norm_eps) @ layer["w_gate_up"]
        x = h + (jax.nn.silu(gu[:, :f]) * gu[:, f:]) @ layer["w_down"]
    return rms_norm(x, weights.final_norm, cfg.rms_norm_eps), kv_cache


def chained_calls(compiled, weights, layer_args, cache):
    """A no-argument call of `compiled` that hands each call's (donated) cache to the next."""
    state = {"cache": cache}

    def call():
        _, tokens, state["cache"] = compiled(weights, layer_args, state["cache"])
        return tokens

    return call


def parse_config(text: str) -> tuple[str, dict]:
    layout, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        name, _, value = item.partition("=")
        options[name] = {"true": True, "false": False}.get(value.lower(), value)
    return layout, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--configs", default="scan,loop")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--backend", default="pallas")
    parser.add_argument("--parallel-compile", type=int, default=0, help="also compile every batch in N threads")
    args = parser.parse_args()
    family, cfg = registry.resolve(shapes.shape(args.shape))
    weights = family.init_weights(cfg, jax.random.key(0), jnp.bfloat16)
    layouts = {parse_config(c)[0] for c in args.configs.split(",")}
    layers = [jax.tree.map(lambda w, i=i: w[i] + 0, weights.layers) for i in range(cfg.num_layers)]
    fused = []
    if "loop_fused" in layouts:
        for lw in layers:
            d = cfg.hidden_size
            fused.append(
                {
                    "attn_norm": lw.attn_norm,
                    "mlp_norm": lw.mlp_norm,
                    "wqkv": jnp.concatenate([lw.wq.reshape(d, -1), lw.wk.reshape(d, -1), lw.wv.reshape(d, -1)], 1),
                    "wo": lw.wo.reshape(-1, d),
                    "w_gate_up": jnp.concatenate([lw.w_gate, lw.w_up], 1),
                    "w_down": lw.w_down,
                }
            )
    if "scan" not in layouts:
        weights = llama.LlamaWeights(weights.embed, None, weights.final_norm, weights.lm_head)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(layers)) + 2 * weights.embed.nbytes
    ctx = args.context
    reference: dict[int, jax.Array] = {}

    def build(layout: str, batch: int):
        per_seq = -(-ctx // BLOCK)
        num_blocks = batch * per_seq + 1
        table = (1 + np.random.default_rng(0).permutation(batch * per_seq)).reshape(batch, per_seq).astype(np.int32)
        meta = PagedAttentionMetadata(
            slot_mapping=jnp.asarray(table[:, (ctx - 1) // BLOCK] * BLOCK + (ctx - 1) % BLOCK),
            block_table=jnp.asarray(table),
            kv_lens=jnp.full(batch, ctx, jnp.int32),
            cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
            num_seqs=jnp.int32(batch),
            backend=args.backend,
            max_q_len=1,
        )
        tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, batch), jnp.int32)
        positions = jnp.full(batch, ctx - 1, jnp.int32)
        forward = {"scan": None, "loop": loop_forward, "loop_fused": fused_forward}[layout]
        layer_args = {"scan": None, "loop": layers, "loop_fused": fused}[layout]

        def fn(w, ls, c):
            if layout == "scan":
                hidden, c = family.forward(w, tokens, positions, c, meta, cfg)
            else:
                hidden, c = forward(w, ls, tokens, positions, c, meta, cfg)
            logits = family.compute_logits(w, hidden, cfg)
            return logits, jnp.argmax(logits, -1), c

        cache = jax.eval_shape(lambda: init_paged_cache(cfg, num_blocks, BLOCK, jnp.bfloat16))
        lowered = jax.jit(fn, donate_argnames=("c",)).lower(weights, layer_args, cache)
        kv_bytes = 2 * cfg.num_layers * batch * ctx * cfg.num_kv_heads * cfg.head_dim * 2
        return lowered, layer_args, num_blocks, kv_bytes

    for text in args.configs.split(","):
        layout, options = parse_config(text)
        for batch in map(int, args.batches.split(",")):
            t0 = time.perf_counter()
            lowered, layer_args, num_blocks, kv_bytes = build(layout, batch)
            t1 = time.perf_counter()
            try:
                compiled = lowered.compile(compiler_options=options or None)
            except Exception as error:  # an option this XLA does not know: report it, go on
                print(json.dumps(dict(config=text, batch=batch, error=repr(error)[:300])), flush=True)
                continue
            t2 = time.perf_counter()
            cache = init_paged_cache(cfg, num_blocks, BLOCK, jnp.bfloat16)
            logits, _, cache = compiled(weights, layer_args, cache)
            diff = float(jnp.max(jnp.abs(logits - reference.setdefault(batch, logits))))
            ms = timed_ms(chained_calls(compiled, weights, layer_args, cache))
            floor = (weight_bytes + kv_bytes) / 4.25e12 * 1e3
            row = dict(config=text, batch=batch, context=ctx, trace_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2))
            row.update(device_ms=round(ms, 3), floor_ms=round(floor, 3), max_logit_diff=diff)
            print(json.dumps(row), flush=True)
            del compiled, cache, logits

    if args.parallel_compile:
        layout, options = parse_config(args.configs.split(",")[-1])
        batches = [int(b) + 8 for b in args.batches.split(",")]  # new shapes: no in-process cache hits
        lowered = [build(layout, b)[0] for b in batches]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.parallel_compile) as pool:
            list(pool.map(lambda low: low.compile(compiler_options=options or None), lowered))
        wall = time.perf_counter() - t0
        row = dict(parallel_compile=args.parallel_compile, config=args.configs.split(",")[-1], batches=batches)
        print(json.dumps({**row, "wall_s": round(wall, 2)}), flush=True)


if __name__ == "__main__":
    main()

"""One mixture-of-experts layer's MLP (jaxserve/models/moe.py `experts_mlp`, the pallas path) timed piece by piece
against each piece's floor, at Qwen3-30B-A3B's shapes (E=128, D=2048, F=768, top-8; bf16), for a step of T tokens.

    python benchmarks/moe_layer_profile.py [--tokens 1 8 64 512 4096] [--json]
    python benchmarks/moe_layer_profile.py --interpret --tokens 4   # a CPU smoke run (times mean nothing)

Pieces, each its own jit, in the order the layer runs them (R = T x k routed rows):
  route     the router GEMM [T, D] x [D, E] in float32, softmax, top-k (`moe.route`)
  sort      the rows' order by expert and the group sizes (`moe.sort_by_expert`: argsort, bincount)
  gate_up   silu(gate) x up, the grouped Pallas GEMM [R, D] x [E, D, 2F], its rows gathered from the [T, D] tokens
            in its loads (lhs_rows)
  down      the grouped Pallas GEMM [R, F] x [E, F, D]
  combine   back to token order and the weighted sum over the k choices, float32
  layer     the whole `experts_mlp` in one jit (what a step runs; less than the sum where XLA fuses)
Floors: bytes / copy bandwidth and flops / matmul rate from `benchmarks/ceilings.py` measured in the same run; the
floor is the larger. Bytes count what must move once: the weights of the experts that receive rows (the "hit"
count: E (1 - (1 - k/E)^T) expected, measured here), the router, and each piece's activations in and out. Wall
time per call is `time_calls` (calls inside one jit, median of five runs). Routing: the router's weights are
random, scaled so each token's choices differ (not uniform over experts, as a trained router's are not).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import kernels
from jaxserve.models import llama_moe, moe, shapes
from jaxserve.models.attention import PagedAttentionMetadata


def layer_weights(key: jax.Array, mlp, dim: int, dtype) -> moe.ExpertMlp:
    """One layer's random expert weights at the scale init_weights uses (1 / sqrt(fan in))."""
    e, f = mlp.num_experts, mlp.intermediate_size
    k1, k2, k3 = jax.random.split(key, 3)
    return moe.ExpertMlp(
        router=(jax.random.normal(k1, (dim, e), jnp.float32) * 4 / dim**0.5).astype(dtype),
        w_gate_up=(jax.random.normal(k2, (e, dim, 2, f), jnp.float32) / dim**0.5).astype(dtype),
        w_down=(jax.random.normal(k3, (e, f, dim), jnp.float32) / f**0.5).astype(dtype),
        shared_gate_up=None,
        shared_down=None,
        shared_gate=None,
    )


def paged_meta(interpret: bool) -> PagedAttentionMetadata:
    """Metadata that selects the pallas path of experts_mlp (its attention fields are not read here)."""
    zeros = jnp.zeros((1,), jnp.int32)
    return PagedAttentionMetadata(
        slot_mapping=zeros,
        block_table=zeros[None],
        kv_lens=zeros,
        cu_q_lens=jnp.zeros((2,), jnp.int32),
        num_seqs=zeros[0],
        backend="pallas",
        interpret=interpret,
    )


def profile(tokens: int, interpret: bool, ceilings: dict[str, float] | None) -> list[dict]:
    cfg = llama_moe.MoeConfig.from_hf(shapes.shape("qwen3-30b-a3b"))
    mlp, dim, dtype = cfg.mlp_layers[0], cfg.hidden_size, jnp.bfloat16
    e, f, k = mlp.num_experts, mlp.intermediate_size, mlp.top_k
    weights = layer_weights(jax.random.key(0), mlp, dim, dtype)
    x = jax.random.normal(jax.random.key(1), (tokens, dim), jnp.float32).astype(dtype)
    meta = paged_meta(interpret)
    rows = tokens * k
    opts = dict(interpret=interpret)

    expert_ids, route_weights = jax.jit(moe.route, static_argnums=(2, 3))(x, weights.router, k, mlp.normalize_top_k)
    order, sizes = jax.jit(moe.sort_by_expert, static_argnums=1)(expert_ids, e)
    token_of_row = order // k
    hidden = kernels.grouped_gate_up(x, weights.w_gate_up, sizes, lhs_rows=token_of_row, **opts)
    out = kernels.grouped_matmul(hidden, weights.w_down, sizes, **opts)
    hit = int((np.asarray(sizes) > 0).sum())

    def combine(out, order, route_weights):
        position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        per_choice = jnp.take(out, position, axis=0).reshape(tokens, k, -1)
        return jnp.einsum("tkd,tk->td", per_choice.astype(jnp.float32), route_weights)

    item = 2
    pieces = [
        # name, function, args, bytes that must move, flops
        (
            "route",
            lambda x, r: moe.route(x, r, k, mlp.normalize_top_k),
            (x, weights.router),
            (tokens * dim + dim * e) * item + tokens * k * 8,
            2 * tokens * dim * e,
        ),
        ("sort", lambda ids: moe.sort_by_expert(ids, e), (expert_ids,), rows * 4 * 2 + e * 4, 0),
        (
            "gate_up",
            lambda a, w, s, r: kernels.grouped_gate_up(a, w, s, lhs_rows=r, **opts),
            (x, weights.w_gate_up, sizes, token_of_row),
            (hit * dim * 2 * f + tokens * dim + rows * f) * item + rows * 4,
            2 * rows * dim * 2 * f,
        ),
        (
            "down",
            lambda a, w, s: kernels.grouped_matmul(a, w, s, **opts),
            (hidden, weights.w_down, sizes),
            (hit * f * dim + rows * f + rows * dim) * item,
            2 * rows * f * dim,
        ),
        (
            "combine",
            combine,
            (out, order, route_weights),
            rows * dim * item + tokens * dim * 4 + rows * 12,
            2 * rows * dim,
        ),
    ]
    whole_bytes = (hit * 3 * dim * f + dim * e + 2 * tokens * dim) * item
    whole_flops = 2 * tokens * dim * e + 2 * rows * 3 * dim * f
    layer = lambda x, w: moe.experts_mlp(x, w, mlp, meta)  # noqa: E731
    pieces.append(("layer", layer, (x, weights), whole_bytes, whole_flops))
    table = []
    for name, fn, args, moved, flops in pieces:
        jax.block_until_ready(jax.jit(fn)(*args))  # compiles and runs: the piece works at this size
        entry = {"tokens": tokens, "piece": name, "experts_hit": hit, "MB": moved / 1e6, "GFLOP": flops / 1e9}
        if ceilings is not None:
            from common import time_calls

            seconds = time_calls(fn, [args], 20)
            floor = max(moved / (ceilings["copy_TBps"] * 1e12), flops / (ceilings["matmul_TFLOPs"] * 1e12))
            entry |= {"us": seconds * 1e6, "floor_us": floor * 1e6, "of_floor": seconds / floor}
        table.append(entry)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--interpret", action="store_true", help="the Pallas kernels on the CPU: no timing")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    if args.interpret:
        jax.config.update("jax_platforms", "cpu")
    ceilings = None
    if not args.interpret:
        from ceilings import ceilings as measure

        ceilings = measure()
        print(
            f"{jax.devices()[0].device_kind}, jax {jax.__version__}: copy {ceilings['copy_TBps']:.2f} TB/s, "
            f"matmul {ceilings['matmul_TFLOPs']:.0f} TFLOP/s"
        )
    for tokens in args.tokens:
        table = profile(tokens, args.interpret, ceilings)
        for row in table:
            if args.json:
                print(json.dumps(row))
            elif ceilings is None:
                print(f"{row['tokens']:>5} tokens {row['piece']:<8} {row['experts_hit']:>4} hit  ok")
            else:
                print(
                    f"{row['tokens']:>5} tokens {row['piece']:<8} {row['experts_hit']:>4} hit {row['MB']:>8.1f} MB "
                    f"{row['GFLOP']:>8.2f} GFLOP {row['us']:>9.1f} us  floor {row['floor_us']:>8.1f} us  "
                    f"{row['of_floor']:>5.2f}x"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

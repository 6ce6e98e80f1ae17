"""One MoE layer (router, top-k, grouped GEMMs, combine: `jaxserve.models.moe.experts_mlp`) timed under the two
expert layouts of tensor parallelism: tensor-parallel experts (the default rules table: each expert's hidden "mlp"
split over the model axis) and expert parallelism (EXPERT_PARALLEL_RULES: E / tp whole experts a device), the
weights placed by the rules table and the layer partitioned by XLA as the engine's step is. What the default of
`EngineConfig.enable_expert_parallel` is chosen from (docs/performance.md, "MoE: expert layout").

    python benchmarks/moe_parallel.py --tp 2,4 --tokens 4,16,64             # a CPU mesh, the shape shrunk 4x
    python benchmarks/moe_parallel.py --tp 2,4,8 --tokens 8,64,512,4096 --scale 1 --dtype bfloat16   # GPUs

The layer is Qwen3-30B-A3B's (hidden 2048, 128 experts of width 768, top 8, renormalised) with hidden and width
divided by --scale (default 4, so that a small CPU holds and runs it). On a CPU, where jax has one device, the
script asks XLA for as many host devices as the largest --tp (XLA_FLAGS=--xla_force_host_platform_device_count):
such a mesh measures XLA's collectives between threads of one host, not NVLink, and its GEMMs share the host's
cores (XLA's CPU ragged_dot also multiplies every row by every expert of the device, so the two layouts do the
same work a device), so its ranking may not hold on GPUs. Each row: the median of --repeats timed calls after a
warm-up, one device (tp=1) as the reference; the three are timed in turn within each repeat.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = lambda text: tuple(int(part) for part in text.split(",") if part)  # noqa: E731
    parser.add_argument("--tp", type=sizes, default=(2, 4), help="tensor-parallel sizes (default: 2,4)")
    parser.add_argument("--tokens", type=sizes, default=(4, 16, 64), help="tokens a step (default: 4,16,64)")
    parser.add_argument("--scale", type=int, default=4, help="hidden and expert width divided by this (default: 4)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", default="float32", help="float32 (default; CPU) or bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def force_host_devices(count: int) -> None:
    """Asks XLA for `count` host devices unless XLA_FLAGS already says how many (before jax starts; on a GPU the
    flag only shapes the unused host platform)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def build_layer(mlp, hidden: int, tokens: int, tp: int, expert_parallel: bool, args):
    """A call of one jitted MoE layer over `tokens` tokens on a tp-device mesh (tp=1: one device), its weights
    placed by the layout's rules table; compiled and run once."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models import moe
    from jaxserve.models.common import ParamSpec
    from jaxserve.sharding.mesh import make_mesh
    from jaxserve.sharding.rules import named_shardings, rules_table

    dtype = jnp.dtype(args.dtype)
    specs = moe.mlp_specs(hidden, mlp)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    keys = jax.random.split(jax.random.key(args.seed), len(leaves) + 1)
    weights = jax.tree.unflatten(
        treedef,
        [(jax.random.normal(k, s.shape, jnp.float32) * 0.05).astype(dtype) for k, s in zip(keys, leaves, strict=False)],
    )
    x = jax.random.normal(keys[-1], (tokens, hidden), jnp.float32).astype(dtype)
    mesh = make_mesh(tp=tp, devices=jax.devices()[:tp])
    weights = jax.device_put(weights, named_shardings(specs, mesh, rules_table(expert_parallel)))
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    layer = jax.jit(lambda x, w: moe.experts_mlp(x, w, mlp))
    layer(x, weights).block_until_ready()  # compile and warm up
    return lambda: layer(x, weights).block_until_ready()


def time_interleaved(calls: list, repeats: int) -> list[float]:
    """Median seconds of each call, timed in turn within each repeat, so that a load that comes and goes on the
    machine weighs on every layout alike."""
    seconds: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, times in zip(calls, seconds, strict=True):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in seconds]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    force_host_devices(max(args.tp))
    import jax

    from jaxserve.models.layers import LayerMlp
    from jaxserve.models.shapes import shape

    qwen = shape("qwen3-30b-a3b")
    hidden, width = qwen["hidden_size"] // args.scale, qwen["moe_intermediate_size"] // args.scale
    mlp = LayerMlp(width, num_experts=args.experts, top_k=args.top_k, normalize_top_k=True)
    devices = jax.devices()
    tps = [tp for tp in args.tp if tp <= len(devices)]
    print(
        f"MoE layer: hidden {hidden}, {args.experts} experts of width {width}, top {args.top_k}, {args.dtype}; "
        f"{len(devices)} {devices[0].platform} devices ({devices[0].device_kind}), {os.cpu_count()} CPUs; "
        f"jax {jax.__version__}; median of {args.repeats}",
        file=sys.stderr,
    )
    print("| tp | tokens | one device ms | tensor-parallel experts ms | expert parallel ms | EP / TP |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tp in tps:
        for tokens in args.tokens:
            layouts = [(1, False), (tp, False), (tp, True)]
            calls = [build_layer(mlp, hidden, tokens, size, expert, args) for size, expert in layouts]
            one, tensor, expert = time_interleaved(calls, args.repeats)
            print(
                f"| {tp} | {tokens} | {1e3 * one:.2f} | {1e3 * tensor:.2f} | {1e3 * expert:.2f} | "
                f"{expert / tensor:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

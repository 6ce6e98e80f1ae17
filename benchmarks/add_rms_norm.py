"""The fused residual add + RMSNorm kernel against the XLA pair it replaces (x + delta, then rms_norm), at the
8B model's D=4096 in bfloat16, from one decode row to a long prefill chunk.

    python benchmarks/add_rms_norm.py                      # an H200: the table below
    python benchmarks/add_rms_norm.py --sweep              # and the kernel's tilings per size
    python benchmarks/add_rms_norm.py --interpret --rows 1 33  # a CPU smoke run (timings meaningless)

Times are µs per application, from a chain of `--chain` applications in one jit with an optimization barrier
between them (each application's outputs feed the next, so neither side fuses across applications and the
host's dispatch is spread over the chain): launch gaps included, as inside a model step. Columns:
  - XLA µs, kernel µs: the jitted pair and the kernel;
  - max |kernel - XLA|, ≠ XLA: the largest difference and the count of values that differ from the jitted
    pair as XLA compiles it by default (xla_allow_excess_precision may keep intermediates in float32);
  - ≠ as written: values that differ from the pair compiled with excess precision off, which rounds where the
    code rounds (bf16 sum, bf16 normed rows before the weight); the kernel's numerics. Expect 0, or a few
    values one bf16 ulp apart where the float32 sums of squares, reduced in another order, round across a
    bf16 rounding boundary. (With --interpret XLA compiles the kernel too, with its default precision: there
    it matches the default pair instead.)
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from common import timed_ms

from jaxserve import kernels as pk
from jaxserve.kernels.add_rms_norm import default_block_rows, default_num_warps

EPS = 1e-5
AS_WRITTEN = {"xla_allow_excess_precision": False}


def chained(op, length: int):
    """`length` applications of op in one jit: (x, delta) -> (normed, residual), a barrier between each."""

    def run(x, delta, weight):
        for _ in range(length):
            residual, normed = op(x, delta, weight)
            x, delta = jax.lax.optimization_barrier((normed, residual))
        return x, delta

    return jax.jit(run)


def inputs(rows: int, dim: int, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    k1, k2, k3 = jax.random.split(jax.random.key(rows), 3)
    x = jax.random.normal(k1, (rows, dim), jnp.float32).astype(dtype)
    delta = jax.random.normal(k2, (rows, dim), jnp.float32).astype(dtype)
    return x, delta, (1.0 + 0.1 * jax.random.normal(k3, (dim,), jnp.float32)).astype(dtype)


def differences(got: jax.Array, want: jax.Array) -> tuple[float, int]:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max()), int((got != want).sum())


def kernel_us(rows: int, args: argparse.Namespace, **tiling) -> float:
    kernel = functools.partial(pk.add_rms_norm, eps=EPS, interpret=args.interpret, **tiling)
    return timed_ms(chained(kernel, args.chain), *inputs(rows, args.dim, jnp.dtype(args.dtype))) * 1e3 / args.chain


def measure(rows: int, args: argparse.Namespace) -> dict:
    x, delta, weight = inputs(rows, args.dim, jnp.dtype(args.dtype))
    xla = functools.partial(pk.add_rms_norm_reference, eps=EPS)
    got = jax.jit(functools.partial(pk.add_rms_norm, eps=EPS, interpret=args.interpret))(x, delta, weight)
    default = jax.jit(xla)(x, delta, weight)
    as_written = jax.jit(xla).lower(x, delta, weight).compile(compiler_options=AS_WRITTEN)(x, delta, weight)
    if not np.array_equal(np.asarray(got[0]), np.asarray(as_written[0])):
        raise AssertionError(f"rows={rows}: the kernel's residual differs from x + delta")
    max_diff, differ = differences(got[1], default[1])
    return dict(
        xla_us=timed_ms(chained(xla, args.chain), x, delta, weight) * 1e3 / args.chain,
        kernel_us=kernel_us(rows, args),
        max_diff=max_diff,
        differ=differ,
        differ_as_written=differences(got[1], as_written[1])[1],
    )


def sweep(rows: int, args: argparse.Namespace) -> None:
    """Every (block_rows, num_warps) that keeps a tile within 16384 values, fastest first."""
    dim_padded = 1 << (args.dim - 1).bit_length()
    times = []
    for block_rows, num_warps in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)):
        if block_rows * dim_padded <= 16384 and block_rows <= max(rows, 1):
            times.append((kernel_us(rows, args, block_rows=block_rows, num_warps=num_warps), block_rows, num_warps))
    best = ", ".join(f"{us:.2f} µs ({b} rows, {w} warps)" for us, b, w in sorted(times)[:4])
    print(f"  rows {rows}: {best}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256, 1024, 8192])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--chain", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's tilings per size")
    parser.add_argument("--interpret", action="store_true", help="interpret the kernel (no GPU: a smoke run)")
    args = parser.parse_args()
    block_rows = default_block_rows(args.dim)
    tiling = f"{block_rows} rows a program, {default_num_warps(block_rows, args.dim)} warps"
    print(f"{jax.devices()[0].device_kind}, D={args.dim} {args.dtype}, kernel: {tiling}, chains of {args.chain}")
    header = f"{'rows':>6} {'XLA µs':>8} {'kernel µs':>10} {'max |kernel - XLA|':>19} {'≠ XLA':>8} {'≠ as written':>13}"
    print(header)
    for rows in args.rows:
        r = measure(rows, args)
        print(
            f"{rows:>6} {r['xla_us']:>8.2f} {r['kernel_us']:>10.2f} {r['max_diff']:>19.3g} {r['differ']:>8} "
            f"{r['differ_as_written']:>13}"
        )
    if args.sweep:
        print("fastest kernel tilings:")
        for rows in args.rows:
            sweep(rows, args)


if __name__ == "__main__":
    main()

"""Which ops make a compiled call block the host until the device gets there (run on the GPU).

    python benchmarks/dispatch_sync.py [--matmuls 100 --size 4096]

The engine's step call returns only when its step is done (docs/benchmarks.md, third 8B run), so the
host cannot prepare step N+1 while the device runs step N. Each variant below is a jitted function with
the same device work (a chain of bf16 matmuls, ~20 ms on an H200 at the defaults) plus one feature of
the engine's step. For each: the time the call takes to return (dispatch) and the time until its result
is ready, median of 10. An asynchronous call returns in well under a millisecond; a call that reads a
device value on the host returns only once the device reaches that op.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def make_variants(n: int, size: int):
    key = jax.random.key(0)
    w = jax.random.normal(key, (n, size, size), jnp.bfloat16) * (size**-0.5)
    x = jax.random.normal(jax.random.key(1), (size, size), jnp.bfloat16)

    def chain(x, w):
        for i in range(w.shape[0]):
            x = x @ w[i]
        return x

    def scanned(x, w):
        return lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    def end_cond(x, w, flag):
        y = chain(x, w)
        return lax.cond(flag, lambda y: y * 2, lambda y: y, y)

    def start_cond(x, w, flag):
        x = lax.cond(flag, lambda x: x * 2, lambda x: x, x)
        return chain(x, w)

    def end_select(x, w, flag):  # the same result without a conditional
        y = chain(x, w)
        return jnp.where(flag, y * 2, y)

    def dynamic_while(x, w, flag):
        y = chain(x, w)
        return lax.while_loop(lambda c: c[1] < jnp.where(flag, 3, 1), lambda c: (c[0] * 2, c[1] + 1), (y, 0))[0]

    flag = jnp.bool_(False)
    host_x = np.asarray(x)
    return (
        {
            "chain (baseline)": (jax.jit(chain), (x, w)),
            "scan over stacked weights": (jax.jit(scanned), (x, w)),
            "lax.cond at the end": (jax.jit(end_cond), (x, w, flag)),
            "lax.cond at the start": (jax.jit(start_cond), (x, w, flag)),
            "jnp.where instead of the cond": (jax.jit(end_select), (x, w, flag)),
            "while_loop, data-dependent trip count": (jax.jit(dynamic_while), (x, w, flag)),
            "numpy input (host-to-device in the call)": (jax.jit(chain), (host_x, w)),
            "donated input": (jax.jit(chain, donate_argnums=(0,)), None),
        },
        x,
        w,
    )


def measure(fn, args_fn, reps: int = 10) -> tuple[float, float]:
    jax.block_until_ready(fn(*args_fn()))
    dispatch, total = [], []
    for _ in range(reps):
        args = args_fn()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        out = fn(*args)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        dispatch.append(t1 - t0)
        total.append(t2 - t0)
    return statistics.median(dispatch) * 1e3, statistics.median(total) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matmuls", type=int, default=100)
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args()
    variants, x, w = make_variants(args.matmuls, args.size)
    print(f"{jax.devices()[0].device_kind}: {args.matmuls} matmuls of {args.size}^2 bf16 per call")
    print(f"{'variant':44s} {'dispatch ms':>12s} {'ready ms':>10s}")
    for name, (fn, fixed) in variants.items():
        args_fn = (lambda: (x + 0, w)) if fixed is None else (lambda fixed=fixed: fixed)
        d, t = measure(fn, args_fn)
        print(f"{name:44s} {d:12.3f} {t:10.3f}", flush=True)


if __name__ == "__main__":
    main()

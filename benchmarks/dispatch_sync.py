"""Which ops make a compiled call block the host until the device gets there (run on the GPU).

    python benchmarks/dispatch_sync.py [--matmuls 100 --size 4096]

The engine's step call returns only when its step is done (docs/benchmarks.md, third 8B run), so the
host cannot prepare step N+1 while the device runs step N. Each variant below is a jitted function with
the same device work (a chain of bf16 matmuls, ~20 ms on an H200 at the defaults) plus one feature of
the engine's step. For each: the time the call takes to return (dispatch) and the time until its result
is ready, median of 10. An asynchronous call returns in well under a millisecond; a call that reads a
device value on the host returns only once the device reaches that op. Then a small call made while
the chain runs, with its inputs on the device, as numpy arrays, or put on the device first.
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

    def heavy_cond(x, w, flag):  # branches XLA cannot turn into a select (a cheap cond becomes one)
        y = chain(x, w)
        return lax.cond(flag, lambda y: jnp.sort(y @ w[0], axis=-1), lambda y: jnp.sort(y, axis=-1), y)

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
            "lax.cond with heavy branches at the end": (jax.jit(heavy_cond), (x, w, flag)),
            "while_loop, data-dependent trip count": (jax.jit(dynamic_while), (x, w, flag)),
            "numpy input (host-to-device in the call)": (jax.jit(chain), (host_x, w)),
            "donated input": (jax.jit(chain, donate_argnames=("x",)), None),
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


def back_to_back(busy, busy_args, reps: int = 10) -> dict[str, float]:
    """Dispatch time of a small call made while `busy` runs, by how its 8 small int32 inputs arrive.

    The engine calls step N+1 while step N runs, with inputs prepared on the host as numpy arrays and
    the previous step's (device) output; here the previous output is `busy`'s and the inputs are 8
    arrays of 256 int32, like the step's token ids, positions and tables."""
    small = jax.jit(lambda prev, *xs: prev[0, :8].astype(jnp.float32).sum() + sum(x.sum() for x in xs))
    host = [np.arange(256, dtype=np.int32) + i for i in range(8)]
    on_device = [jnp.asarray(h) for h in host]
    ways = {
        "device arrays": lambda: on_device,
        "numpy arrays": lambda: [h.copy() for h in host],
        "numpy arrays, jax.device_put first": lambda: jax.device_put([h.copy() for h in host]),
    }
    jax.block_until_ready(small(busy(*busy_args), *on_device))
    result = {}
    for name, inputs in ways.items():
        times = []
        for _ in range(reps):
            prev = busy(*busy_args)
            t0 = time.perf_counter()
            out = small(prev, *inputs())
            times.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        result[name] = statistics.median(times) * 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matmuls", type=int, default=100)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--only", default=None, help="comma-separated substrings of the variants to run")
    args = parser.parse_args()
    variants, x, w = make_variants(args.matmuls, args.size)
    print(f"{jax.devices()[0].device_kind}: {args.matmuls} matmuls of {args.size}^2 bf16 per call")
    print(f"{'variant':44s} {'dispatch ms':>12s} {'ready ms':>10s}")
    for name, (fn, fixed) in variants.items():
        if args.only and not any(o in name for o in args.only.split(",")):
            continue
        args_fn = (lambda: (x + 0, w)) if fixed is None else (lambda fixed=fixed: fixed)
        d, t = measure(fn, args_fn)
        print(f"{name:44s} {d:12.3f} {t:10.3f}", flush=True)
    chain_fn, chain_args = variants["chain (baseline)"]
    print("\na small call made while the chain runs: its dispatch time by how its inputs arrive")
    for name, ms in back_to_back(chain_fn, chain_args).items():
        print(f"{name:44s} {ms:12.3f}", flush=True)


if __name__ == "__main__":
    main()

"""rope_write_kv against the XLA ops it replaces, on one NVIDIA GPU: the Llama-3.1-8B layer shape (8 kv heads,
4 query heads each, head_dim 128, bfloat16, llama3 rope) over a pool of 4096 blocks of 16.

    python benchmarks/rope_write_kv.py [--tokens 1,32,256,1024,8192] [--sweep]

old: what a layer ran before: q, k and v sliced out of qkv, `apply_rope` on q and on k (XLA fusions), then
the Pallas `write_kv`. new: one `rope_write_kv`. Both are jitted with the caches donated. Times are device
throughput by wall clock: one jit runs `reps` steps back to back (each on its own qkv, the caches threaded
from step to step as a layer's are), its wall time divided by `reps`; median of three such runs. Before
timing, both run once on the same inputs: max |new - old| over q and over the written K and V slots (in
float32 units; 0 means bit-equal; old is the reference computation, `rope_write_kv_reference` with the
Pallas write). --sweep also times every (block_t, num_warps) and prints the best, for the defaults in
jaxserve/kernels/rope_write_kv.py.

Prints one table row per token count; exits 1 if any row failed (its error is printed in the row).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from common import LLAMA_3_1_8B, timed_ms

from jaxserve import kernels as pk
from jaxserve.kernels.rope_write_kv import default_block_t, default_num_warps
from jaxserve.models import registry
from jaxserve.models.common import apply_rope, rope_frequencies, split_qkv

K, G, DH = 8, 4, 128
NUM_BLOCKS, BLOCK_SIZE = 4096, 16
DTYPE = jnp.bfloat16
_, CFG = registry.resolve(LLAMA_3_1_8B)


def old_step(k_cache, v_cache, qkv, cos, sin, slots):
    q, k, v = split_qkv(qkv)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = pk.write_kv(k_cache, v_cache, k, v, slots)
    return q, k_cache, v_cache


def new_step(k_cache, v_cache, qkv, cos, sin, slots, **tiling):
    return pk.rope_write_kv(k_cache, v_cache, qkv, cos, sin, slots, **tiling)


def repeated(step):
    """`reps` steps in one jit (reps = len(qkvs)), the caches donated and threaded through."""

    def run(k_cache, v_cache, qkvs, cos, sin, slots):
        qs = []
        for qkv in qkvs:
            q, k_cache, v_cache = step(k_cache, v_cache, qkv, cos, sin, slots)
            qs.append(q)
        return qs, k_cache, v_cache

    return jax.jit(run, donate_argnames=("k_cache", "v_cache"))


def inputs(num_tokens: int, reps: int, seed: int):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), reps + 2)
    shape = (NUM_BLOCKS, BLOCK_SIZE, K, DH)
    caches = [jax.random.normal(key, shape, DTYPE) for key in keys[:2]]
    qkvs = tuple(jax.random.normal(key, (num_tokens, K, G + 2, DH), DTYPE) for key in keys[2:])
    positions = jnp.asarray(rng.integers(0, 8192, num_tokens), jnp.int32)
    cos, sin = rope_frequencies(CFG.rope, DH, positions)
    slots = rng.choice(np.arange(BLOCK_SIZE, NUM_BLOCKS * BLOCK_SIZE), num_tokens, replace=False)
    return caches, qkvs, cos, sin, jnp.asarray(slots, jnp.int32)


def time_us(step, caches, qkvs, cos, sin, slots) -> float:
    fn = repeated(step)
    state = {"caches": [jnp.copy(c) for c in caches]}

    def call():
        qs, *state["caches"] = fn(*state["caches"], qkvs, cos, sin, slots)
        return qs[-1]

    runs = [timed_ms(call, reps=10) for _ in range(3)]
    return statistics.median(runs) * 1e3 / len(qkvs)


def max_difference(caches, qkv, cos, sin, slots, tiling) -> tuple[float, float]:
    """max |new - old| over q and over the written K and V rows."""
    outs = []
    for step in (old_step, lambda *a: new_step(*a, **tiling)):
        fn = jax.jit(step, donate_argnames=())
        outs.append(fn(*[jnp.copy(c) for c in caches], qkv, cos, sin, slots))
    (q_old, k_old, v_old), (q_new, k_new, v_new) = outs

    def diff(a, b) -> float:
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    rows = (-1, K, DH)
    written = max(diff(a.reshape(rows)[slots], b.reshape(rows)[slots]) for a, b in ((k_old, k_new), (v_old, v_new)))
    return diff(q_old, q_new), written


def sweep(num_tokens: int, caches, qkvs, cos, sin, slots) -> str:
    results = {}
    block_ts = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(1, 2 * num_tokens)]
    for block_t in block_ts:
        for num_warps in (1, 2, 4, 8):
            tiling = dict(block_t=block_t, num_warps=num_warps)
            step = lambda *a, tiling=tiling: new_step(*a, **tiling)  # noqa: E731
            results[(block_t, num_warps)] = time_us(step, caches, qkvs, cos, sin, slots)
    ranked = sorted(results.items(), key=lambda item: item[1])
    return "  ".join(f"bt={b} w={w}: {us:.2f}" for (b, w), us in ranked[:4])


def reps_for(num_tokens: int) -> int:
    return 64 if num_tokens <= 1024 else 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,256,1024,8192")
    parser.add_argument("--sweep", action="store_true", help="also time every (block_t, num_warps)")
    args = parser.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"needs an NVIDIA GPU; jax sees {device.platform} ({device.device_kind})", file=sys.stderr)
        return 2
    shape = f"K={K} G={G} Dh={DH} {jnp.dtype(DTYPE).name}, pool {NUM_BLOCKS} x {BLOCK_SIZE}"
    print(f"{device.device_kind}, jax {jax.__version__}; {shape}")
    print("times: µs per step (device throughput); |d|: max |new - old| in float32 units (0: bit-equal)\n")
    header = f"{'T':>6} {'old µs':>9} {'new µs':>9} {'speedup':>8} {'|dq| max':>9} {'|dkv| max':>9}  new tiling"
    print(header)
    print("-" * len(header))
    failed = False
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        try:
            caches, qkvs, cos, sin, slots = inputs(num_tokens, reps_for(num_tokens), seed=num_tokens)
            block_t = default_block_t(num_tokens)
            tiling = dict(block_t=block_t, num_warps=default_num_warps(block_t, G, DH))
            dq, dkv = max_difference(caches, qkvs[0], cos, sin, slots, tiling)
            old = time_us(old_step, caches, qkvs, cos, sin, slots)
            new = time_us(new_step, caches, qkvs, cos, sin, slots)
            tiles = f"bt={tiling['block_t']} w={tiling['num_warps']}"
            print(f"{num_tokens:>6} {old:>9.2f} {new:>9.2f} {old / new:>7.2f}x {dq:>9.3g} {dkv:>9.3g}  {tiles}")
            if args.sweep:
                print(f"{'':>6} sweep, best first: {sweep(num_tokens, caches, qkvs, cos, sin, slots)}")
            del caches, qkvs
        except Exception as error:  # one failed shape must not hide the others' rows
            failed = True
            print(f"{num_tokens:>6} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            traceback.print_exc(file=sys.stderr)
        sys.stdout.flush()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The attention kernels compiled for the GPU (not interpret mode) against their jnp reference, for the options
the model families use: head dims 128 and 256, sliding windows, logit soft-caps, decode-only and mixed batches.

    python benchmarks/kernel_check.py [--head-dims 128,256]   # one line per case, then a JSON summary; exit 1 on
                                                              # a mismatch

Each case is a ragged batch of 8 sequences (kv lengths up to 1,500 tokens, a window of 256 below them) over a
shuffled block pool, float32 and bfloat16. q is scaled so that the logits reach about 30: a soft-cap of 20 binds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import kernels as pk


def batch(rng, head_dim: int, decode: bool, dtype, max_kv: int):
    num_kv_heads, group, block_size, num_blocks = 2, 4, 16, 1024
    kv_lens = rng.integers(1, max_kv, 8)
    q_lens = np.ones(8, int) if decode else np.minimum(rng.integers(1, 200, 8), kv_lens)
    width = int(-(-kv_lens.max() // block_size))
    blocks = rng.permutation(np.arange(1, num_blocks))[: 8 * width].reshape(8, width)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    scale = 30 / np.sqrt(head_dim) ** 0.5  # q.k of unit vectors ~ sqrt(Dh); times sm_scale Dh^-0.5 -> ~30
    q = rng.standard_normal((int(cu[-1]), num_kv_heads * group, head_dim)) * scale
    k = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim))
    v = rng.standard_normal((num_blocks, block_size, num_kv_heads, head_dim))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (cast(q), cast(k), cast(v), i32(blocks), i32(kv_lens), i32(cu), 8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="128,256", help="comma-separated head dims to check")
    head_dims = tuple(int(d) for d in parser.parse_args().head_dims.split(","))
    # A CPU has no Triton: there the kernels run in interpret mode over short sequences (a smoke run of this script).
    interpret = jax.default_backend() == "cpu"
    max_kv = 64 if interpret else 1500
    jax.config.update("jax_default_matmul_precision", "highest")  # the reference's float32 dots without TF32
    rng = np.random.default_rng(0)
    print("device", jax.devices()[0].device_kind, "jax", jax.__version__)
    failures, cases = [], 0
    for head_dim, decode, window, cap, dtype in itertools.product(
        head_dims, (True, False), (None, 256), (None, 20.0), (jnp.float32, jnp.bfloat16)
    ):
        args = batch(rng, head_dim, decode, dtype, max_kv)
        options = dict(sm_scale=head_dim**-0.5, sliding_window=window, soft_cap=cap)
        out = pk.ragged_paged_attention(*args, max_q_len=1 if decode else None, interpret=interpret, **options)
        want = pk.ragged_paged_attention_reference(*(a.astype(jnp.float32) for a in args[:3]), *args[3:], **options)
        err = float(jnp.linalg.norm(out.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        bound = 2e-5 if dtype == jnp.float32 else 2e-2
        ok = err <= bound
        cases += 1
        name = f"Dh={head_dim} {'decode' if decode else 'mixed'} window={window} cap={cap} {jnp.dtype(dtype).name}"
        print(f"{'ok  ' if ok else 'FAIL'} {name}: relative error {err:.2e} (bound {bound:g})")
        if not ok:
            failures.append(name)
    print(json.dumps({"cases": cases, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

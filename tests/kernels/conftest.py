"""Helpers for the kernel tests: random ragged paged batches and a float64 numpy attention oracle.

Exposed as session fixtures that return functions (hypothesis tests may use them):
  - `paged_batch(rng, seqs, ...) -> PagedBatch`: sequences given as (query tokens, cached tokens before
    them; (1, -1) is a padding sequence with kv_len 0), each sequence's K/V scattered into a shuffled,
    non-contiguous set of blocks of one pool.
    Every slot no sequence owns (block 0, the tail of each last block, the unused blocks) holds NaN,
    and padding rows (>= num_seqs) hold junk, so reading anything not owned shows up in the output.
  - `numpy_attention(batch, sm_scale, sliding_window, soft_cap) -> [T, H, Dh] float64`: plain dense
    softmax attention per sequence, from the unpaged K/V.
  - `rel_err(out, want) -> float`: ||out - want|| / ||want||, NaN-aware (any NaN gives inf).
  - `unoptimized_compiles` (tests/conftest.py) is a module's `pytestmark` here where an interpret-mode attention
    kernel, a large XLA program, is compiled for each test (about a third less time on a CPU); the attention
    tests compare within a tolerance, which XLA's optimisation passes do not approach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import pytest


@dataclass
class PagedBatch:
    q: np.ndarray  # [T, H, Dh] in the test dtype
    k_cache: np.ndarray  # [N, Bs, K, Dh]
    v_cache: np.ndarray
    block_table: np.ndarray  # [B, M] int32
    kv_lens: np.ndarray  # [B] int32
    cu_q_lens: np.ndarray  # [B+1] int32
    num_seqs: int
    keys: list[np.ndarray]  # per sequence [kv_len, K, Dh], the values stored in the cache
    values: list[np.ndarray]

    def args(self) -> tuple:
        arrays = (self.q, self.k_cache, self.v_cache, self.block_table, self.kv_lens, self.cu_q_lens)
        return (*(jnp.asarray(a) for a in arrays), jnp.int32(self.num_seqs))


def _make_batch(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    num_tokens: int | None = None,
    max_seqs: int | None = None,
    max_blocks: int | None = None,
    num_blocks: int | None = None,
    dtype=jnp.float32,
) -> PagedBatch:
    ns = len(seqs)
    b = max_seqs or ns
    q_lens = np.array([s[0] for s in seqs], np.int32)
    kv_lens = np.array([s[0] + s[1] for s in seqs], np.int32)
    blocks_needed = [-(-int(k) // block_size) for k in kv_lens]
    m = max_blocks or max([1, *blocks_needed])
    t = num_tokens or int(q_lens.sum())
    n = num_blocks or 1 + sum(blocks_needed) + 3  # block 0 reserved, spare blocks never used
    assert n > sum(blocks_needed), "num_blocks too small for these sequences"
    np_dtype = np.dtype(dtype)
    k_cache = np.full((n, block_size, num_kv_heads, head_dim), np.nan, np_dtype)
    v_cache = np.full_like(k_cache, np.nan)
    block_table = rng.integers(0, n, (b, m)).astype(np.int32)  # junk past each sequence's blocks
    order = rng.permutation(np.arange(1, n))
    keys, values, used = [], [], 0
    for i, (kv_len, nb) in enumerate(zip(kv_lens, blocks_needed, strict=True)):
        ids = order[used : used + nb]
        used += nb
        block_table[i, :nb] = ids
        kk = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np_dtype)
        vv = rng.standard_normal((kv_len, num_kv_heads, head_dim)).astype(np_dtype)
        for pos in range(kv_len):
            k_cache[ids[pos // block_size], pos % block_size] = kk[pos]
            v_cache[ids[pos // block_size], pos % block_size] = vv[pos]
        keys.append(kk)
        values.append(vv)
    cu = np.zeros(b + 1, np.int32)
    cu[1 : ns + 1] = np.cumsum(q_lens)
    cu[ns + 1 :] = rng.integers(0, t + 1, b - ns)  # padding rows: ignored, so junk
    lens = rng.integers(0, m * block_size + 1, b).astype(np.int32)
    lens[:ns] = kv_lens
    q = rng.standard_normal((t, num_heads, head_dim)).astype(np_dtype)
    return PagedBatch(q, k_cache, v_cache, block_table, lens, cu, ns, keys, values)


def _numpy_attention(
    batch: PagedBatch, sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None
) -> np.ndarray:
    t, h, dh = batch.q.shape
    out = np.zeros((t, h, dh))
    group = h // batch.k_cache.shape[2]
    for i in range(batch.num_seqs):
        start, stop = int(batch.cu_q_lens[i]), int(batch.cu_q_lens[i + 1])
        kv_len = int(batch.kv_lens[i])
        if kv_len == 0 or stop == start:
            continue
        q = batch.q[start:stop].astype(np.float64)  # [q, H, Dh]
        k = np.repeat(batch.keys[i].astype(np.float64), group, axis=1)  # [kv, H, Dh]
        v = np.repeat(batch.values[i].astype(np.float64), group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) * sm_scale
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        qpos = kv_len - (stop - start) + np.arange(stop - start)
        kpos = np.arange(kv_len)
        allowed = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            allowed &= kpos[None, :] > qpos[:, None] - sliding_window
        s = np.where(allowed[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[start:stop] = np.einsum("hqk,khd->qhd", p, v)
    return out


def _rel_err(out, want) -> float:
    out = np.asarray(out, np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(out - want) / max(np.linalg.norm(want), 1e-30))


@pytest.fixture(scope="session")
def paged_batch() -> Callable[..., PagedBatch]:
    return _make_batch


@pytest.fixture(scope="session")
def numpy_attention() -> Callable[..., np.ndarray]:
    return _numpy_attention


@pytest.fixture(scope="session")
def rel_err() -> Callable[..., float]:
    return _rel_err

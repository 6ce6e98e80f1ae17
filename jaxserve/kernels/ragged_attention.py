"""The mixed kernel of ragged paged attention: query tiles over the flat batch, plus zero tiles for padding.

After vLLM's Triton "unified attention": a query tile packs block_q = block_m // group consecutive tokens
of one sequence times the GQA group's query heads into its block_m rows, so each K/V tile it reads serves
the whole group. Its program finds its sequence from cu_q_lens, then walks the key tiles it needs in three
loops: tiles cut by the window's lower edge (masked), tiles every row sees in full (no mask), and tiles on
the causal diagonal (masked), with an online softmax in float32. Keys are gathered per token through the
block table, so tiles need not align with KV blocks. Zero tiles write the padding tokens' rows.

This module holds the kernel's parameters (`MixedParams`), program bodies and launch (`mixed_attention`);
the K/V gather and the online softmax of a key tile are the decode kernel's too and come from `common.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .common import AttentionInputs, and_mask, head_dims, load_kv, normalise, softmax_init, softmax_step, tile_scores
from .tuning import MixedTiling


@dataclass(frozen=True, slots=True)
class MixedParams:
    """Static parameters of one mixed-kernel launch."""

    group: int  # query heads per kv head
    block_m: int
    block_n: int
    head_dim: int
    head_dim_padded: int  # next power of two; loads and stores mask the padding
    block_size: int
    num_tokens: int  # T
    max_seqs: int  # B
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    skip_single: bool  # leave sequences of one query token to the decode kernel
    approx_exp2: bool = False  # set for GPU launches: see common.exp2

    @property
    def block_q(self) -> int:
        return self.block_m // self.group

    @property
    def num_q_blocks(self) -> int:
        # Sequence b's tiles start at cu_q_lens[b] // block_q + b, so this many cover any batch.
        return self.num_tokens // self.block_q + self.max_seqs

    @property
    def num_zero_tiles(self) -> int:
        return -(-self.num_tokens // self.block_q)

    @property
    def seqs_padded(self) -> int:
        return 1 << self.max_seqs.bit_length()  # a power of two > B


def _find_sequence(cu_ref, ns_ref, q_block: jax.Array, p: MixedParams):
    """Sequence owning query tile `q_block`: the last b < num_seqs whose first tile is <= it."""
    num_seqs = ns_ref[0]
    b = jnp.arange(p.seqs_padded, dtype=jnp.int32)
    live = b < num_seqs
    cu = plgpu.load(cu_ref.at[jnp.minimum(b, p.max_seqs)], mask=live, other=0)
    first_tile = lax.div(cu, p.block_q) + b
    seq = jnp.sum(jnp.where(live & (first_tile <= q_block), 1, 0)) - 1
    found = seq >= 0
    seq = jnp.maximum(seq, 0)
    q_start = cu_ref[seq]
    local = q_block - (lax.div(q_start, p.block_q) + seq)
    return found, seq, q_start, local


def _tile_step(t, carry, *, r: AttentionInputs, q, seq, h, kv_len, qpos, p: MixedParams, masked: bool):
    """One key tile of the online softmax; `masked` tiles apply the causal/window/length mask."""
    dims = head_dims(p)
    j = t * p.block_n + jnp.arange(p.block_n, dtype=jnp.int32)
    in_range = j < kv_len
    keys_ok = in_range if masked else None
    page = plgpu.load(r.block_table.at[seq, lax.div(j, p.block_size)], mask=keys_ok, other=0 if masked else None)
    k, v = load_kv(r, page, j, h, keys_ok, dims, p)
    s, c = tile_scores(q, k, p)
    if masked:
        allowed = (j[None, :] <= qpos[:, None]) & in_range[None, :]
        if p.sliding_window is not None:
            allowed &= j[None, :] > qpos[:, None] - p.sliding_window
        s = jnp.where(allowed, s, -jnp.inf)
    return softmax_step(carry, s, c, v, p, masked=masked)


def _key_tile_ranges(ctx, q_lo, q_hi, kv_len, p: MixedParams):
    """[lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked key-tile ranges."""
    bn = p.block_n
    hi_key = jnp.minimum(ctx + q_hi + 1, kv_len)
    lo_key = 0 if p.sliding_window is None else jnp.maximum(ctx + q_lo - p.sliding_window + 1, 0)
    lo = lax.div(lo_key, bn)
    hi = lax.div(hi_key + bn - 1, bn)
    # A tile needs no mask when every row sees all of it: its last key <= the first row's position
    # and its first key inside the last row's window.
    full_hi = lax.div(ctx + q_lo + 1, bn)
    full_lo = 0 if p.sliding_window is None else lax.div(jnp.maximum(ctx + q_hi - p.sliding_window + 1, 0) + bn - 1, bn)
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def _tile_rows(first: jax.Array, h: jax.Array, p: MixedParams):
    """Rows of a query tile: token (relative to `first`) and query head of each of the block_m rows."""
    rows = jnp.arange(p.block_m, dtype=jnp.int32)
    tok = first + lax.div(rows, p.group)
    head = h * p.group + lax.rem(rows, p.group)
    return rows < p.block_q * p.group, tok, head


def mixed_tile(r: AttentionInputs, o_ref, q_block: jax.Array, h: jax.Array, p: MixedParams) -> None:
    """Program body for query tile `q_block` of kv head h: attention of its rows, written to o_ref."""
    found, seq, q_start, local = _find_sequence(r.cu_q_lens, r.num_seqs, q_block, p)
    q_len = r.cu_q_lens[seq + 1] - q_start
    kv_len = r.kv_lens[seq]
    active = found & (local * p.block_q < q_len)
    if p.skip_single:
        active &= q_len > 1

    # Sequences with kv_len 0 (padding) run no key tile and write zeros.
    @pl.when(active)
    def _():
        d, dmask = head_dims(p)
        in_tile, tok_local, head = _tile_rows(local * p.block_q, h, p)
        row_ok = in_tile & (tok_local < q_len)
        tok = jnp.where(row_ok, q_start + tok_local, p.num_tokens)
        idx = (tok[:, None], head[:, None], d[None, :])
        q = plgpu.load(r.q.at[idx], mask=and_mask(row_ok[:, None], dmask), other=0.0)
        ctx = kv_len - q_len
        q_lo = local * p.block_q
        q_hi = jnp.minimum(q_lo + p.block_q, q_len) - 1
        lo, full_lo, full_hi, hi = _key_tile_ranges(ctx, q_lo, q_hi, kv_len, p)
        step = functools.partial(_tile_step, r=r, q=q, seq=seq, h=h, kv_len=kv_len, qpos=ctx + tok_local, p=p)
        carry = softmax_init(p.block_m, p)
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        acc, _, l_i = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
        out = normalise(acc, l_i)
        plgpu.store(o_ref.at[idx], out.astype(o_ref.dtype), mask=and_mask(row_ok[:, None], dmask))


def zero_tile(r: AttentionInputs, o_ref, z: jax.Array, h: jax.Array, p: MixedParams) -> None:
    """Program body writing zeros to the padding tokens (from cu_q_lens[num_seqs] on) of token tile z."""
    d, dmask = head_dims(p)
    in_tile, tok, head = _tile_rows(z * p.block_q, h, p)
    pad = in_tile & (tok >= r.cu_q_lens[r.num_seqs[0]]) & (tok < p.num_tokens)
    tok = jnp.where(pad, tok, p.num_tokens)
    zeros = jnp.zeros((p.block_m, p.head_dim_padded), o_ref.dtype)
    plgpu.store(o_ref.at[tok[:, None], head[:, None], d[None, :]], zeros, mask=and_mask(pad[:, None], dmask))


def _mixed_kernel(*refs, p: MixedParams):
    r, (o_ref,) = AttentionInputs.split_refs(refs)
    i, h = pl.program_id(0), pl.program_id(1)

    @pl.when(i < p.num_q_blocks)
    def _():
        # Heaviest (latest) query tiles first: causal work grows along a sequence.
        mixed_tile(r, o_ref, p.num_q_blocks - 1 - i, h, p)

    @pl.when(i >= p.num_q_blocks)
    def _():
        zero_tile(r, o_ref, i - p.num_q_blocks, h, p)


def mixed_attention(inputs: AttentionInputs, p: MixedParams, tiling: MixedTiling, *, interpret: bool) -> jax.Array:
    """Launch grid (query tiles + zero tiles, kv heads); returns [T, H, Dh] with every row written except
    those of one-token sequences when `p.skip_single` (the decode kernel writes those in place)."""
    p = dataclasses.replace(p, approx_exp2=not interpret)
    return pl.pallas_call(
        functools.partial(_mixed_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype),
        grid=(p.num_q_blocks + p.num_zero_tiles, inputs.k_cache.shape[2]),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_mixed",
    )(*inputs)

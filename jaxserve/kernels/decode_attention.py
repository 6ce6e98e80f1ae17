"""The split-KV (flash-decoding) kernel for sequences with one query token, and the kernel combining splits.

Grid (B, K, num_splits): a program reads one share of one sequence's keys for one kv head, with all
query heads of that kv head in one tile (the group padded to the 16-row minimum of a matrix-unit dot),
so every K/V block is read once per kv head. Each sequence's key tiles are divided evenly among its
num_splits programs, so a short sequence in a batch sized for long ones gets short splits. When every
split holds at most one key tile (and there is no window), split s reads tile s and loads its page ids
without waiting for kv_len (`DecodeParams.eager_pages`). With one split the program normalises and
writes its output rows directly; otherwise it writes per-split partial outputs and log2-sum-exp values
that `_combine_kernel` (grid (B, H)) merges into the output rows, in place on `out`. In a decode-only
launch (`max_q_len=1`) there is no `out` yet: the last launch creates the output and also writes the
padding tokens' zero rows.

This module holds the two kernels' parameters (`DecodeParams`), program bodies and launches
(`decode_attention`); the K/V gather and the online softmax of a key tile are the mixed kernel's too
and come from `common.py`.
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

from .common import (
    AttentionInputs,
    and_mask,
    exp2,
    exp2_scale,
    head_dims,
    load_kv,
    normalise,
    softmax_init,
    softmax_step,
    tile_scores,
)
from .tuning import DecodeTiling


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """Static parameters of one decode launch."""

    group: int
    block_n: int
    head_dim: int
    head_dim_padded: int
    block_size: int
    num_heads: int
    num_splits: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    num_tokens: int  # T
    decode_only: bool  # no mixed launch before this one: also zero the padding tokens' rows
    context: int  # the block table's width in tokens (M * block_size)
    allow_eager_pages: bool = True  # a tuning switch (decode_eager_pages), for measuring `eager_pages`
    approx_exp2: bool = False  # set for GPU launches: see common.exp2

    @property
    def eager_pages(self) -> bool:
        """Every split holds at most one key tile, at a position kv_len does not move (no window)."""
        return self.allow_eager_pages and self.sliding_window is None and self.num_splits * self.block_n >= self.context

    @property
    def group_padded(self) -> int:
        return max(16, 1 << (self.group - 1).bit_length())


def _sequence(b, cu_ref, kv_lens_ref, ns_ref):
    """Query row, kv length and whether sequence b is a live one-token sequence (its row is ours to write)."""
    q_start = cu_ref[b]
    live = (b < ns_ref[0]) & (cu_ref[b + 1] - q_start == 1)
    return q_start, kv_lens_ref[b], live


def _heads(h, p: DecodeParams):
    rows = jnp.arange(p.group_padded, dtype=jnp.int32)
    row_ok = rows < p.group
    # Padding rows index one past the last head: masked on GPU, dropped by the interpreter's scatter.
    return jnp.where(row_ok, h * p.group + rows, p.num_heads), row_ok


def _decode_step(t, carry, *, r: AttentionInputs, q, seq, h, lo_key, kv_len, p: DecodeParams):
    """Key tile t: its page ids through the block table, then the tile (`_decode_tile`)."""
    j = t * p.block_n + jnp.arange(p.block_n, dtype=jnp.int32)
    visible = (j < kv_len) & (j >= lo_key)
    page = plgpu.load(r.block_table.at[seq, lax.div(j, p.block_size)], mask=visible, other=0)
    return _decode_tile(j, page, visible, carry, r=r, q=q, h=h, p=p)


def _decode_tile(j, page, visible, carry, *, r: AttentionInputs, q, h, p: DecodeParams):
    """One key tile (keys j, their pages) of the online softmax of the group's query rows."""
    k, v = load_kv(r, page, j, h, visible, head_dims(p), p)
    s, c = tile_scores(q, k, p)
    s = jnp.where(visible[None, :], s, -jnp.inf)
    return softmax_step(carry, s, c, v, p, masked=True)


def decode_split(r: AttentionInputs, outs: tuple, b, h, split, p: DecodeParams) -> None:
    """Program body for split `split` of sequence b, kv head h; `outs` = (o_ref,) with one split, else the
    (o_part, lse) refs."""
    q_start, kv_len, live = _sequence(b, r.cu_q_lens, r.kv_lens, r.num_seqs)
    # Sequences that are not ours, and padding ones (kv_len 0), run no key tile.
    hi_key = jnp.where(live, kv_len, 0)
    d, dmask = head_dims(p)
    head, row_ok = _heads(h, p)
    mask = and_mask((row_ok & live)[:, None], dmask)
    q = plgpu.load(r.q.at[q_start, head[:, None], d[None, :]], mask=mask, other=0.0)
    carry = softmax_init(p.group_padded, p)
    if p.eager_pages:
        # One key tile per split, no window: split s reads tile s whatever kv_len is (the even division
        # below gives the same), so its page ids load without waiting for kv_len: one memory round trip
        # fewer before the K/V loads.
        j = split * p.block_n + jnp.arange(p.block_n, dtype=jnp.int32)
        page = plgpu.load(r.block_table.at[b, lax.div(j, p.block_size)], mask=j < p.context, other=0)
        acc, m_i, l_i = _decode_tile(j, page, j < hi_key, carry, r=r, q=q, h=h, p=p)
    else:
        lo_key = 0 if p.sliding_window is None else jnp.maximum(hi_key - p.sliding_window, 0)
        first = lax.div(lo_key, p.block_n)
        last = lax.div(hi_key + p.block_n - 1, p.block_n)
        per_split = lax.div(jnp.maximum(last - first, 0) + p.num_splits - 1, p.num_splits)
        start = first + split * per_split
        stop = jnp.minimum(start + per_split, last)
        step = functools.partial(_decode_step, r=r, q=q, seq=b, h=h, lo_key=lo_key, kv_len=kv_len, p=p)
        acc, m_i, l_i = lax.fori_loop(start, stop, step, carry)
    out = normalise(acc, l_i)
    if p.num_splits == 1:
        [o_ref] = outs
        plgpu.store(o_ref.at[q_start, head[:, None], d[None, :]], out.astype(o_ref.dtype), mask=mask)
    else:
        o_part_ref, lse_ref = outs
        # Log2-sum-exp of the scaled logits: the running max is in `tile_scores` units.
        c = exp2_scale(p)
        lse = jnp.where(l_i > 0, m_i * c + jnp.log2(jnp.where(l_i > 0, l_i, 1.0)), -jnp.inf)
        plgpu.store(o_part_ref.at[b, split, head[:, None], d[None, :]], out, mask=and_mask(row_ok[:, None], dmask))
        plgpu.store(lse_ref.at[b, split, head], lse, mask=row_ok)


# Splits merged per iteration of the combine loop, read with one 2-D load ([splits, head_dim]).
COMBINE_CHUNK = 64


def _combine_kernel(o_part_ref, lse_ref, cu_ref, kv_lens_ref, ns_ref, *outs, p: DecodeParams):
    """Merge the splits of one (sequence, query head) by their log2-sum-exp weights.

    Up to COMBINE_CHUNK splits the program is straight-line: one load of every split's lse and one 2-D
    load of their partial outputs, issued together with the sequence's scalars, so it pays one memory
    round trip before its store (the split kernel writes every row's partials, zeros and -inf for rows
    that are not its own, so nothing waits on `live`; a loop over splits costs one round trip per
    split, docs/kernels.md). More splits run chunks with an online rescale.
    """
    o_ref = outs[-1]
    b, head = pl.program_id(0), pl.program_id(1)
    d, dmask = head_dims(p, flat=True)  # [Dh]: the stores are 1-D
    chunk = min(COMBINE_CHUNK, p.num_splits)
    part_mask = None if dmask is None else jnp.broadcast_to(dmask[None, :], (chunk, p.head_dim_padded))

    def merge(i, carry):
        acc, m, den = carry
        split = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        lse = plgpu.load(lse_ref.at[b, split, head])
        other = None if part_mask is None else 0.0
        part = plgpu.load(o_part_ref.at[b, split[:, None], head, d[None, :]], mask=part_mask, other=other)
        m_new = jnp.maximum(m, jnp.max(lse))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        w = exp2(lse - m_safe, p.approx_exp2)
        return acc * alpha + jnp.sum(w[:, None] * part, axis=0), m_new, den * alpha + jnp.sum(w)

    carry = (jnp.zeros((p.head_dim_padded,), jnp.float32), jnp.float32(-jnp.inf), jnp.float32(0.0))
    if p.num_splits == chunk:
        acc, _, den = merge(0, carry)
    else:
        acc, _, den = lax.fori_loop(0, p.num_splits // chunk, merge, carry)
    q_start, _, live = _sequence(b, cu_ref, kv_lens_ref, ns_ref)
    out = acc / jnp.where(den > 0, den, 1.0)
    plgpu.store(o_ref.at[q_start, head, d], out.astype(o_ref.dtype), mask=and_mask(jnp.full(d.shape, live), dmask))
    if p.decode_only:
        pad, row = _padding_row(b, cu_ref, ns_ref, p)
        zeros = jnp.zeros((p.head_dim_padded,), o_ref.dtype)
        plgpu.store(o_ref.at[row, head, d], zeros, mask=and_mask(jnp.full(d.shape, pad), dmask))


def _padding_row(b, cu_ref, ns_ref, p: DecodeParams) -> tuple[jax.Array, jax.Array]:
    """Decode-only launches own the whole output: program b zeroes token row b when it is padding.

    With every live sequence one token long, tokens are numbered like sequences (cu_q_lens[b] = b), so the
    padding tokens cu_q_lens[num_seqs] .. T-1 are rows b of the programs b >= cu_q_lens[num_seqs].
    Returns whether row b is padding and the row to store to: b, or T (one past the end) for b >= T.
    """
    pad = (b >= cu_ref[ns_ref[0]]) & (b < p.num_tokens)
    return pad, jnp.minimum(b, p.num_tokens)


def _decode_kernel(*refs, p: DecodeParams):
    r, outs = AttentionInputs.split_refs(refs)
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if p.num_splits == 1:
        o_ref = outs[-1]  # the output ref (after the aliased input ref when the mixed kernel ran first)
        decode_split(r, (o_ref,), b, h, split, p)
        if p.decode_only:
            head, row_ok = _heads(h, p)
            d, dmask = head_dims(p)
            pad, row = _padding_row(b, r.cu_q_lens, r.num_seqs, p)
            zeros = jnp.zeros((p.group_padded, p.head_dim_padded), o_ref.dtype)
            rows = o_ref.at[row, head[:, None], d[None, :]]
            plgpu.store(rows, zeros, mask=and_mask((row_ok & pad)[:, None], dmask))
    else:
        decode_split(r, outs, b, h, split, p)


def decode_attention(
    inputs: AttentionInputs, out, p: DecodeParams, tiling: DecodeTiling, *, interpret: bool
) -> jax.Array:
    """Write the output rows of every one-token sequence into `out` (aliased, in place); with
    `p.decode_only`, `out` is None and the launch creates the output, padding rows zeroed."""
    max_seqs, num_kv_heads = inputs.block_table.shape[0], inputs.k_cache.shape[2]
    p = dataclasses.replace(p, approx_exp2=not interpret)
    params = plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    grid = (max_seqs, num_kv_heads, p.num_splits)
    out_args, aliases = ((), {}) if out is None else ((out,), {len(inputs): 0})
    kernel = functools.partial(_decode_kernel, p=p)
    out_shape = jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype)
    if p.num_splits == 1:
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            input_output_aliases=aliases,
            compiler_params=params,
            interpret=interpret,
            name="ragged_paged_attention_decode",
        )(*inputs, *out_args)
    part_shapes = (
        jax.ShapeDtypeStruct((max_seqs, p.num_splits, p.num_heads, p.head_dim_padded), jnp.float32),
        jax.ShapeDtypeStruct((max_seqs, p.num_splits, p.num_heads), jnp.float32),
    )
    o_part, lse = pl.pallas_call(
        kernel,
        out_shape=part_shapes,
        grid=grid,
        compiler_params=params,
        interpret=interpret,
        name="ragged_paged_attention_decode_split",
    )(*inputs)
    return pl.pallas_call(
        functools.partial(_combine_kernel, p=p),
        out_shape=out_shape,
        grid=(max_seqs, p.num_heads),
        input_output_aliases={} if out is None else {5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_combine",
    )(o_part, lse, inputs.cu_q_lens, inputs.kv_lens, inputs.num_seqs, *out_args)

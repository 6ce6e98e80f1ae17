"""The mixed kernel of ragged paged attention: query tiles over the flat batch, plus zero tiles for padding.

After vLLM's Triton "unified attention": a query tile packs block_q = block_m // group consecutive tokens
of one sequence times the GQA group's query heads into its block_m rows, so each K/V tile it reads serves
the whole group. Its program finds its sequence from cu_q_lens, then walks the key tiles it needs in three
loops: tiles cut by the window's lower edge (masked), tiles every row sees in full (no mask), and tiles on
the causal diagonal (masked), with an online softmax in float32. Keys are gathered per token through the
block table, so tiles need not align with KV blocks. Zero tiles write the padding tokens' rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)


# The Triton lowering turns DEFAULT precision into TF32 for float32 operands (a 1e-3 relative error);
# HIGHEST asks for IEEE float32 there and leaves bf16 / f16 operands on their native tensor-core path.
_PRECISION = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


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
    approx_exp2: bool = False  # set for GPU launches: see `exp2`

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


def _dims(p: MixedParams) -> tuple[jax.Array, jax.Array | None]:
    d = jnp.arange(p.head_dim_padded, dtype=jnp.int32)
    # The mask is [1, Dh] (full rank): the Triton lowering broadcasts masks only between equal ranks.
    return d, ((d < p.head_dim)[None, :] if p.head_dim_padded != p.head_dim else None)


def _and(mask: jax.Array, extra: jax.Array | None) -> jax.Array:
    return mask if extra is None else mask & extra


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


def _tile_step(t, carry, *, q, seq, h, kv_len, qpos, bt_ref, k_ref, v_ref, p: MixedParams, masked: bool):
    """One key tile of the online softmax; `masked` tiles apply the causal/window/length mask."""
    acc, m_i, l_i = carry
    d, dmask = _dims(p)
    j = t * p.block_n + jnp.arange(p.block_n, dtype=jnp.int32)
    in_range = j < kv_len
    page_mask = in_range if masked else None
    page = plgpu.load(bt_ref.at[seq, lax.div(j, p.block_size)], mask=page_mask, other=None if page_mask is None else 0)
    idx = (page[:, None], lax.rem(j, p.block_size)[:, None], h, d[None, :])
    kv_mask = _and(in_range[:, None], dmask) if masked else dmask
    other = None if kv_mask is None else 0.0
    k = plgpu.load(k_ref.at[idx], mask=kv_mask, other=other)
    v = plgpu.load(v_ref.at[idx], mask=kv_mask, other=other)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32)
    s, c = scores(s, p.sm_scale, p.soft_cap), exp2_scale(p.sm_scale, p.soft_cap)
    if masked:
        allowed = (j[None, :] <= qpos[:, None]) & in_range[None, :]
        if p.sliding_window is not None:
            allowed &= j[None, :] > qpos[:, None] - p.sliding_window
        s = jnp.where(allowed, s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    # A row with no visible key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
    alpha = exp2((m_i - m_safe) * c, p.approx_exp2)
    prob = exp2(s * c - (m_safe * c)[:, None], p.approx_exp2)  # one fused multiply-add per score
    l_i = l_i * alpha + jnp.sum(prob, axis=1)
    pv = lax.dot_general(
        prob.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32
    )
    return acc * alpha[:, None] + pv, m_new, l_i


def exp2(x: jax.Array, approx: bool) -> jax.Array:
    """2**x of a float32 tile. approx (GPU launches): the PTX instruction ex2.approx.ftz.f32 alone (one
    special-function op, ~2 ulp, subnormal results flushed to 0, exp2(-inf) = 0). jnp.exp2 lowers to
    libdevice's __nv_exp2f, which wraps the same instruction in subnormal range handling: several more
    instructions per score in the softmax. Interpret mode (CPU) has no PTX and uses jnp.exp2."""
    if not approx:
        return jnp.exp2(x)
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;",
        args=[x],
        constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


def exp2_scale(sm_scale: float, soft_cap: float | None) -> float:
    """c with softmax = exp2(c * (s - max s)) for the scores `scores` keeps (see there)."""
    return sm_scale * LOG2E if soft_cap is None else LOG2E


def scores(s: jax.Array, sm_scale: float, soft_cap: float | None) -> jax.Array:
    """The units the running max is kept in: raw dot products without soft-capping (sm_scale > 0 does not
    move the max, and the scale is applied inside exp2's argument as s * c - max * c, one fused
    multiply-add per score), soft-capped logits with it."""
    return s if soft_cap is None else jnp.tanh(s * (sm_scale / soft_cap)) * soft_cap


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


@dataclass(frozen=True)
class AttentionRefs:
    """The launch's refs: inputs (DESIGN.md, Flat token batch; num_seqs as [1]) and the output [T, H, Dh]."""

    q: Any
    k_cache: Any
    v_cache: Any
    block_table: Any
    kv_lens: Any
    cu_q_lens: Any
    num_seqs: Any
    out: Any


def _tile_rows(first: jax.Array, h: jax.Array, p: MixedParams):
    """Rows of a query tile: token (relative to `first`) and query head of each of the block_m rows."""
    rows = jnp.arange(p.block_m, dtype=jnp.int32)
    tok = first + lax.div(rows, p.group)
    head = h * p.group + lax.rem(rows, p.group)
    return rows < p.block_q * p.group, tok, head


def mixed_tile(r: AttentionRefs, q_block: jax.Array, h: jax.Array, p: MixedParams) -> None:
    """Program body for query tile `q_block` of kv head h: attention of its rows, written to r.out."""
    found, seq, q_start, local = _find_sequence(r.cu_q_lens, r.num_seqs, q_block, p)
    q_len = r.cu_q_lens[seq + 1] - q_start
    kv_len = r.kv_lens[seq]
    active = found & (local * p.block_q < q_len)
    if p.skip_single:
        active &= q_len > 1

    # Sequences with kv_len 0 (padding) run no key tile and write zeros.
    @pl.when(active)
    def _():
        d, dmask = _dims(p)
        in_tile, tok_local, head = _tile_rows(local * p.block_q, h, p)
        row_ok = in_tile & (tok_local < q_len)
        tok = jnp.where(row_ok, q_start + tok_local, p.num_tokens)
        idx = (tok[:, None], head[:, None], d[None, :])
        q = plgpu.load(r.q.at[idx], mask=_and(row_ok[:, None], dmask), other=0.0)
        ctx = kv_len - q_len
        q_lo = local * p.block_q
        q_hi = jnp.minimum(q_lo + p.block_q, q_len) - 1
        lo, full_lo, full_hi, hi = _key_tile_ranges(ctx, q_lo, q_hi, kv_len, p)
        refs = dict(bt_ref=r.block_table, k_ref=r.k_cache, v_ref=r.v_cache)
        step = functools.partial(_tile_step, q=q, seq=seq, h=h, kv_len=kv_len, qpos=ctx + tok_local, p=p, **refs)
        carry = (
            jnp.zeros((p.block_m, p.head_dim_padded), jnp.float32),
            jnp.full((p.block_m,), -jnp.inf, jnp.float32),
            jnp.zeros((p.block_m,), jnp.float32),
        )
        carry = lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
        carry = lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
        acc, _, l_i = lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)
        out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
        plgpu.store(r.out.at[idx], out.astype(r.out.dtype), mask=_and(row_ok[:, None], dmask))


def zero_tile(r: AttentionRefs, z: jax.Array, h: jax.Array, p: MixedParams) -> None:
    """Program body writing zeros to the padding tokens (from cu_q_lens[num_seqs] on) of token tile z."""
    d, dmask = _dims(p)
    in_tile, tok, head = _tile_rows(z * p.block_q, h, p)
    pad = in_tile & (tok >= r.cu_q_lens[r.num_seqs[0]]) & (tok < p.num_tokens)
    tok = jnp.where(pad, tok, p.num_tokens)
    zeros = jnp.zeros((p.block_m, p.head_dim_padded), r.out.dtype)
    plgpu.store(r.out.at[tok[:, None], head[:, None], d[None, :]], zeros, mask=_and(pad[:, None], dmask))


def _mixed_kernel(q_ref, k_ref, v_ref, bt_ref, kv_lens_ref, cu_ref, ns_ref, o_ref, *, p: MixedParams):
    r = AttentionRefs(q_ref, k_ref, v_ref, bt_ref, kv_lens_ref, cu_ref, ns_ref, o_ref)
    i, h = pl.program_id(0), pl.program_id(1)

    @pl.when(i < p.num_q_blocks)
    def _():
        # Heaviest (latest) query tiles first: causal work grows along a sequence.
        mixed_tile(r, p.num_q_blocks - 1 - i, h, p)

    @pl.when(i >= p.num_q_blocks)
    def _():
        zero_tile(r, i - p.num_q_blocks, h, p)


def mixed_attention(
    q,
    k_cache,
    v_cache,
    block_table,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    p: MixedParams,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> jax.Array:
    """Launch grid (query tiles + zero tiles, kv heads); returns [T, H, Dh] with every row written except
    those of one-token sequences when `p.skip_single` (the decode kernel writes those in place)."""
    p = dataclasses.replace(p, approx_exp2=not interpret)
    return pl.pallas_call(
        functools.partial(_mixed_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(p.num_q_blocks + p.num_zero_tiles, k_cache.shape[2]),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_mixed",
    )(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs)

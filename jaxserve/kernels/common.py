"""What the kernels share: the Triton deprecation filter, and the attention kernels' inputs, head_dim
masking, K/V gather and online softmax.

Every launch (`ragged_paged_attention`'s and `write_kv`'s) calls `filter_triton_deprecation` first. The
mixed kernel (`ragged_attention.py`) and the split-KV decode kernel (`decode_attention.py`) take the same
inputs (`AttentionInputs`), pad head_dim to a power of two and mask the padding (`head_dims`, `and_mask`),
gather each K/V tile per token through the block table (`load_kv`), and run the same float32 online
softmax over key tiles: scores kept in raw units with the scale folded into exp2's argument
(`tile_scores`, `exp2_scale`, `exp2`), one rescale-and-accumulate step per tile (`softmax_step`) from
`softmax_init`, and the final division (`normalise`). Those are traced inside a kernel.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

# JAX 0.11+ warns on every lowering of a Triton-backend pallas_call for a GPU. The Mosaic GPU port is a
# later goal (docs/kernels.md); until then this exact warning is expected and filtered, nothing else.
TRITON_DEPRECATION = re.escape("The Pallas Triton backend is deprecated and will be removed in a future JAX version.")
_IGNORE_TRITON_DEPRECATION = ("ignore", re.compile(TRITON_DEPRECATION, re.I), DeprecationWarning, None, 0)

LOG2E = math.log2(math.e)

# The Triton lowering turns DEFAULT precision into TF32 for float32 operands (a 1e-3 relative error);
# HIGHEST asks for IEEE float32 there and leaves bf16 / f16 operands on their native tensor-core path.
_PRECISION = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)

Carry = tuple[jax.Array, jax.Array, jax.Array]  # online softmax: accumulator [rows, Dh], running max, sum


def filter_triton_deprecation() -> None:
    """Puts the filter that ignores the Triton-backend deprecation warning (only it) first in the list.

    A `catch_warnings` block around the kernel call would not do: under a caller's jit or export the
    lowering that warns runs after the entry point has returned. So the entry points add a filter for
    the process, and on every call, not once: a `catch_warnings` block the caller is in (pytest runs
    each test in one) drops it on exit. Adding it only when it is not first already leaves the list,
    and the warnings registries it would reset, alone.
    """
    if warnings.filters[:1] != [_IGNORE_TRITON_DEPRECATION]:
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


class TileParams(Protocol):
    """The static parameters the shared pieces read; both kernels' parameter records have them."""

    head_dim: int
    head_dim_padded: int  # next power of two; loads and stores mask the padding
    block_size: int
    sm_scale: float
    soft_cap: float | None
    approx_exp2: bool  # set for GPU launches: see `exp2`


class AttentionInputs(NamedTuple):
    """`ragged_paged_attention`'s arrays in its order (docs/architecture.md, "One step"; num_seqs as [1]): a
    launch's first inputs, and inside its kernel their refs (a pallas_call passes refs in argument order)."""

    q: Any
    k_cache: Any
    v_cache: Any
    block_table: Any
    kv_lens: Any
    cu_q_lens: Any
    num_seqs: Any

    @classmethod
    def split_refs(cls, refs: tuple) -> tuple[AttentionInputs, tuple]:
        """A kernel's refs as (the inputs' refs, the refs after them: aliased inputs and outputs)."""
        n = len(cls._fields)
        return cls(*refs[:n]), refs[n:]


def head_dims(p: TileParams, *, flat: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """head_dim indices [Dh] and the mask of the real ones (None when head_dim needs no padding)."""
    d = jnp.arange(p.head_dim_padded, dtype=jnp.int32)
    if p.head_dim_padded == p.head_dim:
        return d, None
    # [1, Dh] (full rank) for [rows, Dh] tiles: the Triton lowering broadcasts masks only between equal
    # ranks. `flat`: [Dh], for 1-D loads and stores.
    return d, ((d < p.head_dim) if flat else (d < p.head_dim)[None, :])


def and_mask(mask: jax.Array, extra: jax.Array | None) -> jax.Array:
    return mask if extra is None else mask & extra


def load_kv(r: AttentionInputs, page, j, h, keys_ok, dims, p: TileParams) -> tuple[jax.Array, jax.Array]:
    """K and V tiles [keys, Dh] of kv head h for keys j in pages `page`: gathered per token, so tiles need
    not align with KV blocks. keys_ok [keys] masks keys off (None: every key is loaded); dims: `head_dims`."""
    d, dmask = dims
    idx = (page[:, None], lax.rem(j, p.block_size)[:, None], h, d[None, :])
    mask = dmask if keys_ok is None else and_mask(keys_ok[:, None], dmask)
    other = None if mask is None else 0.0
    k, v = plgpu.load(r.k_cache.at[idx], mask=mask, other=other), plgpu.load(r.v_cache.at[idx], mask=mask, other=other)
    if r.k_cache.dtype != r.q.dtype:  # an FP8 pool: its values in q's dtype, in registers
        k, v = k.astype(r.q.dtype), v.astype(r.q.dtype)
    return k, v


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


def exp2_scale(p: TileParams) -> float:
    """c with softmax = exp2(c * (s - max s)) for the scores `tile_scores` keeps (see there)."""
    return p.sm_scale * LOG2E if p.soft_cap is None else LOG2E


def tile_scores(q: jax.Array, k: jax.Array, p: TileParams) -> tuple[jax.Array, float]:
    """Scores [rows, keys] of a query tile against a key tile, and their `exp2_scale`. They are in the units
    the running max is kept in: raw dot products without soft-capping (sm_scale > 0 does not move the max,
    and the scale is applied inside exp2's argument as s * c - max * c, one fused multiply-add per score),
    soft-capped logits with it."""
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32)
    if p.soft_cap is not None:
        s = jnp.tanh(s * (p.sm_scale / p.soft_cap)) * p.soft_cap
    return s, exp2_scale(p)


def softmax_init(rows: int, p: TileParams) -> Carry:
    """The online softmax before any key tile: accumulator zeros, running max -inf, sum zero."""
    return (
        jnp.zeros((rows, p.head_dim_padded), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


def softmax_step(carry: Carry, s: jax.Array, c: float, v: jax.Array, p: TileParams, *, masked: bool) -> Carry:
    """One key tile of the online softmax: scores s ([rows, keys], -inf where hidden) and values v [keys, Dh].

    masked: s may hide all of a row's keys so far, leaving its running max at -inf.
    """
    acc, m_i, l_i = carry
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


def normalise(acc: jax.Array, l_i: jax.Array) -> jax.Array:
    """The rows' attention outputs [rows, Dh]; rows that saw no key (padding) come out as zeros."""
    return acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]

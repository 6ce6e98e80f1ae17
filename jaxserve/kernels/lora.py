"""LoRA's low-rank product added to a base product, for a batch of rows that each name an adapter slot: two Pallas
(Triton) kernels and their jnp reference. Measured slower than XLA's products on an H100 (docs/kernels.md, "LoRA
kernels"): the engine runs `jaxserve.models.lora.folded_product` on one device (x @ a inside the base GEMM) and
`add_lora` (XLA's GEMMs) otherwise; `add_lora_kernels` there runs these on separate tables
(`benchmarks/step_profile.py --lora-delta pallas`). `lora_shrink` is the shrink alone with its partial sums added
by XLA, for XLA's expand after it (`add_lora_shrink_kernel`, `--lora-delta shrink`): on the 8B shape's linears
alone it beats XLA's products at batch 1 only (docs/kernels.md), so the engine does not run it either.

    out = base + ((x @ a) * mask) @ b     x [T, K], a [K, S*C], b [S*C, N], base and out [T, N]

where C = P*R columns belong to each of the S slots and mask[t, c] keeps row t's own slot's columns (slots[t]).
`lora_shrink` computes x @ a in float32 split over K (`splits` partial sums [splits, T, S*C]: a decode batch has
a handful of rows, and the S*C columns are few, so only a split of K gives enough programs to read a at the copy
rate); `lora_expand` sums the partials, applies the mask, casts to b's dtype, multiplies by b's column tile and adds
the base tile: one kernel each, against XLA's GEMM, mask, GEMM and add. Accumulation is float32; the delta is
rounded to the output dtype before the add, as the jnp path rounds it.

Legend beyond docs' (STYLE.md): K the input width, N the output width, C a slot's columns (P*R).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from .checks import FLOAT_DTYPES
from .common import _PRECISION, and_mask, filter_triton_deprecation

_PROGRAMS = 128  # the shrink's programs to aim for: enough to keep an H100's or H200's SMs reading


def lora_reference(
    x: Float[Array, "T K"],
    a: Float[Array, "K SC"],
    b: Float[Array, "SC N"],
    slots: Int[Array, " T"],
    base: Float[Array, "T N"],
    cols_per_slot: int,
) -> Float[Array, "T N"]:
    """base + ((x @ a) * mask) @ b: float32 products at IEEE precision, x @ a and the delta each rounded to their
    dtype (x's, base's) as the jnp path (`jaxserve.models.lora.lora_delta`) rounds them."""
    xa = jnp.dot(x, a, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    keep = (jnp.arange(a.shape[1]) // cols_per_slot)[None, :] == slots[:, None]
    xa = jnp.where(keep, xa, 0.0).astype(b.dtype)
    delta = jnp.dot(xa, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32).astype(base.dtype)
    return (base.astype(jnp.float32) + delta.astype(jnp.float32)).astype(base.dtype)


@dataclass(frozen=True, slots=True)
class LoraParams:
    """Static parameters of one call: the shapes, the tiles, and the split of K."""

    num_rows: int  # T
    dim_in: int  # K
    dim_slots: int  # S*C
    dim_out: int  # N
    cols_per_slot: int  # C
    block_m: int
    block_n: int  # output columns of an expand program
    block_c: int  # slot columns: a shrink program's, and an expand program's loop step
    block_k: int
    splits: int
    chunk: int  # K rows of a shrink program (a multiple of block_k)


def lora_params(num_rows: int, dim_in: int, dim_slots: int, dim_out: int, cols_per_slot: int) -> LoraParams:
    """The tiles of one call: row tiles of 16 to 64 rows, 64 slot and output columns, K split until about
    _PROGRAMS shrink programs run (decode: up to K / 128 of them; a prefill's many row tiles need none)."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    block_c, block_n, block_k = 64, 64, 128
    tiles = pl.cdiv(num_rows, block_m) * pl.cdiv(dim_slots, block_c)
    k_tiles = pl.cdiv(dim_in, block_k)
    splits = max(1, min(k_tiles, _PROGRAMS // tiles))
    chunk = pl.cdiv(k_tiles, splits) * block_k
    splits = pl.cdiv(dim_in, chunk)
    return LoraParams(
        num_rows, dim_in, dim_slots, dim_out, cols_per_slot, block_m, block_n, block_c, block_k, splits, chunk
    )


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32)


def _shrink_kernel(x_ref, a_ref, out_ref, *, p: LoraParams):
    """Program (row tile, slot-column tile, split): x's rows times a's columns over the split's K rows."""
    rows = pl.program_id(0) * p.block_m + jnp.arange(p.block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * p.block_c + jnp.arange(p.block_c, dtype=jnp.int32)
    first = pl.program_id(2) * p.chunk
    row_ok, col_ok = rows < p.num_rows, cols < p.dim_slots

    def step(i, acc):
        k = first + i * p.block_k + jnp.arange(p.block_k, dtype=jnp.int32)
        k_ok = k < p.dim_in
        x = plgpu.load(x_ref.at[rows[:, None], k[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = plgpu.load(a_ref.at[k[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return acc + _dot(x, a)

    acc = lax.fori_loop(0, p.chunk // p.block_k, step, jnp.zeros((p.block_m, p.block_c), jnp.float32))
    out_idx = (pl.program_id(2), rows[:, None], cols[None, :])
    plgpu.store(out_ref.at[out_idx], acc, mask=row_ok[:, None] & col_ok[None, :])


def _expand_kernel(partial_ref, slots_ref, b_ref, base_ref, out_ref, *, p: LoraParams):
    """Program (row tile, output-column tile): over the slot columns in steps of block_c, the partials summed and
    masked to each row's slot, times b's tile; then the base tile added."""
    rows = pl.program_id(0) * p.block_m + jnp.arange(p.block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * p.block_n + jnp.arange(p.block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < p.num_rows, cols < p.dim_out
    slot = plgpu.load(slots_ref.at[rows], mask=row_ok, other=0)

    # Unrolled (Python loops over static counts): every partial's load is issued before the first is summed. As
    # loops, each program waited for one load after another (an H100 took 17-41 µs a call for up to 64 splits).
    acc = jnp.zeros((p.block_m, p.block_n), jnp.float32)
    for i in range(pl.cdiv(p.dim_slots, p.block_c)):
        c = i * p.block_c + jnp.arange(p.block_c, dtype=jnp.int32)
        c_ok = c < p.dim_slots
        mask = row_ok[:, None] & c_ok[None, :]
        index = (rows[:, None], c[None, :])
        parts = [plgpu.load(partial_ref.at[(s, *index)], mask=mask, other=0.0) for s in range(p.splits)]
        xa = functools.reduce(jnp.add, parts)
        xa = jnp.where((c // p.cols_per_slot)[None, :] == slot[:, None], xa, 0.0).astype(b_ref.dtype)
        b = plgpu.load(b_ref.at[c[:, None], cols[None, :]], mask=c_ok[:, None] & col_ok[None, :], other=0.0)
        acc = acc + _dot(xa, b)
    delta = acc.astype(out_ref.dtype)
    out_idx, out_mask = (rows[:, None], cols[None, :]), and_mask(row_ok[:, None], col_ok[None, :])
    base = plgpu.load(base_ref.at[out_idx], mask=out_mask, other=0.0)
    out = base.astype(jnp.float32) + delta.astype(jnp.float32)
    plgpu.store(out_ref.at[out_idx], out.astype(out_ref.dtype), mask=out_mask)


_COMPILER_PARAMS = dict(num_warps=4, num_stages=3)


def _shrink_partials(x: jax.Array, a: jax.Array, p: LoraParams, interpret: bool) -> jax.Array:
    """The shrink kernel: x @ a as [splits, T, S*C] float32 partial sums over K."""
    return pl.pallas_call(
        functools.partial(_shrink_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct((p.splits, p.num_rows, p.dim_slots), jnp.float32),
        grid=(pl.cdiv(p.num_rows, p.block_m), pl.cdiv(p.dim_slots, p.block_c), p.splits),
        compiler_params=plgpu.CompilerParams(**_COMPILER_PARAMS),
        interpret=interpret,
        name="lora_shrink",
    )(x, a)


@functools.partial(jax.jit, static_argnames=("cols_per_slot", "interpret"))
def _lora_add(x, a, b, slots, base, *, cols_per_slot: int, interpret: bool):
    p = lora_params(x.shape[0], x.shape[1], a.shape[1], b.shape[1], cols_per_slot)
    return pl.pallas_call(
        functools.partial(_expand_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        grid=(pl.cdiv(p.num_rows, p.block_m), pl.cdiv(p.dim_out, p.block_n)),
        input_output_aliases={3: 0},  # the base product, updated in place
        compiler_params=plgpu.CompilerParams(**_COMPILER_PARAMS),
        interpret=interpret,
        name="lora_expand",
    )(_shrink_partials(x, a, p, interpret), slots, b, base)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _lora_shrink(x, a, *, interpret: bool):
    # The shrink's tiles and split; the expand's output width and slot columns play no part in them.
    p = lora_params(x.shape[0], x.shape[1], a.shape[1], dim_out=1, cols_per_slot=a.shape[1])
    return jnp.sum(_shrink_partials(x, a, p, interpret), axis=0)


def lora_shrink(x: Float[Array, "T K"], a: Float[Array, "K SC"], *, interpret: bool = False) -> Float[Array, "T SC"]:
    """x @ a in float32: the shrink kernel's partial sums over K, added by XLA (one small reduction), for a caller
    that does the rest with XLA (`jaxserve.models.lora.add_lora_shrink_kernel`). x and a in one float dtype."""
    if x.ndim != 2 or a.ndim != 2 or a.shape[0] != x.shape[1]:
        raise ValueError(f"x [T, K] and a [K, S*C] must chain, got {x.shape} and {a.shape}")
    if not x.dtype == a.dtype or jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"x and a must share a float dtype, got {x.dtype} and {a.dtype}")
    if x.shape[0] == 0:
        return jnp.zeros((0, a.shape[1]), jnp.float32)
    filter_triton_deprecation()
    return _lora_shrink(x, a, interpret=interpret)


def lora_add(
    x: Float[Array, "T K"],
    a: Float[Array, "K SC"],
    b: Float[Array, "SC N"],
    slots: Int[Array, " T"],
    base: Float[Array, "T N"],
    *,
    cols_per_slot: int,
    interpret: bool = False,
) -> Float[Array, "T N"]:
    """`lora_reference` as the two kernels (module docstring): x, a and b in one float dtype, slots int32 (each in
    [0, S)), base in any float dtype (the result's). interpret: run on a CPU (tests)."""
    if x.ndim != 2 or a.ndim != 2 or b.ndim != 2 or base.ndim != 2:
        raise ValueError(f"x, a, b and base must be 2-D, got {x.shape}, {a.shape}, {b.shape}, {base.shape}")
    num_rows, dim_in = x.shape
    if a.shape[0] != dim_in or b.shape[0] != a.shape[1] or base.shape != (num_rows, b.shape[1]):
        raise ValueError(f"shapes do not chain: x {x.shape} @ a {a.shape} @ b {b.shape} + base {base.shape}")
    if a.shape[1] % cols_per_slot:
        raise ValueError(f"a's {a.shape[1]} columns are not whole slots of {cols_per_slot}")
    if slots.shape != (num_rows,) or jnp.dtype(slots.dtype) != jnp.int32:
        raise TypeError(f"slots must be int32 [{num_rows}], got {slots.dtype}{list(slots.shape)}")
    for name, array in (("x", x), ("a", a), ("b", b), ("base", base)):
        if jnp.dtype(array.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {array.dtype}")
    if not a.dtype == b.dtype == x.dtype:
        raise TypeError(f"x, a and b must share a dtype, got {x.dtype}, {a.dtype}, {b.dtype}")
    if num_rows == 0:
        return base
    filter_triton_deprecation()
    return _lora_add(x, a, b, slots, base, cols_per_slot=cols_per_slot, interpret=interpret)

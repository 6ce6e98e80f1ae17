"""Grouped GEMMs of the mixture-of-experts layer (docs/kernels.md, "Mixture-of-experts kernels"), their
jnp references, their tiling and the tile table they run over.

`grouped_matmul(lhs, rhs, group_sizes)` is `jax.lax.ragged_dot`: lhs rows are sorted by expert, expert g
owns the next group_sizes[g] rows and multiplies them by rhs[g]; rows past sum(group_sizes) (the step's
padding) come out as zeros. `grouped_gate_up` is the gate/up projection with silu(gate) * up in its
epilogue. Both take an optional `row_offset`: the groups start at that row and the rows before it come
out as zeros (an expert-parallel device's share of the whole row set, without copying rows); and an optional
`lhs_rows`: row r of the product reads lhs[lhs_rows[r]], so the layer's gather of each routed row's token
happens in the kernel's loads (from L2: the step's tokens are read k times) instead of writing and reading
a [R, D] copy. Legend beyond
docs' (STYLE.md): R routed rows (tokens x top-k, sorted by expert, padded to the step's bucket), Din / Dout
a generic product's input and output widths (F and D for the down projection).

Layout after megablocks' grouped GEMM and vLLM's `moe_align_block_size`: row tiles never straddle two
experts. `tile_table` (jnp, from group_sizes) cuts each expert's rows into block_m-row tiles from the
expert's first row, then the padding rows into zero tiles; a program's tile slot gives its expert and its
rows. The grid (one axis: tile slots x column tiles, in groups of group_m tile slots per column sweep for
L2 reuse) is static: R // block_m + min(E + 1, R) slots bound any routing, and programs past the table's
used tiles exit at once. Empty experts get no tile, so a decode step reads only the experts that receive
rows. Accumulation is float32; outputs are in lhs's dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from jaxserve.models.quant import dequantized

from .checks import FLOAT_DTYPES
from .common import _PRECISION, and_mask, filter_triton_deprecation
from .tuning import check_power_of_two

_MAX_ELEMENTS = 1 << 31

# ---------------------------------------------------------------------------------------------------------
# References


def grouped_matmul_reference(
    lhs: Float[Array, "R Din"],
    rhs: Float[Array, "E Din Dout"],
    group_sizes: Int[Array, " E"],
    rhs_scale: Float[Array, "E Dout"] | None = None,
) -> Float[Array, "R Dout"]:
    """`jax.lax.ragged_dot` (float32 operands at IEEE precision, as the kernel's dots); an FP8 rhs with its
    rhs_scale dequantized to float32 first, the product in float32 cast to lhs's dtype."""
    dtype = lhs.dtype
    if rhs_scale is not None:
        lhs, rhs = lhs.astype(jnp.float32), dequantized(rhs, rhs_scale)
    return lax.ragged_dot(lhs, rhs, group_sizes, precision=lax.Precision.HIGHEST).astype(dtype)


def grouped_gate_up_reference(
    lhs: Float[Array, "R D"],
    rhs: Float[Array, "E D 2 F"],
    group_sizes: Int[Array, " E"],
    rhs_scale: Float[Array, "E 2 F"] | None = None,
) -> Float[Array, "R F"]:
    """silu(gate) * up in float32, cast to lhs's dtype, from one ragged_dot over rhs flattened to [E, D, 2F]
    (gate = rhs[:, :, 0], up = rhs[:, :, 1]); an FP8 rhs with its rhs_scale dequantized to float32 first."""
    e, d, _, f = rhs.shape
    dtype = lhs.dtype
    if rhs_scale is not None:
        lhs, rhs = lhs.astype(jnp.float32), dequantized(rhs, rhs_scale)
    both = lax.ragged_dot(
        lhs, rhs.reshape(e, d, 2 * f), group_sizes, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    return (jax.nn.silu(both[:, :f]) * both[:, f:]).astype(dtype)


# ---------------------------------------------------------------------------------------------------------
# Tiling and the tile table


@dataclass(frozen=True, slots=True)
class MoeTiling:
    """Tiles of the grouped GEMMs. block_m rows of one expert, block_n output columns (of gate and of up
    each in `grouped_gate_up`), block_k of the contraction per loop step; group_m tile slots share one sweep
    over the column tiles (consecutive programs read the same weight tile: L2 reuse)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):  # 16: the smallest tile a Triton dot takes
            check_power_of_two(name, getattr(self, name), 16, 256)
        check_power_of_two("group_m", self.group_m, 1, 64)
        check_power_of_two("num_warps", self.num_warps, 1, 16)
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [1, 6], got {self.num_stages}")


def default_moe_tiling(num_rows: int, num_experts: int, fused: bool = False) -> MoeTiling:
    """block_m near the mean rows per expert (a partial tile wastes at most what it does not fill), the
    other fields after vLLM's tuned H100 fused-MoE table for E=128, F=768; at 256 rows an expert, gate_up
    (`fused`) with 4 pipeline stages, the best of eight tilings measured on an H100 at 32,768 rows (53% of the
    matmul rate against 48% with 3; the down projection's best kept 3; docs/performance.md)."""
    per_expert = num_rows / max(num_experts, 1)
    if per_expert <= 16:
        return MoeTiling(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 64:
        return MoeTiling(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3)
    return MoeTiling(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4 if fused else 3)


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Tile slots that cover any routing of num_rows rows: each non-empty group (E experts and the padding)
    adds at most one partial tile to R // block_m full ones, and at most min(E + 1, R) groups are non-empty."""
    return num_rows // block_m + min(num_experts + 1, num_rows)


class TileTable(NamedTuple):
    """Row tiles of one call, one slot per program row; slots from num_tiles on are unused.

    group: the tile's expert, or E for a zero tile (padding rows); rows [row_start, row_end) are its rows.
    """

    group: Int[Array, " S"]
    row_start: Int[Array, " S"]
    row_end: Int[Array, " S"]
    num_tiles: Int[Array, " 1"]


def tile_table(
    group_sizes: Int[Array, " E"], num_rows: int, block_m: int, row_offset: Int[Array, ""] | None = None
) -> TileTable:
    """The tiles of rows [0, num_rows) grouped by group_sizes, as jnp ops (traceable; group sizes are data).

    Groups run in order and are cut at num_rows (as ragged_dot does when their sum exceeds it); negative
    sizes count as 0. The rows after the last group form group E, whose tiles write zeros. Unused slots hold
    group E and the empty row range [num_rows, num_rows). row_offset (data): the groups start at that row
    instead of 0, the rows before it forming a leading zero group (group E too); one more slot then.
    """
    if row_offset is not None:
        # The leading run as one more group in front, then its tiles renamed to the zero group E.
        sizes = jnp.concatenate([jnp.reshape(row_offset, (1,)).astype(jnp.int32), group_sizes.astype(jnp.int32)])
        table = tile_table(sizes, num_rows, block_m)
        num_experts = group_sizes.shape[0]
        group = jnp.where((table.group == 0) | (table.group > num_experts), num_experts, table.group - 1)
        return table._replace(group=group)
    num_experts = group_sizes.shape[0]
    slots = max_tiles(num_rows, num_experts, block_m)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])  # the padding group
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    tiles = lax.div(ends - starts + block_m - 1, block_m)
    tile_ends = jnp.cumsum(tiles)
    slot = jnp.arange(slots, dtype=jnp.int32)
    # A slot's group: how many groups' tiles end at or before it (E + 1 past the used slots).
    group = jnp.sum(tile_ends[None, :] <= slot[:, None], axis=1, dtype=jnp.int32)
    used = group <= num_experts
    g = jnp.minimum(group, num_experts)
    row_start = starts[g] + (slot - (tile_ends[g] - tiles[g])) * block_m
    return TileTable(
        group=g,
        row_start=jnp.where(used, row_start, num_rows),
        row_end=jnp.where(used, ends[g], num_rows),
        num_tiles=tile_ends[-1:],
    )


# ---------------------------------------------------------------------------------------------------------
# The kernel


@dataclass(frozen=True, slots=True)
class GemmParams:
    """Static parameters of one grouped-GEMM launch."""

    num_rows: int  # R
    dim_in: int  # contraction width (Din, or D for gate_up)
    dim_out: int  # output width (Dout, or F for gate_up)
    num_experts: int
    fused: bool  # gate/up pair with silu(gate) * up in the epilogue
    tiling: MoeTiling
    offset: bool = False  # a leading run of zero rows (row_offset): one more group
    gather: bool = False  # lhs_rows: row r reads lhs row lhs_rows[r]
    scaled: bool = False  # rhs in float8_e4m3fn with a float32 scale per expert and output column

    @property
    def slots(self) -> int:
        return max_tiles(self.num_rows, self.num_experts + self.offset, self.tiling.block_m)

    @property
    def n_tiles(self) -> int:
        return pl.cdiv(self.dim_out, self.tiling.block_n)

    @property
    def k_tiles(self) -> int:
        return pl.cdiv(self.dim_in, self.tiling.block_k)


def _program_tile(p: GemmParams) -> tuple[jax.Array, jax.Array]:
    """(tile slot, column tile) of this program: group_m slots sweep the column tiles together."""
    pid, group_m = pl.program_id(0), p.tiling.group_m
    sweep = group_m * p.n_tiles
    first = lax.div(pid, sweep) * group_m
    height = jnp.minimum(p.slots - first, group_m)
    within = lax.rem(pid, sweep)
    return first + lax.rem(within, height), lax.div(within, height)


def _dims_mask(idx: jax.Array, size: int, block: int) -> jax.Array | None:
    """idx < size, or None where size is a multiple of the block (no load or store needs a mask)."""
    return None if size % block == 0 else idx < size


def _expert_product(lhs_ref, rhs_ref, scale_ref, expert, rows, row_ok, cols, p: GemmParams) -> jax.Array:
    """The float32 product of a row tile (lhs rows `rows`) by its expert's columns (silu(gate) * up when fused):
    [bm, bn]. An FP8 rhs (p.scaled): each tile converted to lhs's dtype after its load, the float32 sums scaled
    by the expert's column scales (scale_ref) before the epilogue."""
    t = p.tiling
    col_ok = _dims_mask(cols, p.dim_out, t.block_n)
    w_cols = cols[None, :]
    col_mask = None if col_ok is None else col_ok[None, :]

    def dot(a, w):
        return lax.dot_general(a, w, (((1,), (0,)), ((), ())), precision=_PRECISION, preferred_element_type=jnp.float32)

    def step(i, acc):
        k = i * t.block_k + jnp.arange(t.block_k, dtype=jnp.int32)
        k_ok = _dims_mask(k, p.dim_in, t.block_k)
        a_mask = and_mask(row_ok[:, None], None if k_ok is None else k_ok[None, :])
        a = plgpu.load(lhs_ref.at[rows[:, None], k[None, :]], mask=a_mask, other=0.0)
        w_mask = col_mask if k_ok is None else and_mask(k_ok[:, None], col_mask)
        other = None if w_mask is None else 0.0

        def load_w(idx):
            w = plgpu.load(rhs_ref.at[idx], mask=w_mask, other=other)
            return w.astype(a.dtype) if p.scaled else w

        if not p.fused:
            return acc + dot(a, load_w((expert, k[:, None], w_cols)))
        gate, up = load_w((expert, k[:, None], 0, w_cols)), load_w((expert, k[:, None], 1, w_cols))
        return acc[0] + dot(a, gate), acc[1] + dot(a, up)

    zeros = jnp.zeros((t.block_m, t.block_n), jnp.float32)
    acc = lax.fori_loop(0, p.k_tiles, step, (zeros, zeros) if p.fused else zeros)
    if p.scaled:
        other = None if col_ok is None else 0.0

        def load_scale(idx):
            return plgpu.load(scale_ref.at[idx], mask=col_ok, other=other)[None, :]

        if p.fused:
            acc = acc[0] * load_scale((expert, 0, cols)), acc[1] * load_scale((expert, 1, cols))
        else:
            acc = acc * load_scale((expert, cols))
    return jax.nn.silu(acc[0]) * acc[1] if p.fused else acc


def _grouped_kernel(group_ref, start_ref, end_ref, count_ref, *refs, p: GemmParams):
    refs = list(refs)
    lhs_rows_ref = refs.pop(0) if p.gather else None
    lhs_ref, rhs_ref = refs.pop(0), refs.pop(0)
    scale_ref = refs.pop(0) if p.scaled else None
    (out_ref,) = refs
    slot, n_tile = _program_tile(p)
    t = p.tiling

    @pl.when(slot < count_ref[0])
    def _():
        expert, start, end = group_ref[slot], start_ref[slot], end_ref[slot]
        rows = start + jnp.arange(t.block_m, dtype=jnp.int32)
        cols = n_tile * t.block_n + jnp.arange(t.block_n, dtype=jnp.int32)
        row_ok = rows < end
        col_ok = _dims_mask(cols, p.dim_out, t.block_n)
        out_idx = (rows[:, None], cols[None, :])
        out_mask = and_mask(row_ok[:, None], None if col_ok is None else col_ok[None, :])

        @pl.when(expert < p.num_experts)
        def _():
            lhs_rows = rows if lhs_rows_ref is None else plgpu.load(lhs_rows_ref.at[rows], mask=row_ok, other=0)
            out = _expert_product(lhs_ref, rhs_ref, scale_ref, expert, lhs_rows, row_ok, cols, p)
            plgpu.store(out_ref.at[out_idx], out.astype(out_ref.dtype), mask=out_mask)

        @pl.when(expert == p.num_experts)  # padding rows: zeros, nothing read
        def _():
            plgpu.store(out_ref.at[out_idx], jnp.zeros((t.block_m, t.block_n), out_ref.dtype), mask=out_mask)


@functools.partial(jax.jit, static_argnames=("fused", "tiling", "interpret"))
def _grouped(
    lhs, rhs, group_sizes, row_offset, lhs_rows, rhs_scale, *, fused: bool, tiling: MoeTiling, interpret: bool
):
    num_rows = lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0]
    gather, scaled = lhs_rows is not None, rhs_scale is not None
    p = GemmParams(
        num_rows, lhs.shape[1], rhs.shape[-1], rhs.shape[0], fused, tiling, row_offset is not None, gather, scaled
    )
    table = tile_table(group_sizes, num_rows, tiling.block_m, row_offset)
    return pl.pallas_call(
        functools.partial(_grouped_kernel, p=p),
        out_shape=jax.ShapeDtypeStruct((num_rows, p.dim_out), lhs.dtype),
        grid=(p.slots * p.n_tiles,),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="moe_gate_up" if fused else "moe_matmul",
    )(*table, *((lhs_rows,) if gather else ()), lhs, rhs, *((rhs_scale,) if scaled else ()))


# ---------------------------------------------------------------------------------------------------------
# Entry points


def check_grouped_inputs(lhs, rhs, group_sizes, *, fused: bool, lhs_rows=None, rhs_scale=None) -> None:
    """lhs [R, Din] ([T, Din] with lhs_rows: int32 [R] indices into it); rhs [E, Din, Dout] (fused:
    [E, D, 2, F]) in lhs's float dtype, or in float8_e4m3fn with rhs_scale float32 [E, Dout] ([E, 2, F]);
    group_sizes int32 [E]."""
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [R, Din], got shape {lhs.shape}")
    want = "[E, D, 2, F]" if fused else "[E, Din, Dout]"
    if rhs.ndim != (4 if fused else 3) or rhs.shape[1] != lhs.shape[1] or (fused and rhs.shape[2] != 2):
        raise ValueError(f"rhs must be {want} with lhs's width {lhs.shape[1]}, got shape {rhs.shape}")
    if rhs.shape[0] < 1:
        raise ValueError(f"rhs needs at least one expert, got shape {rhs.shape}")
    if group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"group_sizes must be [E]=[{rhs.shape[0]}], got shape {group_sizes.shape}")
    if jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise TypeError(f"group_sizes must be int32, got {group_sizes.dtype}")
    if jnp.dtype(lhs.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"lhs dtype must be one of float32, bfloat16, float16, got {lhs.dtype}")
    if rhs_scale is None and rhs.dtype != lhs.dtype:
        raise TypeError(f"rhs ({rhs.dtype}) must have lhs's dtype ({lhs.dtype}), or be float8_e4m3fn with rhs_scale")
    if rhs_scale is not None:
        if rhs.dtype != jnp.float8_e4m3fn or rhs_scale.dtype != jnp.float32:
            got = f"{rhs.dtype} and {rhs_scale.dtype}"
            raise TypeError(f"with rhs_scale, rhs must be float8_e4m3fn and rhs_scale float32, got {got}")
        want_scale = rhs.shape[:1] + rhs.shape[2:]
        if rhs_scale.shape != want_scale:
            got = list(rhs_scale.shape)
            raise ValueError(f"rhs_scale must be rhs's shape without Din, {list(want_scale)}, got {got}")
    if lhs_rows is not None and (lhs_rows.ndim != 1 or jnp.dtype(lhs_rows.dtype) != jnp.int32):
        raise TypeError(f"lhs_rows must be int32 [R], got {lhs_rows.dtype}{list(lhs_rows.shape)}")
    out_shape = (lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0], rhs.shape[-1])
    for name, shape in (("lhs", lhs.shape), ("rhs", rhs.shape), ("the output", out_shape)):
        if math.prod(shape) >= _MAX_ELEMENTS:  # the Triton lowering addresses elements with int32 offsets
            raise ValueError(f"{name} must have fewer than 2**31 elements, got shape {shape}")


def _launch(
    lhs, rhs, group_sizes, row_offset, lhs_rows, rhs_scale, *, fused: bool, interpret: bool, tiling: MoeTiling | None
) -> jax.Array:
    check_grouped_inputs(lhs, rhs, group_sizes, fused=fused, lhs_rows=lhs_rows, rhs_scale=rhs_scale)
    if row_offset is not None:
        row_offset = jnp.asarray(row_offset)
        if row_offset.shape != () or row_offset.dtype != jnp.int32:
            raise TypeError(f"row_offset must be an int32 scalar, got {row_offset.dtype}{list(row_offset.shape)}")
    num_rows = lhs.shape[0] if lhs_rows is None else lhs_rows.shape[0]
    if num_rows == 0:
        return jnp.zeros((0, rhs.shape[-1]), lhs.dtype)
    if lhs.shape[0] == 0:
        raise ValueError(f"lhs_rows index {num_rows} rows of an empty lhs")
    tiling = default_moe_tiling(num_rows, rhs.shape[0], fused) if tiling is None else tiling
    filter_triton_deprecation()
    return _grouped(
        lhs, rhs, group_sizes, row_offset, lhs_rows, rhs_scale, fused=fused, tiling=tiling, interpret=interpret
    )


def grouped_matmul(
    lhs: Float[Array, "R Din"],
    rhs: Float[Array, "E Din Dout"],
    group_sizes: Int[Array, " E"],
    *,
    row_offset: Int[Array, ""] | int | None = None,
    lhs_rows: Int[Array, " R"] | None = None,
    rhs_scale: Float[Array, "E Dout"] | None = None,
    interpret: bool = False,
    tiling: MoeTiling | None = None,
) -> Float[Array, "R Dout"]:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)`: rows sorted by group, group g's group_sizes[g] rows times
    rhs[g], rows past sum(group_sizes) zero. float32 accumulation, output in lhs's dtype.

    row_offset: an int32 scalar (data, like group_sizes): the groups start at that row and the rows before it
    are zeros, not read (None, the default, and 0: ragged_dot's semantics). An expert-parallel device passes its
    experts' group sizes and the rows of the experts before them, and computes only its experts' rows of the
    whole row set. lhs_rows: int32 [R]: row r reads lhs[lhs_rows[r]] (lhs then has any number of rows; the
    result is `grouped_matmul(lhs[lhs_rows], ...)` without that copy). rhs_scale: float32 [E, Dout] with rhs in
    float8_e4m3fn (`jaxserve.models.quant.Fp8Experts`): the weight is rhs * rhs_scale[:, None], read as FP8 bytes
    and converted to lhs's dtype tile by tile. tiling: `MoeTiling` (default `default_moe_tiling(R, E, fused)`).
    interpret: run on a CPU (tests)."""
    return _launch(
        lhs, rhs, group_sizes, row_offset, lhs_rows, rhs_scale, fused=False, interpret=interpret, tiling=tiling
    )


def grouped_gate_up(
    lhs: Float[Array, "R D"],
    rhs: Float[Array, "E D 2 F"],
    group_sizes: Int[Array, " E"],
    *,
    row_offset: Int[Array, ""] | int | None = None,
    lhs_rows: Int[Array, " R"] | None = None,
    rhs_scale: Float[Array, "E 2 F"] | None = None,
    interpret: bool = False,
    tiling: MoeTiling | None = None,
) -> Float[Array, "R F"]:
    """silu(lhs @ gate) * (lhs @ up) per group, gate = rhs[:, :, 0] and up = rhs[:, :, 1]: the two products
    and the activation in float32, the result in lhs's dtype; rows past sum(group_sizes) zero.

    row_offset, lhs_rows, rhs_scale ([E, 2, F]), tiling (block_n columns of gate and of up each) and interpret as
    in `grouped_matmul`."""
    return _launch(
        lhs, rhs, group_sizes, row_offset, lhs_rows, rhs_scale, fused=True, interpret=interpret, tiling=tiling
    )

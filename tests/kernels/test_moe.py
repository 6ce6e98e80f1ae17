"""The MoE grouped GEMMs (Pallas, interpret mode) against their references (`jax.lax.ragged_dot`): random
ragged groups, empty groups, one-row groups, all rows in one group, tile-aligned groups, sums past R (cut as
ragged_dot cuts them) and padding rows after the groups; float32 bit for bit on small integer-valued inputs
(every product and sum exact, so the order of the additions cannot matter), bfloat16 within its rounding.
Each shape compiles once and runs every routing: group sizes are data. The tile table against a plain
Python one; a row offset (an expert-parallel device's rows of the whole row set) leads with zero rows; bad
inputs are clear errors; both kernels lower for an H200 as one Triton launch each.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxserve import kernels as pk
from jaxserve.kernels import moe
from jaxserve.models import quant

E = 5
# (rows, Din, Dout, tiling): Din and Dout cut by their blocks (masked loads and stores), then multiples of them.
SHAPES = [
    (40, 48, 40, moe.MoeTiling(block_m=16, block_n=16, block_k=32, group_m=2)),
    (64, 64, 32, moe.MoeTiling(block_m=16, block_n=16, block_k=16, group_m=4)),
]
ROUTINGS = {
    "ragged": [7, 0, 13, 1, 9],  # padding after them
    "one_group": [0, 0, 0, 0, 0],  # all rows in expert 2 (set below)
    "one_row_groups": [1, 1, 1, 1, 1],
    "all_padding": [0, 0, 0, 0, 0],
    "tile_aligned": [16, 16, 0, 0, 0],
    "past_rows": [30, 30, 5, 0, 0],  # sum > R: cut at R
}


def _sizes(name: str, rows: int) -> jax.Array:
    sizes = list(ROUTINGS[name])
    if name == "one_group":
        sizes[2] = rows
    if name == "ragged":
        sizes = [s * rows // 40 for s in sizes]
    return jnp.asarray(sizes, jnp.int32)


def _random_sizes(rng: np.random.Generator, rows: int) -> jax.Array:
    """E sizes with a random total <= rows, some of them empty."""
    cuts = np.sort(rng.integers(0, rows + 1, E))
    sizes = np.diff(np.concatenate([[0], cuts])) * (rng.random(E) < 0.8)
    return jnp.asarray(sizes, jnp.int32)


def _integer_inputs(rows: int, din: int, dout: int, fused: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    lhs = rng.integers(-3, 4, (rows, din)).astype(np.float32)
    rhs = rng.integers(-3, 4, (E, din, 2, dout) if fused else (E, din, dout)).astype(np.float32)
    return jnp.asarray(lhs), jnp.asarray(rhs)


def _compiled(fused: bool, lhs, rhs, tiling):
    """The kernel compiled once for these shapes (group sizes vary per call), and its reference."""
    kernel = functools.partial(pk.grouped_gate_up if fused else pk.grouped_matmul, interpret=True, tiling=tiling)
    reference = pk.grouped_gate_up_reference if fused else pk.grouped_matmul_reference
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32)
    return jax.jit(kernel).lower(lhs, rhs, sizes).compile(), jax.jit(reference)


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
@pytest.mark.parametrize("shape", SHAPES, ids=["masked", "aligned"])
def test_float32_bit_for_bit(shape, fused):
    rows, din, dout, tiling = shape
    lhs, rhs = _integer_inputs(rows, din, dout, fused)
    kernel, reference = _compiled(fused, lhs, rhs, tiling)
    rng = np.random.default_rng(rows)
    cases = {name: _sizes(name, rows) for name in ROUTINGS} | {f"random{i}": _random_sizes(rng, rows) for i in range(4)}
    for name, sizes in cases.items():
        out, want = kernel(lhs, rhs, sizes), reference(lhs, rhs, sizes)
        assert out.dtype == jnp.float32 and out.shape == (rows, dout)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want), err_msg=f"{name}: {sizes.tolist()}")
        used = min(int(jnp.maximum(sizes, 0).sum()), rows)
        assert not np.asarray(out[used:]).any(), name


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_bfloat16_within_rounding(fused):
    """Against the float32 reference of the same bf16 values: one bf16 rounding of the output apart."""
    rows, din, dout, tiling = SHAPES[0]
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((rows, din)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((E, din, 2, dout) if fused else (E, din, dout)) / din**0.5, jnp.bfloat16)
    kernel, reference = _compiled(fused, lhs, rhs, tiling)
    for sizes in (_sizes("ragged", rows), _sizes("one_row_groups", rows), _random_sizes(rng, rows)):
        out = kernel(lhs, rhs, sizes)
        assert out.dtype == jnp.bfloat16
        want = np.asarray(reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes))
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2**-8, atol=1e-3)
        # The bf16 reference (what the model's XLA path computes) agrees as closely.
        np.testing.assert_allclose(
            np.asarray(out, np.float32), np.asarray(reference(lhs, rhs, sizes), np.float32), 2**-7, 1e-3
        )


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_fp8_rhs_float32_bit_for_bit(fused):
    """An FP8 expert stack (`quant.Fp8Experts`: e4m3 values, a float32 scale per expert and output column) against
    the reference on its dequantized values: small integers (exact in e4m3) and power-of-two scales keep every
    product and sum exact, so the kernel's convert-then-scale order must give the same bits."""
    rows, din, dout, tiling = SHAPES[0]
    lhs, rhs = _integer_inputs(rows, din, dout, fused, seed=5)
    rng = np.random.default_rng(5)
    scale = jnp.asarray(2.0 ** rng.integers(-4, 3, rhs.shape[:1] + rhs.shape[2:]), jnp.float32)
    values = rhs.astype(jnp.float8_e4m3fn)
    kernel = functools.partial(pk.grouped_gate_up if fused else pk.grouped_matmul, interpret=True, tiling=tiling)
    reference = pk.grouped_gate_up_reference if fused else pk.grouped_matmul_reference
    compiled = jax.jit(lambda lhs, rhs, sizes, scale: kernel(lhs, rhs, sizes, rhs_scale=scale))
    cases = {name: _sizes(name, rows) for name in ROUTINGS} | {f"random{i}": _random_sizes(rng, rows) for i in range(3)}
    for name, sizes in cases.items():
        out = compiled(lhs, values, sizes, scale)
        want = reference(lhs, values, sizes, scale)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(want), err_msg=f"{name}: {sizes.tolist()}")
        # and the dequantized float32 stack through the plain kernel's reference
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(reference(lhs, quant.dequantized(values, scale), sizes))
        )


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_fp8_rhs_bfloat16_within_rounding(fused):
    """bf16 rows times an FP8 stack quantized from Gaussian weights: the FP8 tiles converted to bf16 exactly, so
    one bf16 rounding of the output from the float32 reference of the same operands."""
    from jaxserve.models import quant

    rows, din, dout, tiling = SHAPES[0]
    rng = np.random.default_rng(2)
    lhs = jnp.asarray(rng.standard_normal((rows, din)), jnp.bfloat16)
    shape = (E, din, 2, dout) if fused else (E, din, dout)
    stack = quant.quantize_experts(
        jnp.asarray(rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 0, shape[:1] + (1,) + shape[2:]))
    )
    kernel = pk.grouped_gate_up if fused else pk.grouped_matmul
    reference = pk.grouped_gate_up_reference if fused else pk.grouped_matmul_reference
    for sizes in (_sizes("ragged", rows), _sizes("one_row_groups", rows), _random_sizes(rng, rows)):
        out = kernel(lhs, stack.values, sizes, rhs_scale=stack.scale, interpret=True, tiling=tiling)
        assert out.dtype == jnp.bfloat16
        want = np.asarray(reference(lhs.astype(jnp.float32), stack.values, sizes, stack.scale))
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


def test_padding_rows_are_not_read():
    """NaN in the padding rows: they come out as zeros, every routed row is finite."""
    rows, din, dout, tiling = SHAPES[0]
    lhs, rhs = _integer_inputs(rows, din, dout, fused=False)
    sizes = _sizes("ragged", rows)
    used = int(sizes.sum())
    out = pk.grouped_matmul(lhs.at[used:].set(jnp.nan), rhs, sizes, interpret=True, tiling=tiling)
    np.testing.assert_array_equal(np.asarray(out[used:]), 0.0)
    np.testing.assert_array_equal(
        np.asarray(out[:used]), np.asarray(pk.grouped_matmul_reference(lhs, rhs, sizes))[:used]
    )


def _offset_reference(lhs, rhs, sizes, row_offset: int, fused: bool) -> np.ndarray:
    """ragged_dot's result with a leading zero group: the rows before row_offset zeros, then the groups."""
    all_sizes = jnp.concatenate([jnp.asarray([max(row_offset, 0)], jnp.int32), sizes])
    zero_first = jnp.concatenate([jnp.zeros_like(rhs[:1]), rhs])
    reference = pk.grouped_gate_up_reference if fused else pk.grouped_matmul_reference
    return np.asarray(reference(lhs, zero_first, all_sizes))


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_row_offset_starts_the_groups_past_a_run_of_zero_rows(fused):
    """An expert-parallel device's call: its experts' group sizes, the groups from row_offset on (a traced
    scalar: one compile for every offset), every other row zero and not read (NaN there); offsets at 0, inside
    and at the end of a tile, past the rows; float32 bit for bit."""
    rows, din, dout, tiling = SHAPES[0]
    lhs, rhs = _integer_inputs(rows, din, dout, fused)
    kernel = jax.jit(
        functools.partial(pk.grouped_gate_up if fused else pk.grouped_matmul, interpret=True, tiling=tiling)
    )
    cases = [(0, [3, 4, 0, 5, 2]), (5, [7, 0, 13, 1, 9]), (16, [16, 0, 0, 0, 1]), (30, [0, 9, 0, 0, 4]), (40, [2] * 5)]
    for row_offset, sizes in cases + [(-3, [1, 2, 3, 4, 5])]:
        sizes = jnp.asarray(sizes, jnp.int32)
        start, end = max(row_offset, 0), min(max(row_offset, 0) + int(sizes.sum()), rows)
        poisoned = lhs.at[:start].set(jnp.nan).at[end:].set(jnp.nan)
        out = np.asarray(kernel(poisoned, rhs, sizes, row_offset=jnp.int32(row_offset)))
        want = _offset_reference(lhs, rhs, sizes, row_offset, fused)
        np.testing.assert_array_equal(out, want, err_msg=f"offset {row_offset}: {sizes.tolist()}")
        assert not out[:start].any() and not out[end:].any()
    # Offset 0 is ragged_dot itself.
    sizes = _sizes("ragged", rows)
    np.testing.assert_array_equal(
        np.asarray(kernel(lhs, rhs, sizes, row_offset=jnp.int32(0))), np.asarray(kernel(lhs, rhs, sizes))
    )
    with pytest.raises(TypeError, match="row_offset must be an int32 scalar"):
        kernel(lhs, rhs, sizes, row_offset=jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_lhs_rows_gather_the_rows_in_the_kernel(fused):
    """lhs_rows (a routed row's token, top-k rows per token): the kernel on the tokens equals it on the gathered
    rows, float32 bit for bit, under routings with padding and with a row offset; the untouched tokens of lhs
    (NaN) are never read, and the index of a padding row is not read either."""
    rows, din, dout, tiling = SHAPES[0]
    tokens = 13
    lhs, rhs = _integer_inputs(tokens + 3, din, dout, fused)
    lhs = lhs.at[tokens:].set(jnp.nan)  # rows no index names
    kernel = jax.jit(
        functools.partial(pk.grouped_gate_up if fused else pk.grouped_matmul, interpret=True, tiling=tiling)
    )
    rng = np.random.default_rng(7)
    for sizes, row_offset in (
        (_sizes("ragged", rows), None),
        (_random_sizes(rng, rows), None),
        (jnp.asarray([3, 0, 9, 1, 2], jnp.int32), 11),
    ):
        token_of_row = rng.integers(0, tokens, rows).astype(np.int32)
        offset = None if row_offset is None else jnp.int32(row_offset)
        start = row_offset or 0
        used = min(start + int(sizes.sum()), rows)
        token_of_row[used:] = tokens + 1  # a padding row's index points at NaN: never read
        gathered = jnp.take(lhs, jnp.asarray(token_of_row), axis=0, mode="clip")
        out = kernel(lhs, rhs, sizes, row_offset=offset, lhs_rows=jnp.asarray(token_of_row))
        assert out.shape == (rows, dout)
        want = kernel(jnp.where(jnp.isnan(gathered), 0.0, gathered), rhs, sizes, row_offset=offset)
        np.testing.assert_array_equal(
            np.asarray(out), np.asarray(want), err_msg=f"{sizes.tolist()} offset {row_offset}"
        )
    with pytest.raises(TypeError, match="lhs_rows must be int32"):
        kernel(lhs, rhs, sizes, lhs_rows=jnp.zeros((rows, 1), jnp.int32))


def test_lhs_rows_into_an_empty_lhs_is_an_error():
    with pytest.raises(ValueError, match="lhs_rows index 3 rows of an empty lhs"):
        pk.grouped_matmul(
            jnp.zeros((0, 16)), jnp.zeros((E, 16, 8)), jnp.zeros(E, jnp.int32), lhs_rows=jnp.zeros(3, jnp.int32)
        )


def test_default_tiling_follows_rows_per_expert():
    assert pk.grouped_matmul(jnp.zeros((0, 16)), jnp.zeros((E, 16, 8)), jnp.zeros(E, jnp.int32)).shape == (0, 8)
    assert moe.default_moe_tiling(64, 128).block_m == 16  # decode: 8 tokens x top-8
    assert moe.default_moe_tiling(8192, 128).block_m == 64
    assert moe.default_moe_tiling(65536, 128).block_m == 128
    assert moe.default_moe_tiling(32768, 128, fused=True).num_stages == 4  # measured best for gate_up there
    assert moe.default_moe_tiling(32768, 128).num_stages == 3


def _python_table(sizes: list[int], rows: int, block_m: int) -> list[tuple[int, int, int]]:
    """(group, row_start, row_end) of each used tile, by a loop over the groups."""
    tiles, start = [], 0
    for g, size in enumerate([*sizes, None]):
        end = rows if size is None else min(start + max(size, 0), rows)
        tiles += [(g, s, end) for s in range(start, end, block_m)]
        start = end
    return tiles


@pytest.mark.parametrize(
    "sizes,rows,block_m",
    [
        ([0, 0, 0], 10, 4),  # only padding: three zero tiles
        ([0, 0, 0], 0, 4),  # no rows, no tiles
        ([1, 1, 1], 3, 16),  # one row each, no padding
        ([4, 4, 5], 13, 4),  # tile-aligned, then a one-row tile
        ([0, 9, 0], 9, 4),  # one group of everything
        ([7, 7, 7], 10, 4),  # past R: the second group cut at R, the third empty
        ([-2, 3, 0], 5, 2),  # negative sizes count as 0
    ],
)
def test_tile_table_edge_cases(sizes, rows, block_m):
    table = moe.tile_table(jnp.asarray(sizes, jnp.int32), rows, block_m)
    want = _python_table(sizes, rows, block_m)
    used = int(table.num_tiles[0])
    got = list(zip(*(np.asarray(a[:used]).tolist() for a in table[:3]), strict=True))
    assert got == want
    assert table.group.shape == (moe.max_tiles(rows, len(sizes), block_m),)
    unused = np.stack([np.asarray(a[used:]) for a in table[:3]])
    assert (unused == np.array([[len(sizes)], [rows], [rows]])).all()


def test_tile_table_with_a_row_offset_leads_with_zero_tiles():
    """A leading run of rows is one more zero group (E) in front; the slots grow by one group's partial tile."""
    sizes, rows, block_m = [3, 0, 5], 13, 4
    table = moe.tile_table(jnp.asarray(sizes, jnp.int32), rows, block_m, jnp.int32(2))
    used = int(table.num_tiles[0])
    got = list(zip(*(np.asarray(a[:used]).tolist() for a in table[:3]), strict=True))
    assert got == [(3, 0, 2), (0, 2, 5), (2, 5, 10), (2, 9, 10), (3, 10, 13)]  # (group, first row, group end)
    assert table.group.shape == (moe.max_tiles(rows, len(sizes) + 1, block_m),)
    assert (np.asarray(table.group[used:]) == len(sizes)).all()


def test_tile_table_random_routings_fit_the_slots():
    rng = np.random.default_rng(0)
    table = jax.jit(moe.tile_table, static_argnames=("num_rows", "block_m"))
    for e, rows, block_m in ((1, 7, 4), (3, 40, 1), (8, 64, 16), (8, 5, 16), (7, 77, 4)):
        for _ in range(20):
            sizes = rng.integers(0, rows + 1, e) * (rng.random(e) < 0.6)
            got = table(jnp.asarray(sizes, jnp.int32), num_rows=rows, block_m=block_m)
            want = _python_table(sizes.tolist(), rows, block_m)
            assert int(got.num_tiles[0]) == len(want) <= moe.max_tiles(rows, e, block_m)
            assert list(zip(*(np.asarray(a[: len(want)]).tolist() for a in got[:3]), strict=True)) == want


@pytest.mark.parametrize(
    "change,error,message",
    [
        (dict(lhs=jnp.zeros((2, 3, 16))), ValueError, r"lhs must be \[R, Din\]"),
        (dict(rhs=jnp.zeros((E, 8, 8))), ValueError, r"rhs must be \[E, Din, Dout\] with lhs's width 16"),
        (dict(group_sizes=jnp.zeros(E + 1, jnp.int32)), ValueError, r"group_sizes must be \[E\]=\[5\]"),
        (dict(group_sizes=jnp.zeros(E, jnp.int16)), TypeError, "group_sizes must be int32"),
        (dict(rhs=jnp.zeros((E, 16, 8), jnp.bfloat16)), TypeError, "must have lhs's dtype"),
        (dict(lhs=jnp.zeros((4, 16), jnp.int32), rhs=jnp.zeros((E, 16, 8), jnp.int32)), TypeError, "lhs dtype"),
        (dict(lhs=jax.ShapeDtypeStruct((1 << 27, 16), jnp.float32)), ValueError, "fewer than 2..31 elements"),
        (dict(rhs=jnp.zeros((E, 16, 8), jnp.float8_e4m3fn)), TypeError, "or be float8_e4m3fn with rhs_scale"),
        (dict(rhs_scale=jnp.ones((E, 8))), TypeError, "rhs must be float8_e4m3fn and rhs_scale float32"),
        (
            dict(rhs=jnp.zeros((E, 16, 8), jnp.float8_e4m3fn), rhs_scale=jnp.ones((E, 16))),
            ValueError,
            r"rhs_scale must be rhs's shape without Din, \[5, 8\]",
        ),
    ],
)
def test_bad_inputs_are_clear_errors(change, error, message):
    args = dict(lhs=jnp.zeros((4, 16)), rhs=jnp.zeros((E, 16, 8)), group_sizes=jnp.zeros(E, jnp.int32))
    args.update(change)
    with pytest.raises(error, match=message):
        pk.grouped_matmul(**args, interpret=True)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(block_m=8), r"block_m must be a power of two in \[16, 256\]"),
        (dict(block_k=96), "block_k must be a power of two"),
        (dict(group_m=0), "group_m must be a power of two"),
        (dict(num_stages=0), r"num_stages must be in \[1, 6\]"),
    ],
)
def test_bad_tiling_is_a_clear_error(fields, message):
    with pytest.raises(ValueError, match=message):
        moe.MoeTiling(**fields)


def test_gate_up_needs_the_pair_axis():
    with pytest.raises(ValueError, match=r"rhs must be \[E, D, 2, F\]"):
        pk.grouped_gate_up(jnp.zeros((4, 16)), jnp.zeros((E, 16, 3, 8)), jnp.zeros(E, jnp.int32), interpret=True)


H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, "fp8"], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["matmul", "gate_up"])
def test_lowers_for_cuda_as_one_launch(fused, dtype, capsys, monkeypatch):
    """Qwen3-30B-A3B's expert shapes at a decode and a prefill bucket: one Triton launch, one dot per weight
    tile in the K loop (two when fused), float32 dots at IEEE precision (no TF32). fp8: bf16 rows and an e4m3
    stack with its scales, each weight tile converted to bf16 before its dot."""
    fp8 = dtype == "fp8"
    dtype = jnp.bfloat16 if fp8 else dtype
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))  # prints the IR
    experts, d, f = 128, 2048, 768
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    kernel = pk.grouped_gate_up if fused else pk.grouped_matmul
    # gate_up also as the model runs it: the rows gathered from the tokens in its loads (lhs_rows).
    for rows, gather in ((64, False), (8192, False)) + (((8192, True),) if fused else ()):
        lhs = jax.ShapeDtypeStruct((rows // 8 if gather else rows, d if fused else f), dtype)
        shape = (experts, d, 2, f) if fused else (experts, f, d)
        rhs = jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn if fp8 else dtype)
        scale = jax.ShapeDtypeStruct(shape[:1] + shape[2:], jnp.float32) if fp8 else None

        def fn(lhs, rhs, sizes, scale, *rows):
            return kernel(lhs, rhs, sizes, lhs_rows=rows[0] if rows else None, rhs_scale=scale)

        capsys.readouterr()
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)):
            exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
                lhs,
                rhs,
                jax.ShapeDtypeStruct((experts,), jnp.int32),
                scale,
                *((jax.ShapeDtypeStruct((rows,), jnp.int32),) if gather else ()),
            )
        assert exported.mlir_module().count("xla.gpu.triton") == 1
        ir = capsys.readouterr().out
        assert f"tt.func public @moe_{'gate_up' if fused else 'matmul'}" in ir
        tiling = moe.default_moe_tiling(rows, experts, fused)
        m, n = tiling.block_m, tiling.block_n
        dots = re.findall(rf"tt.dot .* -> tensor<{m}x{n}xf32>", ir)
        assert len(dots) == (2 if fused else 1), ir
        assert re.findall(r"inputPrecision = (\w+)", ir) == []  # IEEE is the default and not printed
        assert ir.count("scf.for") == 1
        if fp8:  # each e4m3 tile converted to bf16 in registers, the dots of bf16 operands
            assert len(re.findall(r"tt.fp_to_fp .*f8E4M3FN.* -> tensor<\d+x\d+xbf16>", ir)) == (2 if fused else 1), ir
            assert all("bf16" in dot and "f8E4M3FN" not in dot for dot in dots)


def test_docs_example_runs():
    """The example of docs/kernels.md's MoE section, as written: its shapes and its zero padding rows."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    section = text.split("## Mixture-of-experts kernels", 1)[1]
    scope: dict = {}
    exec(section.split("```python", 1)[1].split("```", 1)[0], scope)  # noqa: S102 - our own docs
    h, y, sizes = scope["h"], scope["y"], scope["group_sizes"]
    assert h.shape == (16, 32) and y.shape == (16, 64)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(pk.grouped_matmul_reference(h, scope["w_down"], sizes)))
    assert not np.asarray(y[13:], np.float32).any()

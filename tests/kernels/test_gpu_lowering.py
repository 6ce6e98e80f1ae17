"""The kernels as lowered for an NVIDIA GPU (cross-platform lowering, no GPU needed): float32 dots must
not fall back to TF32, which the Triton lowering picks for DEFAULT precision (a 1e-3 relative error
the interpret-mode tests cannot see).

On a host without a GPU, jax >= 0.11 lowers the Triton kernels only for an abstract GPU device named in
the context mesh (0.10 assumed compute capability 9.0 without being told): an H200 here.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxserve import kernels as pk

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")


def lowered_triton_ir(
    dtype, capsys, monkeypatch, *, decode: bool, head_dim: int = 64, cache_dtype=None, **options
) -> str:
    """The Triton IR of one ragged_paged_attention call lowered for CUDA (pallas_call debug prints it); the KV pool
    in `cache_dtype` (default: q's)."""
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    heads, kv_heads, blocks, block_size = 4, 2, 16, 16
    cu_q_lens = [0, 1, 2] if decode else [0, 5, 8]
    args = (
        jnp.zeros((cu_q_lens[-1], heads, head_dim), dtype),
        jnp.zeros((blocks, block_size, kv_heads, head_dim), cache_dtype or dtype),
        jnp.zeros((blocks, block_size, kv_heads, head_dim), cache_dtype or dtype),
        jnp.zeros((2, 4), jnp.int32),
        jnp.array([5, 3], jnp.int32),
        jnp.array(cu_q_lens, jnp.int32),
        jnp.int32(2),
    )
    fn = jax.jit(lambda *a: pk.ragged_paged_attention(*a, sm_scale=0.125, **options))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    capsys.readouterr()
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H200)):
        jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args)
    return capsys.readouterr().out


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dots_do_not_use_tf32(dtype, decode, capsys, monkeypatch):
    ir = lowered_triton_ir(dtype, capsys, monkeypatch, decode=decode)
    assert ir.count("tt.dot") >= 2, "the Triton IR was not captured"
    assert re.findall(r"inputPrecision = (\w+)", ir) == []  # IEEE is the default and not printed


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
def test_an_fp8_pool_is_converted_to_bf16_before_the_dots(decode, capsys, monkeypatch):
    """An FP8 KV cache on the GPU: K and V load as e4m3, convert to q's bf16 in registers, and every dot takes
    bf16 operands."""
    ir = lowered_triton_ir(jnp.bfloat16, capsys, monkeypatch, decode=decode, cache_dtype=jnp.float8_e4m3fn)
    assert "tt.fp_to_fp" in ir and "f8E4M3FN" in ir
    dots = re.findall(r"tt.dot (.*)", ir)
    assert len(dots) >= 2 and all("f8E4M3FN" not in dot for dot in dots), dots


def _functions(ir: str) -> dict[str, str]:
    """Each kernel's Triton IR by its name (the text from its `tt.func` to the next one)."""
    parts = re.split(r"tt.func public @ragged_paged_attention_(\w+)", ir)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
def test_softmax_uses_the_exp2_instruction(decode, capsys, monkeypatch):
    """The attention kernels' softmax exponentials are ex2.approx.ftz.f32 itself, not libdevice's exp2f."""
    functions = _functions(lowered_triton_ir(jnp.bfloat16, capsys, monkeypatch, decode=decode, num_splits=1))
    assert set(functions) == {"mixed", "decode"}
    for name, body in functions.items():
        assert body.count("ex2.approx.ftz.f32") >= 2, name
        assert "__nv_exp2f" not in body, name


@pytest.mark.parametrize(
    "options",
    [
        dict(num_splits=8),
        dict(num_splits=16, max_q_len=1),
        dict(num_splits=1, max_q_len=1),
        dict(num_splits=4, soft_cap=5.0, sliding_window=8),
        dict(num_splits=8, max_q_len=1, head_dim=80),  # head_dim padded to 128: masked loads and stores
        dict(num_splits=1, max_q_len=1, head_dim=80),
        dict(num_splits=2, decode_block_n=16, max_q_len=1),  # two key tiles per split: the loop path
        dict(num_splits=2, decode_block_n=16),
    ],
)
def test_decode_launches_lower_for_cuda(options, capsys, monkeypatch):
    """Split decode with its combine launch, and decode-only launches that own the output, lower to Triton."""
    ir = lowered_triton_ir(jnp.bfloat16, capsys, monkeypatch, decode=True, **options)
    want = {"decode"} if options["num_splits"] == 1 else {"decode_split", "combine"}
    if options.get("max_q_len") != 1:
        want.add("mixed")
    assert set(re.findall(r"tt.func public @ragged_paged_attention_(\w+)", ir)) == want

"""The adapter tables' writer (`jaxserve/models/lora.py` `LoraTableWriter`) takes an adapter in the dtype and layout it
came in: PEFT's layout or qwix's transposed one, float32 or bfloat16, numpy or jax arrays on the device. Every kind
writes the same tables as a float32 PEFT adapter of the same values; a kind compiles its writes once, when prepared,
and never again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve import lora as host_lora
from jaxserve.models import lora, registry, shapes
from jaxserve.models.common import ParamSpec
from jaxserve.sharding.rules import LOGICAL_AXIS_RULES, MODEL_AXIS, named_shardings

MAX_RANK, RANK = 4, 3  # an adapter below the tables' rank: the padded path
ALPHA = 6.0  # scaling 2.0


@pytest.fixture(scope="module")
def setup():
    family, cfg = registry.resolve(shapes.shape("tiny-llama"))
    specs = family.serving_specs(cfg)
    table_specs = lora.table_specs(specs, max_loras=2, max_rank=MAX_RANK)
    mesh = Mesh(np.array(jax.devices()[:1]), (MODEL_AXIS,))
    shardings = named_shardings(table_specs, mesh, LOGICAL_AXIS_RULES)
    zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, jnp.bfloat16), table_specs, is_leaf=lambda x: isinstance(x, ParamSpec)
    )
    return lora.module_sites(specs), shardings, zeros


def _peft_tensors(sites, dtype) -> dict[str, np.ndarray]:
    """A random adapter on every module, its values bfloat16 numbers (every kind holds them exactly)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for (layer, module), site in sites.items():
        parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
        a = rng.standard_normal((RANK, int(np.prod(site.in_shape))), np.float32)
        b = rng.standard_normal((site.out_width, RANK), np.float32)
        tensors[f"{name}.lora_A.weight"] = a.astype(ml_dtypes.bfloat16).astype(dtype)
        tensors[f"{name}.lora_B.weight"] = b.astype(ml_dtypes.bfloat16).astype(dtype)
    return tensors


def _qwix_tree(peft_tensors: dict[str, np.ndarray], to_device: bool) -> dict[str, object]:
    """The same adapter as a tunix Llama's qwix parameters: A [in, r], B [r, out]."""
    tree = {}
    for name, value in peft_tensors.items():
        if name.endswith("lora_B.weight"):
            continue
        stem = name.removeprefix("base_model.model.model.").removesuffix(".lora_A.weight")
        layer, parent, module = stem.split(".")[1:]
        kind = "attn" if parent == "self_attn" else "mlp"
        param = "w" if kind == "attn" else "kernel"
        a, b = value.T, peft_tensors[name.replace("lora_A", "lora_B")].T
        if to_device:
            a, b = jnp.asarray(a), jnp.asarray(b)
        tree[f"layers.{layer}.{kind}.{module}.{param}_lora_a"] = a
        tree[f"layers.{layer}.{kind}.{module}.{param}_lora_b"] = b
    return tree


def _slot(tables, slot: int) -> list[np.ndarray]:
    """One slot of every table: a [*in, S, P*R] and b [S, P*R, *out]."""
    out = []
    for table in jax.tree.leaves(tables, is_leaf=lambda x: isinstance(x, lora.LoraTable)):
        out += [np.asarray(table.a[..., slot, :], np.float32), np.asarray(table.b[slot], np.float32)]
    return out


def test_every_kind_of_adapter_writes_the_same_tables(setup, record_compiles):
    sites, shardings, zeros = setup
    writer = lora.LoraTableWriter(sites, shardings, MAX_RANK)
    tables = writer.warm(jax.tree.map(jnp.copy, zeros))
    config = {"r": RANK, "lora_alpha": ALPHA}
    reference = host_lora.from_peft("f32", _peft_tensors(sites, np.float32), config)
    assert reference.dtype == np.float32 and not reference.transposed
    tables = writer.write(tables, 1, reference.weights, reference.scaling)
    expected = _slot(tables, 1)
    assert all(np.any(x) for x in expected), "a table the adapter targets is still zero: a weak test"

    bf16 = _peft_tensors(sites, ml_dtypes.bfloat16)
    kinds = {
        "peft bf16": host_lora.from_peft("bf16", bf16, config),
        "qwix f32": host_lora.from_qwix("q32", _qwix_tree(_peft_tensors(sites, np.float32), False), config),
        "qwix bf16 on the device": host_lora.from_qwix("q16", _qwix_tree(bf16, True), config),
    }
    for kind, adapter in kinds.items():
        assert adapter.peft_shapes() == reference.peft_shapes(), kind
        tables = writer.write(tables, 1, None)  # the slot emptied: the write below fills it again
        assert not any(np.any(x) for x in _slot(tables, 1))
        tables = writer.prepare(tables, adapter.dtype, transposed=adapter.transposed)
        with record_compiles() as compiled:
            tables = writer.write(tables, 1, adapter.weights, adapter.scaling, transposed=adapter.transposed)
            tables = writer.write(tables, 2, adapter.weights, adapter.scaling, transposed=adapter.transposed)
        assert not compiled, f"{kind}: a prepared kind's writes compiled: {compiled}"
        for got, want in zip(_slot(tables, 1), expected, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=kind)
    assert kinds["peft bf16"].dtype == ml_dtypes.bfloat16 and kinds["qwix f32"].transposed
    # Arrays on the device come to the host in their dtype: nothing is cast to float32 there.
    assert kinds["qwix bf16 on the device"].dtype == ml_dtypes.bfloat16


def test_an_adapter_of_mixed_dtypes_is_read_as_float32(setup):
    sites, _, _ = setup
    tensors = _peft_tensors(sites, np.float32)
    first = next(iter(tensors))
    tensors[first] = tensors[first].astype(ml_dtypes.bfloat16)
    adapter = host_lora.from_peft("mixed", tensors, {"r": RANK, "lora_alpha": ALPHA})
    assert {array.dtype for pair in adapter.weights.values() for array in pair} == {np.dtype(np.float32)}
    float16 = host_lora.from_peft("f16", _peft_tensors(sites, np.float16), {"r": RANK, "lora_alpha": ALPHA})
    assert float16.dtype == np.float32

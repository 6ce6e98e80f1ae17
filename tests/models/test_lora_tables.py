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
    writer = lora.LoraTableWriter(sites, MAX_RANK)
    _, tables = writer.warm((None, jax.device_put(jax.tree.map(jnp.copy, zeros), shardings)))
    config = {"r": RANK, "lora_alpha": ALPHA}
    reference = host_lora.from_peft("f32", _peft_tensors(sites, np.float32), config)
    assert reference.dtype == np.float32 and not reference.transposed
    _, tables = writer.write((None, tables), 1, reference.weights, reference.scaling)
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
        _, tables = writer.write((None, tables), 1, None)  # the slot emptied: the write below fills it again
        assert not any(np.any(x) for x in _slot(tables, 1))
        _, tables = writer.prepare((None, tables), adapter.dtype, transposed=adapter.transposed)
        with record_compiles() as compiled:
            _, tables = writer.write((None, tables), 1, adapter.weights, adapter.scaling, transposed=adapter.transposed)
            _, tables = writer.write((None, tables), 2, adapter.weights, adapter.scaling, transposed=adapter.transposed)
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


@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize(
    "spec, w_shape, a_shape, b_shape",
    [
        ("td,dkge->tkge", (16, 2, 4, 8), (16, 4, 3 * 2), (4, 3 * 2, 2, 4, 8)),  # wqkv: three modules, rank 2
        ("the,hed->td", (4, 8, 16), (4, 8, 4, 2), (4, 2, 16)),  # wo: two input axes
    ],
)
def test_a_folded_into_the_weight_gives_the_separate_tables_product(rows, spec, w_shape, a_shape, b_shape):
    """`quant.linear` of a `FoldedWeight` (a beside w, one GEMM) equals it with separate tables and the float32
    product written out (x @ w plus each row's own slot of x @ a @ b)."""
    from jaxserve.models import quant

    rng = np.random.default_rng(rows)
    w, a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (w_shape, a_shape, b_shape))
    x = jnp.asarray(rng.standard_normal((rows, *a_shape[: a.ndim - 2])), jnp.float32)
    slots = rng.integers(0, a_shape[-2], rows)
    onehot = jax.nn.one_hot(slots, a_shape[-2], dtype=jnp.float32)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    folded = lora._folder(sharding)(w, a)
    assert folded.values.shape == (*w_shape[: a.ndim - 2], np.prod(w_shape[a.ndim - 2 :]) + np.prod(a_shape[-2:]))
    got = quant.linear(spec, x, lora.LoraLinear(folded, None, b, onehot))
    separate = quant.linear(spec, x, lora.LoraLinear(w, a, b, onehot))
    num_in = a.ndim - 2
    x2 = np.asarray(x, np.float64).reshape(rows, -1)
    a2, b2 = np.asarray(a, np.float64).reshape(x2.shape[1], *a_shape[-2:]), np.asarray(b, np.float64)
    want = x2 @ np.asarray(w, np.float64).reshape(x2.shape[1], -1)
    want = want + np.stack([(x2[t] @ a2[:, s]) @ b2[s].reshape(b_shape[1], -1) for t, s in enumerate(slots)])
    want = want.reshape(rows, *w_shape[num_in:])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(separate), want, rtol=1e-5, atol=1e-4)

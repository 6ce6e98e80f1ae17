"""The rules table: logical axes -> PartitionSpec, with replication when a dimension does not divide."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jaxserve.models.common import ParamSpec
from jaxserve.sharding.mesh import make_mesh, serving_mesh
from jaxserve.sharding.rules import layer_shardings, partition_spec, shard_bytes, shard_shape

TP4 = {"data": 1, "model": 4}  # a mesh's axis sizes: all the arithmetic needs


def test_heads_and_mlp_split_over_model():
    assert partition_spec(ParamSpec((2, 64, 8, 16), ("layers", "embed", "heads", "head_dim")), TP4) == PartitionSpec(
        None, None, "model", None
    )
    assert partition_spec(ParamSpec((2, 64, 256), ("layers", "embed", "mlp")), TP4) == PartitionSpec(
        None, None, "model"
    )
    assert partition_spec(ParamSpec((2, 256, 64), ("layers", "mlp", "embed")), TP4) == PartitionSpec(
        None, "model", None
    )


def test_indivisible_dimension_is_replicated_and_logged(caplog):
    spec = ParamSpec((2, 64, 3, 16), ("layers", "embed", "kv_heads", "head_dim"))  # 3 kv heads on tp=4
    with caplog.at_level(logging.INFO, logger="jaxserve.sharding.rules"):
        assert partition_spec(spec, TP4, "wk") == PartitionSpec(None, None, None, None)
    assert "wk" in caplog.text and "kv_heads" in caplog.text


def test_one_mesh_axis_splits_one_dimension_only():
    spec = ParamSpec((64, 256), ("vocab", "mlp"))
    assert partition_spec(spec, TP4) == PartitionSpec("model", None)


def test_unknown_logical_axis_is_an_error():
    with pytest.raises(ValueError, match="unknown logical axis 'heads_typo'"):
        partition_spec(ParamSpec((4,), ("heads_typo",)), TP4)


def test_param_spec_rank_mismatch_is_an_error():
    with pytest.raises(ValueError, match="differ in rank"):
        ParamSpec((4, 4), ("embed",))


def test_make_mesh_names_missing_devices():
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(tp=64)
    mesh = make_mesh(tp=1)
    assert mesh.axis_names == ("data", "model")


def test_shard_shape_and_bytes_of_one_device():
    pool = ParamSpec((2, 10, 16, 8, 64), ("layers", None, None, "kv_heads", "head_dim"))
    assert shard_shape(pool, TP4) == (2, 10, 16, 2, 64)
    assert shard_bytes(pool, TP4, itemsize=2) == 2 * 10 * 16 * 2 * 64 * 2
    replicated = ParamSpec((2, 10, 16, 3, 64), ("layers", None, None, "kv_heads", "head_dim"))
    assert shard_shape(replicated, TP4) == replicated.shape


def one_device_mesh(*names: str) -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def test_a_callers_mesh_becomes_data_and_model_over_the_same_devices():
    trainer = one_device_mesh("fsdp", "tp")
    assert serving_mesh(trainer, {"model": "tp"}).axis_names == ("data", "model")
    assert serving_mesh(one_device_mesh("data", "model")).shape == {"data": 1, "model": 1}
    replicated = serving_mesh(one_device_mesh("replica", "fsdp", "sequence"), {"model": None})
    assert replicated.shape == {"data": 1, "model": 1} and replicated.devices.flat[0] == jax.devices()[0]


TRAINER = one_device_mesh("fsdp", "tp")
FOUND = "(the mesh's axes: {'fsdp': 1, 'tp': 1})"


@pytest.mark.parametrize(
    ("mesh", "axes", "error", "message"),
    [
        (TRAINER, None, ValueError, f"the mesh has no 'model' axis to split the model over {FOUND}"),
        (TRAINER, {"model": "tensor"}, ValueError, f"mesh_axes['model'] = 'tensor' is not an axis of the mesh {FOUND}"),
        (TRAINER, {"data": "fsdp", "model": "tp"}, ValueError, "got the keys ['data', 'model']"),
        (TRAINER, {}, ValueError, "mesh_axes maps the engine's one sharded axis, 'model'"),
        (TRAINER, "tp", TypeError, "mesh_axes must be a dict"),
        ("data,model", None, TypeError, "mesh must be a jax.sharding.Mesh, got str"),
    ],
    ids=["no-model-axis", "unknown-axis", "data-key", "empty", "axes-str", "mesh-str"],
)
def test_a_mesh_the_engine_cannot_map_is_a_clear_error(mesh, axes, error, message):
    with pytest.raises(error) as raised:
        serving_mesh(mesh, axes)
    assert message in str(raised.value), str(raised.value)


def test_one_layer_of_stacked_weights_drops_the_layers_axis():
    stacked = {"w": ParamSpec((2, 64, 8), ("layers", "embed", "mlp"))}
    assert layer_shardings(stacked, make_mesh())["w"].spec == PartitionSpec(None, "model")
    with pytest.raises(ValueError, match="first logical axis 'layers'"):
        layer_shardings({"w": ParamSpec((64,), ("embed",))}, make_mesh())

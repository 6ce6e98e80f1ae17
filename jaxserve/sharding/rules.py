"""Logical axes -> mesh axes: the one rules table that decides how every weight, the KV cache and the
attention kernels' per-device operands are split. Mixture-of-experts weights are split by their hidden (tensor-
parallel experts, the default table) or by expert (`EXPERT_PARALLEL_RULES`, which the functions here take as
`rules`).

A model declares each weight's logical axes once (`jaxserve.models.common.ParamSpec`), and so does the KV
pool (`jaxserve.models.attention.paged_cache_specs`); this module maps them onto the mesh. A dimension that
does not divide evenly over its mesh axis is replicated instead (e.g. 3 kv heads on tp=4), and that
fallback is logged, never silent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxserve.models.common import ParamSpec
from jaxserve.sharding.mesh import MODEL_AXIS

logger = logging.getLogger(__name__)

# Megatron-style tensor parallelism: heads and MLP hidden split over "model"; the residual stream
# ("embed") stays whole on every device so norms need no communication; the vocabulary is split so
# the embedding table and lm_head are not replicated tp times. Experts are tensor-parallel: every device
# holds a slice of every expert's hidden ("mlp"), as of a dense MLP.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "layers": None,
    "vocab": MODEL_AXIS,
    "embed": None,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "experts": None,
    "lora": None,  # adapter slots (models/lora.py): every device holds every slot of its share of the table
}
# Expert parallelism: each device holds E / tp whole experts. An expert weight's "experts" dimension comes
# before its "mlp" one and takes the model axis, so "mlp" stays whole there (one mesh axis splits one
# dimension of a tensor); dense MLPs and attention are split as above.
EXPERT_PARALLEL_RULES: dict[str, str | None] = {**LOGICAL_AXIS_RULES, "experts": MODEL_AXIS}
Rules = Mapping[str, str | None]


def rules_table(expert_parallel: bool) -> Rules:
    """The table of an engine's experts' layout (`EngineConfig.enable_expert_parallel` as resolved): whole experts
    over the model axis, or each expert's hidden."""
    return EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_AXIS_RULES


def partition_spec(
    spec: ParamSpec, mesh: Mesh | AbstractMesh | Mapping[str, int], name: str = "", rules: Rules | None = None
) -> PartitionSpec:
    """The PartitionSpec of one weight; dimensions that do not divide their mesh axis are replicated.

    mesh: a Mesh or AbstractMesh, or its axis sizes ({"data": 1, "model": 4}) where only the arithmetic
    is wanted. rules: the rules table (None: LOGICAL_AXIS_RULES; EXPERT_PARALLEL_RULES for expert parallelism).
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    sizes = _axis_sizes(mesh)
    axes: list[str | None] = []
    for dim, logical in zip(spec.shape, spec.logical_axes, strict=True):
        if logical is not None and logical not in rules:
            raise ValueError(f"unknown logical axis {logical!r} in {name or spec}; known: {sorted(rules)}")
        mesh_axis = rules.get(logical) if logical is not None else None
        if mesh_axis is not None and mesh_axis in axes:
            mesh_axis = None  # a mesh axis may split only one dimension of a tensor
        if mesh_axis is not None and dim % sizes[mesh_axis] != 0:
            logger.info(
                "replicating %s dimension %r (size %d) instead of splitting it over %d %r devices",
                name or "weight",
                logical,
                dim,
                sizes[mesh_axis],
                mesh_axis,
            )
            mesh_axis = None
        axes.append(mesh_axis)
    return PartitionSpec(*axes)


def shard_shape(
    spec: ParamSpec, mesh: Mesh | AbstractMesh | Mapping[str, int], rules: Rules | None = None
) -> tuple[int, ...]:
    """The shape of one device's shard of a tensor declared by `spec`."""
    sizes = _axis_sizes(mesh)
    split = partition_spec(spec, mesh, rules=rules)
    return tuple(dim // (sizes[axis] if axis is not None else 1) for dim, axis in zip(spec.shape, split, strict=True))


def _axis_sizes(mesh: Mesh | AbstractMesh | Mapping[str, int]) -> Mapping[str, int]:
    return mesh if isinstance(mesh, Mapping) else mesh.shape


def shard_bytes(
    spec: ParamSpec, mesh: Mesh | AbstractMesh | Mapping[str, int], itemsize: int, rules: Rules | None = None
) -> int:
    """Bytes of one device's shard of a tensor declared by `spec`."""
    return math.prod(shard_shape(spec, mesh, rules)) * itemsize


def named_shardings(specs: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """A tree of NamedSharding parallel to a tree of ParamSpec leaves, split by `rules` (None: LOGICAL_AXIS_RULES)."""
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    treedef = jax.tree_util.tree_structure(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    shardings = [
        NamedSharding(mesh, partition_spec(spec, mesh, jax.tree_util.keystr(path), rules)) for path, spec in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def layer_shardings(stacked_specs: Any, mesh: Mesh) -> Any:
    """A tree of NamedSharding for one layer of stacked weights: `stacked_specs` (ParamSpec leaves whose
    first axis is "layers") with that axis dropped."""

    def one_layer(spec: ParamSpec) -> ParamSpec:
        if spec.logical_axes[:1] != ("layers",):
            raise ValueError(f"expected a stacked weight (first logical axis 'layers'), got {spec}")
        return ParamSpec(spec.shape[1:], spec.logical_axes[1:])

    return named_shardings(jax.tree.map(one_layer, stacked_specs, is_leaf=lambda x: isinstance(x, ParamSpec)), mesh)


def shard_weights(weights: Any, specs: Any, mesh: Mesh) -> Any:
    """Place a weights pytree on the mesh according to its ParamSpec tree."""
    return jax.device_put(weights, named_shardings(specs, mesh))

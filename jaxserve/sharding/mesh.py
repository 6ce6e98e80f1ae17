"""Device meshes: one place that names the mesh axes every other part shards over.

A mesh has two axes: "data" (replicas of the model serving different sequences) and "model"
(tensor parallelism: attention heads, kv heads and MLP hidden split across devices). A caller's mesh
(a trainer's, with its own axis names) becomes such a mesh over the same devices with `serving_mesh`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA_AXIS = "data"
MODEL_AXIS = "model"
MESH_AXES = (DATA_AXIS, MODEL_AXIS)


def make_mesh(tp: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (dp, tp) mesh over the first dp * tp devices (all local devices by default).

    Devices are laid out so that the "model" axis is the fastest-varying one: tensor-parallel
    peers are neighbours (on one host, the GPUs with the fastest links between them).
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    available = list(devices) if devices is not None else jax.devices()
    needed = tp * dp
    if needed > len(available):
        raise ValueError(
            f"a mesh of dp={dp} x tp={tp} needs {needed} devices, but only {len(available)} are available "
            f"({available[0].platform}); lower tp/dp, or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before jax starts"
        )
    grid = np.array(available[:needed], dtype=object).reshape(dp, tp)
    return Mesh(grid, MESH_AXES)


def serving_mesh(mesh: Mesh, axes: Mapping[str, str | None] | None = None) -> Mesh:
    """The engine's ("data", "model") mesh over the devices of a caller's mesh (a trainer's).

    axes: the engine's axis -> the name of the caller's axis it is, e.g. {"model": "tp"}; None means the
    caller's mesh names its tensor-parallel axis "model". {"model": None}: no tensor parallelism (the
    weights replicate on every device). The "model" axis keeps its devices as tensor-parallel peers;
    every other axis of the caller's mesh ("data", "fsdp", ...) is folded into "data", over which the
    weights and the KV cache replicate.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    found = f"the mesh's axes: {dict(mesh.shape)}"
    if axes is None:
        if MODEL_AXIS not in mesh.axis_names:
            raise ValueError(
                f"the mesh has no {MODEL_AXIS!r} axis to split the model over ({found}): name its tensor-parallel "
                f"axis with mesh_axes={{{MODEL_AXIS!r}: <axis>}}, or mesh_axes={{{MODEL_AXIS!r}: None}} to replicate "
                "the weights on every device"
            )
        axes = {MODEL_AXIS: MODEL_AXIS}
    if not isinstance(axes, Mapping):
        raise TypeError(f"mesh_axes must be a dict like {{{MODEL_AXIS!r}: 'tp'}}, got {type(axes).__name__}")
    unknown = sorted(set(axes) - {MODEL_AXIS})
    if unknown or MODEL_AXIS not in axes:
        raise ValueError(
            f"mesh_axes maps the engine's one sharded axis, {MODEL_AXIS!r} (tensor parallelism), to an axis of "
            f"the mesh; got the keys {sorted(axes, key=str)}. Every other mesh axis replicates the weights"
        )
    model = axes[MODEL_AXIS]
    if model is not None and model not in mesh.axis_names:
        raise ValueError(f"mesh_axes[{MODEL_AXIS!r}] = {model!r} is not an axis of the mesh ({found})")
    names = list(mesh.axis_names)
    order = [i for i, name in enumerate(names) if name != model] + ([names.index(model)] if model is not None else [])
    tp = mesh.shape[model] if model is not None else 1
    return Mesh(mesh.devices.transpose(order).reshape(-1, tp), MESH_AXES)

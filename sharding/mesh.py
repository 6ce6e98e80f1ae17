"""Device meshes: one place that names the mesh axes every other part shards over.

A mesh has two axes: "data" (replicas of the model serving different sequences) and "model"
(tensor parallelism: attention heads, kv heads and MLP hidden split across devices).
"""

from __future__ import annotations

from collections.abc import Sequence

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

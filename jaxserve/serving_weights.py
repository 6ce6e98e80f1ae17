"""The model's weights in the family's serving layout on the mesh, and their moves between uses: placed from
the checkpoint layout, offloaded to host memory and reloaded (sleep level 1), discarded (sleep level 2), and
replaced by new values in place (`update`), with the same shardings and dtype, so the compiled steps take
them as they are.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve.models.common import delete_arrays
from jaxserve.sharding.rules import named_shardings
from jaxserve.step import RunnerSpec


class ServingWeights:
    """arrays: the device weights (None while offloaded or discarded); abstract: their shapes, dtypes and
    shardings, which the step table compiles for."""

    def __init__(self, spec: RunnerSpec, weights: Any, mesh: Mesh) -> None:
        self._family, self._cfg, self._dtype = spec.family, spec.cfg, spec.dtype
        # The checkpoint layout in, the family's serving layout on the mesh, split by the spec's rules table.
        self._quantization = dict(quantization=spec.quantization, quantize_lm_head=spec.quantize_lm_head)
        specs = spec.family.serving_specs(spec.cfg, **self._quantization)
        self.shardings = named_shardings(specs, mesh, spec.rules)
        self.arrays: Any = spec.family.to_serving(weights, spec.cfg, self.shardings, spec.dtype, **self._quantization)
        self.abstract = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding), self.arrays)
        self._host: Any = None  # the weights while offloaded (`offload`)

    @property
    def on_device(self) -> bool:
        return self.arrays is not None

    @property
    def on_host(self) -> bool:
        return self._host is not None

    def update(self, weights: Any) -> None:
        """New values for every weight (checkpoint layout, validated by the caller: same shapes), placed
        where the old ones were, with the same dtype and quantization (an FP8 engine quantizes them again).
        The old buffers (if any: none after `discard`) are deleted layer by layer as the new ones are built."""
        old, self.arrays, self._host = self.arrays, None, None
        self.arrays = self._family.to_serving(
            weights, self._cfg, self.shardings, self._dtype, replacing=old, **self._quantization
        )

    def offload(self) -> None:
        """Moves the weights to host memory (numpy) and frees their device buffers; `reload` puts them back
        where they were."""
        self._host = jax.device_get(self.arrays)
        delete_arrays(self.arrays)
        self.arrays = None

    def reload(self) -> None:
        self.arrays = jax.device_put(self._host, self.shardings)
        self._host = None

    def discard(self) -> None:
        """Frees the weights' device buffers without a copy; `update` brings new ones."""
        delete_arrays(self.arrays)
        self.arrays, self._host = None, None

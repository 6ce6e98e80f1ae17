"""The model's weights in the family's serving layout on the mesh, and their moves between uses: placed from
the checkpoint layout, offloaded to host memory and reloaded (sleep level 1), discarded (sleep level 2), and
replaced by new values in place (`update`), with the same shardings and dtype, so the compiled steps take
them as they are. With LoRA adapters (`RunnerSpec.lora`), their slot tables beside them (`jaxserve/models/lora.py`):
zeros at start, one slot written at a time (`write_adapter`) without compiling anything; on one device with
unquantized weights the tables' a folded into the weights (`lora.fold`), kept apart while the weights are replaced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.lora import LoraAdapter
from jaxserve.models import lora
from jaxserve.models.common import ParamSpec, delete_arrays
from jaxserve.sharding.rules import named_shardings
from jaxserve.step import RunnerSpec, StepWeights


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
        self._host: Any = None  # the weights while offloaded (`offload`)
        self.lora: Any = None  # the adapter tables (None without adapters, or while on the host: `_lora_host`)
        self._lora_host: Any = None
        self._folded = False  # the tables' a folded into the weights (`lora.fold`)
        if spec.lora is not None:
            self._start_adapters(spec, mesh)
        self.abstract = jax.tree.map(
            lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding), self.step_weights
        )

    def _start_adapters(self, spec: RunnerSpec, mesh: Mesh) -> None:
        """Zeroed adapter tables on the mesh, split as the weights they sit beside (the specs of the unquantized
        linears: the tables stay in the serving dtype), folded into the weights where they can be (`lora.fold`:
        unquantized weights on one device, unless LoraConfig.fold is off), and their writer, its updates compiled
        now."""
        plain_specs = spec.family.serving_specs(spec.cfg)
        specs = lora.table_specs(plain_specs, spec.lora.max_loras, spec.lora.max_lora_rank)
        self._table_shardings = named_shardings(specs, mesh, spec.rules)
        self.lora = jax.jit(
            lambda: jax.tree.map(
                lambda s: jnp.zeros(s.shape, spec.dtype), specs, is_leaf=lambda x: isinstance(x, ParamSpec)
            ),
            out_shardings=self._table_shardings,
        )()
        self._folded = spec.lora.fold and mesh.size == 1 and spec.quantization is None
        self._folded_sharding = NamedSharding(mesh, PartitionSpec())
        if self._folded:
            self.arrays, self.lora = lora.fold(self.arrays, self.lora, self._folded_sharding)
        self._lora_writer = lora.LoraTableWriter(lora.module_sites(plain_specs), spec.lora.max_lora_rank)
        self.arrays, self.lora = self._lora_writer.warm((self.arrays, self.lora))

    def check_adapter(self, adapter: LoraAdapter) -> None:
        """ValueError unless an adapter's (layer, module) -> (A, B) weights fit the model and the tables
        (`lora.check_adapter`)."""
        writer = self._lora_writer
        lora.check_adapter(adapter.peft_shapes(), writer.sites, writer.max_rank)

    def prepare_adapter(self, adapter: LoraAdapter) -> None:
        """Compiles the slot writes for an adapter's kind (dtype and layout) unless compiled before (float32 in
        PEFT's layout at start): its writes, and those of every later adapter of its kind, compile nothing."""
        self.arrays, self.lora = self._lora_writer.prepare(
            (self.arrays, self.lora), adapter.dtype, transposed=adapter.transposed
        )

    def write_adapter(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Writes an adapter (None: zeros, no adapter) into one slot of the tables (folded ones: into the weights'
        a columns); compiles nothing for an adapter prepared (`prepare_adapter`)."""
        both = (self.arrays, self.lora)
        if adapter is None:
            self.arrays, self.lora = self._lora_writer.write(both, slot, None)
        else:
            self.arrays, self.lora = self._lora_writer.write(
                both, slot, adapter.weights, adapter.scaling, transposed=adapter.transposed
            )

    @property
    def step_weights(self) -> StepWeights:
        """What the compiled forwards take: the serving weights and the adapter tables."""
        return StepWeights(self.arrays, self.lora)

    @property
    def on_device(self) -> bool:
        return self.arrays is not None

    @property
    def on_host(self) -> bool:
        return self._host is not None

    def update(self, weights: Any) -> None:
        """New values for every weight (checkpoint layout, validated by the caller: same shapes), placed
        where the old ones were, with the same dtype and quantization (an FP8 engine quantizes them again).
        The old buffers (if any: none after `discard`) are deleted layer by layer as the new ones are built.
        Folded adapter tables are copied out of the old weights first and folded into the new ones."""
        self._unfold_adapters()
        old, self.arrays, self._host = self.arrays, None, None
        self.arrays = self._family.to_serving(
            weights, self._cfg, self.shardings, self._dtype, replacing=old, **self._quantization
        )
        self._reload_adapters()
        if self._folded:
            self.arrays, self.lora = lora.fold(self.arrays, self.lora, self._folded_sharding)

    def offload(self) -> None:
        """Moves the weights to host memory (numpy) and frees their device buffers; `reload` puts them back
        where they were."""
        self._host = jax.device_get(self.arrays)
        delete_arrays(self.arrays)
        self.arrays = None
        self._offload_adapters()

    def reload(self) -> None:
        self.arrays = jax.device_put(self._host, jax.tree.map(lambda x: x.sharding, self.abstract.model))
        self._host = None
        self._reload_adapters()

    def discard(self) -> None:
        """Frees the weights' device buffers without a copy; `update` brings new ones. The adapter tables (not the
        model's weights: an update brings none; folded ones copied out of the weights first) go to host memory, and
        come back with the weights."""
        self._unfold_adapters()
        delete_arrays(self.arrays)
        self.arrays, self._host = None, None
        self._offload_adapters()

    def close(self) -> None:
        """Frees every device buffer, the weights and the adapter tables, without a copy to the host."""
        delete_arrays(self.arrays)
        if self.lora is not None:
            delete_arrays(self.lora)
        self.arrays, self._host, self.lora, self._lora_host = None, None, None, None

    def _unfold_adapters(self) -> None:
        """Folded tables get their a back, copied out of the weights (or of their host copy while offloaded), before
        the weights are replaced or discarded."""
        if not self._folded:
            return
        if self.arrays is not None:
            self.lora = lora.unfolded_tables(self.arrays, self.lora, self._table_shardings)
        elif self._host is not None:
            self._lora_host = lora.unfolded_tables(self._host, self._lora_host, None)
            self._lora_host_shardings = self._table_shardings

    def _offload_adapters(self) -> None:
        if self.lora is not None:
            self._lora_host_shardings = jax.tree.map(lambda x: x.sharding, self.lora)
            self._lora_host = jax.device_get(self.lora)
            delete_arrays(self.lora)
            self.lora = None

    def _reload_adapters(self) -> None:
        """The tables back from host memory where they were (folded ones after `discard` with their a, which
        `update` folds again)."""
        if self._lora_host is not None:
            self.lora, self._lora_host = jax.device_put(self._lora_host, self._lora_host_shardings), None

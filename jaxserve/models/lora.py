"""LoRA adapters on the device: a fixed table of adapter slots beside each targeted linear weight, and the low-rank
product every projection adds for the tokens of adapted requests.

A serving layer declares which checkpoint modules each of its linears holds, `LORA_MODULES` (llama, gemma: wqkv ->
q/k/v, wo -> o, w_gate_up -> gate/up, w_down -> down; an MoE layer its attention's only). For a linear [*in, *out]
holding P modules the table is a pair (`LoraTable`):

    a [S, *in, P*R]   module p's A in columns p*R : (p+1)*R
    b [S, P*R, *out]  module p's B in rows p*R : (p+1)*R, at that module's place in the fused output (zeros elsewhere)

S = max_loras + 1 slots: slot 0 is the base model (all zeros), adapters take slots 1..max_loras. R =
max_lora_rank: a smaller rank fills its first rows and columns, the rest stay zero. The adapter's scaling (alpha /
r, or alpha / sqrt(r) with rsLoRA) is folded into b, so the product is plain.

A step's tokens each name their request's slot (`StepInputs.lora_slots`, 0 for base rows and padding); `bind`
wraps each targeted weight of the step's layers in a `LoraLinear` with the one-hot of those slots, and
`quant.linear` adds `lora_delta` to the base product:

    xa = einsum(x, a)            [T, S, P*R]   every slot's A for every token (S*P*R columns: a thin GEMM)
    delta = einsum(xa * onehot, b)              each token keeps its own slot's columns, then one GEMM with B

Writing a slot (`LoraTableWriter`) is one jitted update of the whole table, compiled once at start: loading,
replacing or unloading an adapter compiles nothing.

Legend beyond docs' (STYLE.md): S adapter slots, R the table's rank, P the modules a fused linear holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# The Hugging Face (PEFT) module names an adapter may target, in the order a fused linear holds them.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LoraTable:
    """One linear's adapter slots: a [S, *in, P*R], b [S, P*R, *out] (module docstring)."""

    a: Array
    b: Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LoraLinear:
    """A linear weight of one step with its adapter table and the step's tokens' slots (one-hot [T, S]):
    `quant.linear` computes the base product (`base`: an array or an `Fp8Weight`) plus `lora_delta`."""

    base: Any
    a: Array
    b: Array
    onehot: Float[Array, "T S"]


def lora_delta(spec: str, x: Array, w: LoraLinear) -> Array:
    """The adapters' share of einsum(spec, x, base) for each token of x (its slot's x @ A @ B), in x's dtype."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    num_in = w.a.ndim - 2
    w_in, w_out = w_axes[:num_in], w_axes[num_in:]
    rows = x_axes[: len(x_axes) - num_in]
    s, r = [c for c in "zyxwvu" if c not in spec][:2]  # two letters the spec does not use: slots, rank
    xa = jnp.einsum(f"{x_axes},{s}{w_in}{r}->{rows}{s}{r}", x, w.a, preferred_element_type=jnp.float32)
    xa = (xa * w.onehot[..., None]).astype(x.dtype)
    return jnp.einsum(f"{rows}{s}{r},{s}{r}{w_out}->{out}", xa, w.b, preferred_element_type=jnp.float32).astype(x.dtype)


def bind(weights: Any, tables: tuple[dict[str, LoraTable], ...], slots: Int[Array, " T"]) -> Any:
    """The serving weights of one step: each layer's targeted linears as `LoraLinear`s over the step's token slots."""
    onehot = jax.nn.one_hot(slots, _num_slots(tables), dtype=jnp.float32)
    layers = tuple(
        dataclasses.replace(
            layer, **{name: LoraLinear(getattr(layer, name), t.a, t.b, onehot) for name, t in table.items()}
        )
        for layer, table in zip(weights.layers, tables, strict=True)
    )
    return dataclasses.replace(weights, layers=layers)


def _num_slots(tables: tuple[dict[str, LoraTable], ...]) -> int:
    for table in tables:
        for t in table.values():
            return t.a.shape[0]
    raise ValueError("the adapter tables target no linear of any layer")


def layer_modules(layer_class: type) -> dict[str, tuple[str, ...]]:
    """field -> the modules it holds, for the linears of a serving-layer class that adapters may target."""
    return dict(getattr(layer_class, "LORA_MODULES", {}))


def table_specs(serving_specs: Any, max_loras: int, max_rank: int) -> tuple[dict[str, Any], ...]:
    """The ParamSpecs of every layer's tables (a tree parallel to the tables), from the family's serving specs: a
    [S, *in, P*R] with axes ("lora", *in axes, None), b [S, P*R, *out] with ("lora", None, *out axes): the
    rules table splits A's inputs and B's outputs as it splits the weight's."""
    from jaxserve.models.common import ParamSpec  # common imports quant, which imports this module

    slots = max_loras + 1
    layers = []
    for layer in serving_specs.layers:
        table = {}
        for name, modules in layer_modules(type(layer)).items():
            spec, num_in = getattr(layer, name), type(layer).LINEARS[name]
            cols = len(modules) * max_rank
            table[name] = LoraTable(
                a=ParamSpec((slots, *spec.shape[:num_in], cols), ("lora", *spec.logical_axes[:num_in], None)),
                b=ParamSpec((slots, cols, *spec.shape[num_in:]), ("lora", None, *spec.logical_axes[num_in:])),
            )
        layers.append(table)
    return tuple(layers)


def table_rows(
    adapter_weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]], serving_specs: Any, max_rank: int
) -> tuple[dict[str, LoraTable], ...]:
    """One slot's rows of every table (numpy float32, no slot axis) from an adapter's weights: (layer, module) ->
    (A [in, r], B [r, out], the scaling folded in), in the Hugging Face layouts (A = lora_A.weight.T). Modules the
    adapter does not target stay zero. Raises ValueError for a rank above max_rank, a module no layer holds, or a
    shape that is not the model's."""
    held = {
        (index, m)
        for index, layer in enumerate(serving_specs.layers)
        for ms in layer_modules(type(layer)).values()
        for m in ms
    }
    for layer, module in sorted(set(adapter_weights) - held):
        where = (
            "a layer the model lacks"
            if layer >= len(serving_specs.layers)
            else "a projection adapters cannot target here"
        )
        raise ValueError(
            f"the adapter targets layer {layer} {module}: {where} (the model has {len(serving_specs.layers)} layers; "
            f"adapters target {sorted({m for _, m in held})})"
        )
    rows = []
    for index, layer in enumerate(serving_specs.layers):
        table = {}
        for name, modules in layer_modules(type(layer)).items():
            spec, num_in = getattr(layer, name), type(layer).LINEARS[name]
            in_shape, out_shape = spec.shape[:num_in], spec.shape[num_in:]
            a = np.zeros((*in_shape, len(modules) * max_rank), np.float32)
            b = np.zeros((len(modules) * max_rank, *out_shape), np.float32)
            for p, module in enumerate(modules):
                pair = adapter_weights.get((index, module))
                if pair is None:
                    continue
                module_a, module_b = pair
                rank = module_a.shape[1]
                if rank > max_rank:
                    raise ValueError(f"layer {index} {module}: rank {rank} is above max_lora_rank {max_rank}")
                columns = slice(p * max_rank, p * max_rank + rank)
                if module_a.shape[0] != int(np.prod(in_shape)):
                    raise ValueError(
                        f"layer {index} {module}: lora_A has {module_a.shape[0]} inputs, the model's {module} "
                        f"{int(np.prod(in_shape))}: the adapter is for another base model"
                    )
                a[..., columns] = module_a.reshape(*in_shape, rank)
                b[columns] = _placed_b(name, module, module_b, out_shape, index)
            table[name] = LoraTable(a, b)
        rows.append(table)
    return tuple(rows)


def _placed_b(name: str, module: str, module_b: np.ndarray, out_shape: tuple[int, ...], layer: int) -> np.ndarray:
    """A module's B [r, out] placed in its fused linear's output layout [r, *out] (zeros where other modules are):
    wqkv [K, G+2, Dh] groups each kv head's G query heads, then its key, then its value; w_gate_up [2, F]."""
    rank, width = module_b.shape
    placed = np.zeros((rank, *out_shape), np.float32)
    if name == "wqkv":
        k, groups, dh = out_shape
        g = groups - 2
        expected = {"q_proj": k * g * dh, "k_proj": k * dh, "v_proj": k * dh}[module]
        _check_width(module, layer, width, expected)
        if module == "q_proj":
            placed[:, :, :g] = module_b.reshape(rank, k, g, dh)
        else:
            placed[:, :, g if module == "k_proj" else g + 1] = module_b.reshape(rank, k, dh)
    elif name == "w_gate_up":
        _check_width(module, layer, width, out_shape[1])
        placed[:, 0 if module == "gate_proj" else 1] = module_b
    else:
        _check_width(module, layer, width, int(np.prod(out_shape)))
        placed[:] = module_b.reshape(rank, *out_shape)
    return placed


def _check_width(module: str, layer: int, width: int, expected: int) -> None:
    if width != expected:
        raise ValueError(
            f"layer {layer} {module}: lora_B has {width} outputs, the model's {module} {expected}: the adapter is "
            "for another base model"
        )


class LoraTableWriter:
    """Writes one slot of every table (`write(tables, slot, rows)`, the old tables donated): one jitted call,
    compiled once for the tables' shapes and shardings, so an adapter's load, update or unload compiles nothing
    after the first."""

    def __init__(self, shardings: Any) -> None:
        self._write = jax.jit(_write_slot, donate_argnames=("tables",), out_shardings=shardings)

    def write(self, tables: Any, slot: int, rows: Any) -> Any:
        return self._write(tables, jnp.int32(slot), rows)


def _write_slot(tables: Any, slot: Int[Array, ""], rows: Any) -> Any:
    return jax.tree.map(
        lambda table, row: jax.lax.dynamic_update_index_in_dim(table, row.astype(table.dtype), slot, 0), tables, rows
    )


def zero_rows(specs: Any) -> Any:
    """An all-zero slot (no adapter) for `table_rows`'s tree: what unloading writes."""
    from jaxserve.models.common import ParamSpec

    return jax.tree.map(
        lambda spec: np.zeros(spec.shape[1:], np.float32), specs, is_leaf=lambda x: isinstance(x, ParamSpec)
    )

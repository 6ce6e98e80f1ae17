"""LoRA adapters on the device: a fixed table of adapter slots beside each targeted linear weight, and the low-rank
product every projection adds for the tokens of adapted requests.

A serving layer declares which checkpoint modules each of its linears holds, `LORA_MODULES` (llama, gemma: wqkv ->
q/k/v, wo -> o, w_gate_up -> gate/up, w_down -> down; an MoE layer its attention's only). For a linear [*in, *out]
holding P modules the table is a pair (`LoraTable`):

    a [*in, S, P*R]   module p's A in columns p*R : (p+1)*R (the slots after the inputs: x @ a is one plain GEMM of
                      S*P*R columns, no copy of the table to make its columns contiguous)
    b [S, P*R, *out]  module p's B in rows p*R : (p+1)*R, at that module's place in the fused output (zeros elsewhere)

S = max_loras + 1 slots: slot 0 is the base model (all zeros), adapters take slots 1..max_loras. R =
max_lora_rank: a smaller rank fills its first rows and columns, the rest stay zero. The adapter's scaling (alpha /
r, or alpha / sqrt(r) with rsLoRA) is folded into b, so the product is plain.

A step's tokens each name their request's slot (`StepInputs.lora_slots`, 0 for base rows and padding); `bind`
wraps each targeted weight of the step's layers in a `LoraLinear` with the one-hot of those slots, and
`quant.linear` adds `lora_delta` to the base product (`add_lora`):

    xa = einsum(x, a)            [T, S, P*R]   every slot's A for every token (S*P*R columns: one thin GEMM)
    delta = einsum(xa * onehot, b)              each token keeps its own slot's columns, then one GEMM with B

Folded (`fold`: unquantized weights on one device, the engine's default there), a lives in the base weight's
array as extra output columns, `FoldedWeight` [*in, N + S*P*R] (N: the weight's outputs, flat): one GEMM gives
x @ w and x @ a together (`folded_product`), where a separate x @ a is a slow thin GEMM of its own at decode sizes
(docs/performance.md, "LoRA adapters"). The table then holds b only (a None). Tensor parallelism splits a
column-parallel weight's outputs, and an FP8 weight's values are e4m3: both keep the tables separate.

Writing a slot (`LoraTableWriter`) is one jitted update per module (its A and B sent as they are: float32 or
bfloat16, PEFT's layout or qwix's transposed one; transposed, scaled and cast on the device), compiled per module
shape at start for float32 PEFT adapters, and for another dtype or layout when the first adapter in it is loaded:
replacing or unloading an adapter, and serving it, compile nothing.

Legend beyond docs' (STYLE.md): S adapter slots, R the table's rank, P the modules a fused linear holds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from functools import partial
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
    """One linear's adapter slots: a [*in, S, P*R], b [S, P*R, *out] (module docstring)."""

    a: Array
    b: Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class FoldedWeight:
    """A linear's base weight with its adapter tables' a beside it: values [*in, N + S*P*R], the [*in, *out] weight
    in its first N = prod(out) columns (flat), a's [*in, S, P*R] flat after them (`fold`)."""

    values: Array
    out_shape: tuple[int, ...] = field(metadata=dict(static=True))

    @property
    def num_base(self) -> int:
        """N: the base weight's columns."""
        return math.prod(self.out_shape)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class LoraLinear:
    """A linear weight of one step with its adapter table and the step's tokens' slots (one-hot [T, S]):
    `quant.linear` computes the base product (`base`: an array or an `Fp8Weight`) plus `lora_delta`, or with a
    `FoldedWeight` base (a None) `folded_product`."""

    base: Any
    a: Array | None
    b: Array
    onehot: Float[Array, "T S"]


def lora_delta(x: Array, w: LoraLinear, result_dtype: Any = None) -> Array:
    """The adapters' share of `quant.linear`'s product of x and the base weight for each token of x (its slot's
    x @ A @ B), in x's dtype: x's trailing axes contracted with a's leading ones, in their stored order (dot_general,
    not an einsum, which orders contracted axes by letter: XLA:CPU then copies the operand into that order).
    result_dtype: what both products write, accumulating in float32 (None: x's dtype). Either way each product is
    rounded once to x's dtype, so the values match; writing float32 and casting after cost an H100 0.45 ms of its
    7.7 ms batch-1 step with 4 adapters (docs/performance.md, "LoRA adapters"), `benchmarks/step_profile.py
    --lora-delta float32` measures it."""
    result_dtype = x.dtype if result_dtype is None else result_dtype
    num_in = w.a.ndim - 2
    rows = x.ndim - num_in
    x_in, a_in = tuple(range(rows, x.ndim)), tuple(range(num_in))
    xa = jax.lax.dot_general(x, w.a, ((x_in, a_in), ((), ())), preferred_element_type=result_dtype)  # [T, S, P*R]
    return lora_expand(xa, w, x.dtype, result_dtype)


def lora_expand(xa: Array, w: LoraLinear, dtype: Any, result_dtype: Any) -> Array:
    """`lora_delta`'s second half: x @ a ([*rows, S, P*R], any float dtype) kept to each row's slot and cast to
    `dtype`, times b: the GEMM writes result_dtype (accumulating in float32), cast to `dtype`. Every slot's columns
    of xa but the row's are zeroed and one GEMM takes all of b (gathering each row's own slot of b instead, with
    fewer rows than slots, made an H100's batch-1 step slower: docs/performance.md, "LoRA adapters")."""
    rows = xa.ndim - 2
    xa = (xa * w.onehot[..., None].astype(xa.dtype)).astype(dtype)
    slots_and_rank = ((rows, rows + 1), (0, 1))
    delta = jax.lax.dot_general(xa, w.b, (slots_and_rank, ((), ())), preferred_element_type=result_dtype)
    return delta.astype(dtype)


def folded_product(x: Array, w: LoraLinear) -> Array:
    """`quant.linear`'s product of x and a `LoraLinear` whose base is a `FoldedWeight`, in x's dtype: one GEMM of x
    and the folded values gives the base product (the first N columns) and x @ a (the rest), then `lora_expand`
    adds each row's slot's share."""
    folded = w.base
    num_in = folded.values.ndim - 1
    rows = x.ndim - num_in
    contract = (tuple(range(rows, x.ndim)), tuple(range(num_in)))
    both = jax.lax.dot_general(x, folded.values, (contract, ((), ())), preferred_element_type=x.dtype)
    lead, n = x.shape[:rows], folded.num_base
    base = both[..., :n].reshape(*lead, *folded.out_shape)
    xa = both[..., n:].reshape(*lead, *w.b.shape[:2])
    return base + lora_expand(xa, w, x.dtype, x.dtype)


def add_lora(base: Array, x: Array, w: LoraLinear) -> Array:
    """`quant.linear`'s product of x and a `LoraLinear`: the base product `base` plus `lora_delta`."""
    return base + lora_delta(x, w)


def add_lora_kernels(base: Array, x: Array, w: LoraLinear, *, interpret: bool = False) -> Array:
    """`add_lora` as the two Pallas kernels of `jaxserve.kernels.lora` (x @ a split over K, then the slot mask, @ b
    and the add), on one device's unsplit tables; in base's dtype. Slower than `add_lora` on an H100
    (docs/kernels.md), so the engine runs that; `benchmarks/step_profile.py --lora-delta pallas` runs this."""
    from jaxserve.kernels.lora import lora_add

    rows, x2, a2 = _flat(x, w)
    num_slots, cols = w.a.shape[-2:]
    slots = jnp.argmax(w.onehot, axis=-1).astype(jnp.int32).reshape(-1)
    out = lora_add(
        x2,
        a2,
        w.b.reshape(num_slots * cols, -1),
        slots,
        base.reshape(x2.shape[0], -1),
        cols_per_slot=cols,
        interpret=interpret,
    )
    return out.reshape(*rows, *base.shape[len(rows) :])


def add_lora_shrink_kernel(base: Array, x: Array, w: LoraLinear, *, interpret: bool = False) -> Array:
    """`add_lora` with x @ a as the Pallas shrink kernel (`jaxserve.kernels.lora.lora_shrink`: K split over ~128
    programs, where XLA makes a decode batch's x @ a one slow reduction over K) and the rest as XLA's
    (`lora_expand`, the add); one device's unsplit tables. Faster than `add_lora` at batch 1 only, on the linears
    alone (docs/kernels.md); `benchmarks/step_profile.py --lora-delta shrink` profiles it in the engine's step."""
    from jaxserve.kernels.lora import lora_shrink

    rows, x2, a2 = _flat(x, w)
    xa = lora_shrink(x2, a2, interpret=interpret)
    return base + lora_expand(xa.reshape(*rows, *w.a.shape[-2:]), w, x.dtype, x.dtype)


def _flat(x: Array, w: LoraLinear) -> tuple[tuple[int, ...], Array, Array]:
    """What the kernels take: x's leading (row) axes, x as [rows, K] and a as [K, S*P*R] (its input axes flat)."""
    num_in = w.a.ndim - 2
    dim_in = math.prod(x.shape[x.ndim - num_in :])
    return x.shape[: x.ndim - num_in], x.reshape(-1, dim_in), w.a.reshape(dim_in, -1)


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
            return t.b.shape[0]
    raise ValueError("the adapter tables target no linear of any layer")


def fold(arrays: Any, tables: tuple[dict[str, LoraTable], ...], sharding: Any) -> tuple[Any, tuple[dict, ...]]:
    """The serving weights with each targeted linear's a folded in beside its weight (a `FoldedWeight`, placed with
    `sharding`: one device's), and the tables with b only. Layer by layer: each linear's weight and a are freed as
    its folded array is made, so the device holds one extra linear at most."""
    layers, folded_tables = [], []
    for layer, table in zip(arrays.layers, tables, strict=True):
        folded = {}
        for name, t in table.items():
            w = getattr(layer, name)
            folded[name] = _folder(sharding)(w, t.a)
            jax.block_until_ready(folded[name])
            w.delete()
            t.a.delete()
        layers.append(dataclasses.replace(layer, **folded))
        folded_tables.append({name: LoraTable(None, t.b) for name, t in table.items()})
    return dataclasses.replace(arrays, layers=tuple(layers)), tuple(folded_tables)


def unfolded_tables(arrays: Any, tables: tuple[dict[str, LoraTable], ...], shardings: Any) -> tuple[dict, ...]:
    """`fold`'s tables with their a again: copies of the a columns of the folded weights (which stay as they are),
    placed with `shardings` (the tables' own, a tree parallel to them; None: host weights, numpy copies): what an
    update of the weights or their discard keeps of the adapters."""
    out = []
    for i, (layer, table) in enumerate(zip(arrays.layers, tables, strict=True)):
        unfolded = {}
        for name, t in table.items():
            folded, slots_and_cols = getattr(layer, name), t.b.shape[:2]
            if shardings is None:
                a = np.array(_a_columns(folded, slots_and_cols))
            else:
                a = _unfolder(shardings[i][name].a)(folded, slots_and_cols)
            unfolded[name] = LoraTable(a, t.b)
        out.append(unfolded)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _folder(sharding: Any) -> Any:
    def fold_linear(w: Array, a: Array) -> FoldedWeight:
        num_in = a.ndim - 2
        in_shape = w.shape[:num_in]
        values = jnp.concatenate([w.reshape(*in_shape, -1), a.reshape(*in_shape, -1).astype(w.dtype)], axis=-1)
        return FoldedWeight(values, tuple(w.shape[num_in:]))

    return jax.jit(fold_linear, out_shardings=sharding)


def _a_columns(folded: FoldedWeight, slots_and_cols: tuple[int, int]) -> Any:
    """The a table of a folded weight ([*in, S, P*R]: its values' columns after N), of a device or a host array."""
    values = folded.values
    return values[..., folded.num_base :].reshape(*values.shape[:-1], *slots_and_cols)


@functools.lru_cache(maxsize=64)
def _unfolder(sharding: Any) -> Any:
    return jax.jit(_a_columns, static_argnums=1, out_shardings=sharding)


def layer_modules(layer_class: type) -> dict[str, tuple[str, ...]]:
    """field -> the modules it holds, for the linears of a serving-layer class that adapters may target."""
    return dict(getattr(layer_class, "LORA_MODULES", {}))


def table_specs(serving_specs: Any, max_loras: int, max_rank: int) -> tuple[dict[str, Any], ...]:
    """The ParamSpecs of every layer's tables (a tree parallel to the tables), from the family's serving specs: a
    [*in, S, P*R] with axes (*in axes, "lora", None), b [S, P*R, *out] with ("lora", None, *out axes): the
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
                a=ParamSpec((*spec.shape[:num_in], slots, cols), (*spec.logical_axes[:num_in], "lora", None)),
                b=ParamSpec((slots, cols, *spec.shape[num_in:]), ("lora", None, *spec.logical_axes[num_in:])),
            )
        layers.append(table)
    return tuple(layers)


@dataclass(frozen=True, slots=True)
class ModuleSite:
    """Where one module's A and B lie in its layer's tables: the fused linear (`field`), its index among the
    `num_parts` modules that linear holds (`part`: its columns of a and rows of b), A's inputs in the linear's input
    axes and B's number of outputs in the module's own (Hugging Face) layout."""

    layer: int
    field: str
    part: int
    num_parts: int
    module: str
    in_shape: tuple[int, ...]
    out_width: int


def module_sites(serving_specs: Any) -> dict[tuple[int, str], ModuleSite]:
    """(layer, module) -> its `ModuleSite`, for every module a layer's linears hold."""
    sites = {}
    for index, layer in enumerate(serving_specs.layers):
        for name, modules in layer_modules(type(layer)).items():
            spec, num_in = getattr(layer, name), type(layer).LINEARS[name]
            in_shape, out_shape = spec.shape[:num_in], spec.shape[num_in:]
            for part, module in enumerate(modules):
                sites[(index, module)] = ModuleSite(
                    index, name, part, len(modules), module, in_shape, _out_width(name, module, out_shape)
                )
    return sites


def _out_width(name: str, module: str, out_shape: tuple[int, ...]) -> int:
    """A module's outputs in Hugging Face's layout: q_proj H*Dh, k_proj / v_proj K*Dh of wqkv's [K, G+2, Dh]; gate
    or up F of w_gate_up's [2, F]; the whole output otherwise."""
    if name == "wqkv":
        k, groups, dh = out_shape
        return k * (groups - 2) * dh if module == "q_proj" else k * dh
    if name == "w_gate_up":
        return out_shape[1]
    return int(np.prod(out_shape))


def check_adapter(
    shapes: dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]],
    sites: dict[tuple[int, str], ModuleSite],
    max_rank: int,
) -> None:
    """ValueError unless every (layer, module) -> the shapes of its A [r, in] and B [out, r] (PEFT's layout) of an
    adapter has a site in the model, a rank <= max_rank and the model's shapes."""
    num_layers = 1 + max((layer for layer, _ in sites), default=-1)
    for (layer, module), (a_shape, b_shape) in sorted(shapes.items()):
        site = sites.get((layer, module))
        if site is None:
            where = "a layer the model lacks" if layer >= num_layers else "a projection adapters cannot target here"
            raise ValueError(
                f"the adapter targets layer {layer} {module}: {where} (the model has {num_layers} layers; adapters "
                f"target {sorted({m for _, m in sites})})"
            )
        rank = a_shape[0]
        if rank > max_rank:
            raise ValueError(f"layer {layer} {module}: rank {rank} is above max_lora_rank {max_rank}")
        inputs = int(np.prod(site.in_shape))
        if tuple(a_shape) != (rank, inputs) or tuple(b_shape) != (site.out_width, rank):
            raise ValueError(
                f"layer {layer} {module}: lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)} (as [r, in] and "
                f"[out, r]), the model's {module} takes {inputs} inputs to {site.out_width} outputs: the adapter is "
                "for another base model"
            )


def _write_module(
    holder: Array | FoldedWeight,
    b_table: Array,
    slot: Int[Array, ""],
    a: Float[Array, "r I"] | Float[Array, "I r"],
    b: Float[Array, "O r"] | Float[Array, "r O"],
    scaling: Float[Array, ""],
    *,
    site: ModuleSite,
    transposed: bool,
) -> tuple[Array | FoldedWeight, Array]:
    """One module's A [R, in] and B [out, R] (PEFT's layout; `transposed`: A [in, R], B [R, out], qwix's), padded to
    the table's rank R, written into `slot`: A into its part's columns of a (`holder`: the table's a
    [*in, S, P*R], or the `FoldedWeight` a is folded into); B scaled and placed at the module's outputs of the fused
    layout in its part's rows of b (`b_table`; zeros at the other modules' outputs). Returns (holder, b_table)."""
    rank = b_table.shape[1] // site.num_parts
    part = slice(site.part * rank, (site.part + 1) * rank)
    a, b = (a, b) if transposed else (a.T, b.T)  # [in, R], [R, out]
    a = a.astype(jnp.float32).reshape(*site.in_shape, rank)
    b = b.astype(jnp.float32) * scaling
    out_shape = b_table.shape[2:]
    placed = jnp.zeros((rank, *out_shape), jnp.float32)
    if site.field == "wqkv":
        k, groups, dh = out_shape
        g = groups - 2
        if site.module == "q_proj":
            placed = placed.at[:, :, :g].set(b.reshape(rank, k, g, dh))
        else:
            placed = placed.at[:, :, g if site.module == "k_proj" else g + 1].set(b.reshape(rank, k, dh))
    elif site.field == "w_gate_up":
        placed = placed.at[:, 0 if site.module == "gate_proj" else 1].set(b)
    else:
        placed = b.reshape(rank, *out_shape)
    if isinstance(holder, FoldedWeight):  # a's columns follow the weight's N: slot s, part p at N + (s*P + p)*R
        start = holder.num_base + (slot * site.num_parts + site.part) * rank
        corner = (0,) * len(site.in_shape) + (start,)
        values = jax.lax.dynamic_update_slice(holder.values, a.astype(holder.values.dtype), corner)
        holder = FoldedWeight(values, holder.out_shape)
    else:
        holder = holder.at[..., slot, part].set(a.astype(holder.dtype))
    return holder, b_table.at[slot, part].set(placed.astype(b_table.dtype))


# The serving weights and the adapter tables, as the writer takes and returns them: with folded tables (`fold`), a
# lives in the weights.
Weights = tuple[Any, tuple[dict[str, LoraTable], ...]]


class LoraTableWriter:
    """Writes adapters into the slots of every layer's tables, one module at a time (each a jitted update of its
    layer's table, the old one donated): a few hundred small calls for a large model, sending only the adapter's
    own bytes in their own dtype and layout, transposed, scaled and cast on the device (an adapter of a rank below
    the tables' is padded on the host first). The updates compile once per module shape and kind of adapter (dtype,
    layout): float32 PEFT at start (`warm`), another kind when its first adapter is loaded (`prepare`); writing an
    adapter of a kind prepared before compiles nothing. Tracks which modules each slot holds, so that an adapter
    replacing another in a slot zeroes the modules it does not target. Its calls take and return (weights, tables):
    the serving weights (None when no table is folded) and the tables; a folded table's a is written in its
    weight's `FoldedWeight`, donated as the table is."""

    def __init__(self, sites: dict[tuple[int, str], ModuleSite], max_rank: int) -> None:
        self.sites, self.max_rank = sites, max_rank
        self._jitted: dict[Any, Any] = {}
        self._held: dict[int, set[tuple[int, str]]] = {}  # slot -> the (layer, module)s written non-zero
        self._prepared: set[tuple[np.dtype, bool]] = set()  # the kinds of adapter (dtype, transposed) compiled for

    def warm(self, weights: Weights) -> Weights:
        """Compiles every distinct module update for float32 adapters in PEFT's layout (by writing zeros into slot 0,
        the base model's, zeros already)."""
        return self.prepare(weights, np.dtype(np.float32), transposed=False)

    def prepare(self, weights: Weights, dtype: np.dtype, *, transposed: bool) -> Weights:
        """Compiles the module updates for adapters of `dtype` in a layout (nothing if compiled before), by writing
        zeros of that kind into slot 0."""
        if (dtype, transposed) in self._prepared:
            return weights
        seen = set()
        for key, site in self.sites.items():
            if (site.field, site.part, site.module) not in seen:
                seen.add((site.field, site.part, site.module))
                weights = self._write(weights, key, 0, self._zeros(site, dtype, transposed), 1.0, transposed)
        self._prepared.add((dtype, transposed))
        return weights

    def write(
        self,
        weights: Weights,
        slot: int,
        adapter: dict[tuple[int, str], tuple[Any, Any]] | None,
        scaling: float = 1.0,
        *,
        transposed: bool = False,
    ) -> Weights:
        """(weights, tables) with `slot` holding an adapter's (layer, module) -> (A [r, in], B [out, r]) weights
        (`transposed`: A [in, r], B [r, out]) times `scaling` (None: no adapter, all zeros), checked by
        `check_adapter` beforehand."""
        adapter = adapter or {}
        stale = self._held.get(slot, set()) - set(adapter)
        for key, pair in adapter.items():
            weights = self._write(weights, key, slot, pair, scaling, transposed)
        for key in stale:
            weights = self._write(weights, key, slot, self._zeros(self.sites[key], np.float32, False), scaling, False)
        self._held[slot] = set(adapter)
        return weights

    def _zeros(self, site: ModuleSite, dtype: Any, transposed: bool) -> tuple[np.ndarray, np.ndarray]:
        """Zero A and B of the tables' rank for a module, in a dtype and layout (each contiguous)."""
        a_shape, b_shape = (self.max_rank, int(np.prod(site.in_shape))), (site.out_width, self.max_rank)
        if transposed:
            a_shape, b_shape = a_shape[::-1], b_shape[::-1]
        return np.zeros(a_shape, dtype), np.zeros(b_shape, dtype)

    def _write(
        self, weights: Weights, key: tuple[int, str], slot: int, pair: Any, scaling: float, transposed: bool
    ) -> Weights:
        arrays, tables = weights
        site = self.sites[key]
        a, b = pair
        rank = a.shape[-1] if transposed else a.shape[0]
        # Padded to the tables' rank on the host: every write of a kind runs the update compiled for it.
        if rank < self.max_rank:
            padded_a, padded_b = self._zeros(site, a.dtype, transposed)
            if transposed:
                padded_a[:, :rank], padded_b[:rank] = a, b
            else:
                padded_a[:rank], padded_b[:, :rank] = a, b
            a, b = padded_a, padded_b
        table = tables[site.layer][site.field]
        folded = table.a is None
        holder = getattr(arrays.layers[site.layer], site.field) if folded else table.a
        holder, b_table = self._jit(site, transposed, holder, table.b)(
            holder, table.b, np.int32(slot), a, b, np.float32(scaling)
        )
        layer_tables = tables[site.layer]
        table = LoraTable(None if folded else holder, b_table)
        tables = (*tables[: site.layer], {**layer_tables, site.field: table}, *tables[site.layer + 1 :])
        if folded:
            layer = dataclasses.replace(arrays.layers[site.layer], **{site.field: holder})
            layers = arrays.layers
            arrays = dataclasses.replace(arrays, layers=(*layers[: site.layer], layer, *layers[site.layer + 1 :]))
        return arrays, tables

    def _jit(self, site: ModuleSite, transposed: bool, holder: Any, b_table: Array) -> Any:
        shardings = jax.tree.map(lambda x: x.sharding, (holder, b_table))  # each update keeps its inputs' placement
        key = (site.field, site.part, site.module, site.in_shape, site.out_width, shardings, transposed)
        if key not in self._jitted:
            self._jitted[key] = jax.jit(
                partial(_write_module, site=dataclasses.replace(site, layer=0), transposed=transposed),
                donate_argnames=("holder", "b_table"),
                out_shardings=shardings,
            )
        return self._jitted[key]

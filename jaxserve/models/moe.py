"""The mixture-of-experts MLP that every MoE family shares: its weights (checkpoint and serving layouts and their
ParamSpecs), the router and the experts' computation, and the dense MLP of the layers that have no experts.

One MoE layer over a flat batch of T tokens (DESIGN.md, "Mixture of experts"):
    router logits in float32 -> softmax -> each token's top-k experts and weights (renormalised to sum 1 where
    the family says so) -> the T*k routed rows sorted by expert (a stable argsort of the flat expert ids; each
    expert's row count by bincount of length E) -> one grouped GEMM for gate and up with silu(gate) * up -> one
    grouped GEMM for down -> the inverse permutation, each token's k results summed with their weights.
Every shape is static (T, k, E); only the group sizes are data, so no routing recompiles anything. Which grouped
GEMMs run is decided by the step's attention metadata, as for the attention and the norms: on the paged pallas
backend the Pallas kernels of `jaxserve.kernels.moe` (`grouped_gate_up`, `grouped_matmul`); on the xla backend and
the dense reference path `grouped_gate_up` here and `jax.lax.ragged_dot` (XLA, exactly the kernels' semantics).

Expert weights are stacked on a leading E axis: gate/up [E, D, 2, F] with logical axes ("experts", "embed", None,
"mlp"), down [E, F, D] with ("experts", "mlp", "embed"). The rules table decides the split: "mlp" over the model
axis (tensor-parallel experts, the default: each device holds a slice of every expert, and the down projection's
partial sums are reduced as a dense MLP's are) or "experts" over it (expert parallelism: each device holds E / tp
whole experts); a mesh axis splits one dimension of a tensor, so the other stays whole. Under a mesh the xla
backend is partitioned by XLA; the Pallas kernels run per device under shard_map, on the split that the rules
table the weights were placed with gives (`ExpertSplit`): every routed row through the device's F slice, or only
the rows of the device's experts (a contiguous run of the sorted rows: the kernels' row_offset, the other rows
zero), then a psum of each token's combined output over the model axis. Routing is replicated: no all-to-all.

Einsum letters: t tokens, d model dim, e experts, f MLP hidden, c the gate/up pair, k a token's chosen experts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int

from jaxserve import kernels
from jaxserve.models.attention import AttentionMetadata, _runs_pallas
from jaxserve.models.common import ParamSpec, gated_mlp
from jaxserve.models.layers import LayerMlp
from jaxserve.models.quant import Fp8Experts
from jaxserve.sharding.mesh import MODEL_AXIS
from jaxserve.sharding.rules import Rules, partition_spec


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The MLP weights of a model's MoE layers in the checkpoint layout, stacked on a leading axis over those
    layers (Lm: the family's config says which layers they are). router: [D, E] (Hugging Face's gate, transposed);
    shared_*: Qwen2-MoE's shared expert (gate, up and down of width Fs) and shared_gate, the weight of the sigmoid
    gate that scales its output."""

    router: Float[Array, "Lm D E"]
    w_gate: Float[Array, "Lm E D F"]
    w_up: Float[Array, "Lm E D F"]
    w_down: Float[Array, "Lm E F D"]
    shared_w_gate: Float[Array, "Lm D Fs"] | None
    shared_w_up: Float[Array, "Lm D Fs"] | None
    shared_w_down: Float[Array, "Lm Fs D"] | None
    shared_gate: Float[Array, "Lm D"] | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class DenseWeights:
    """The MLP weights of a model's dense layers in the checkpoint layout, stacked over those layers (Ld)."""

    w_gate: Float[Array, "Ld D F"]
    w_up: Float[Array, "Ld D F"]
    w_down: Float[Array, "Ld F D"]


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class ExpertMlp:
    """One MoE layer's MLP as the forward reads it: every expert's gate and up fused ([E, D, 2, F], the grouped
    GEMM kernel's operand), the shared expert's too."""

    router: Float[Array, "D E"]
    w_gate_up: Float[Array, "E D 2 F"] | Fp8Experts
    w_down: Float[Array, "E F D"] | Fp8Experts
    shared_gate_up: Float[Array, "D 2 Fs"] | None
    shared_down: Float[Array, "Fs D"] | None
    shared_gate: Float[Array, " D"] | None

    # Quantized (quant.quantize_linears): the shared expert's GEMMs as linears, the expert stacks as
    # `quant.Fp8Experts` (the grouped GEMMs read their FP8 tiles).
    LINEARS: ClassVar[dict[str, int]] = {"shared_gate_up": 1, "shared_down": 1}
    EXPERTS: ClassVar[tuple[str, ...]] = ("w_gate_up", "w_down")


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class DenseMlp:
    """One dense layer's MLP as the forward reads it (llama.ServingLayer's MLP fields)."""

    w_gate_up: Float[Array, "D 2 F"]
    w_down: Float[Array, "F D"]

    LINEARS: ClassVar[dict[str, int]] = {"w_gate_up": 1, "w_down": 1}  # quant.quantize_linears


def layers_of_kind(mlp_layers: tuple[LayerMlp, ...], kind: str) -> tuple[int, ...]:
    """The indices of the layers whose MLP is of `kind` ("dense" or "moe"), in order: the model layer of each slot
    of that kind's stacked checkpoint weights."""
    return tuple(i for i, mlp in enumerate(mlp_layers) if mlp.kind == kind)


def expert_specs(num_layers: int, hidden_size: int, mlp: LayerMlp) -> ExpertWeights:
    """ParamSpecs of `num_layers` MoE layers' stacked checkpoint weights, each declared by `mlp`."""
    n, d, e, f, fs = num_layers, hidden_size, mlp.num_experts, mlp.intermediate_size, mlp.shared_intermediate_size
    assert e is not None, "expert_specs of a dense layer"
    shared = fs is not None
    return ExpertWeights(
        # Every device routes every token: the router is small and replicated.
        router=ParamSpec((n, d, e), ("layers", "embed", None)),
        w_gate=ParamSpec((n, e, d, f), ("layers", "experts", "embed", "mlp")),
        w_up=ParamSpec((n, e, d, f), ("layers", "experts", "embed", "mlp")),
        w_down=ParamSpec((n, e, f, d), ("layers", "experts", "mlp", "embed")),
        shared_w_gate=ParamSpec((n, d, fs), ("layers", "embed", "mlp")) if shared else None,
        shared_w_up=ParamSpec((n, d, fs), ("layers", "embed", "mlp")) if shared else None,
        shared_w_down=ParamSpec((n, fs, d), ("layers", "mlp", "embed")) if shared else None,
        shared_gate=ParamSpec((n, d), ("layers", "embed")) if shared else None,
    )


def dense_specs(num_layers: int, hidden_size: int, intermediate_size: int) -> DenseWeights:
    """ParamSpecs of `num_layers` dense layers' stacked checkpoint MLP weights."""
    n, d, f = num_layers, hidden_size, intermediate_size
    return DenseWeights(
        w_gate=ParamSpec((n, d, f), ("layers", "embed", "mlp")),
        w_up=ParamSpec((n, d, f), ("layers", "embed", "mlp")),
        w_down=ParamSpec((n, f, d), ("layers", "mlp", "embed")),
    )


def mlp_specs(hidden_size: int, mlp: LayerMlp) -> DenseMlp | ExpertMlp:
    """ParamSpecs of one layer's MLP in the serving layout."""
    d, f = hidden_size, mlp.intermediate_size
    if mlp.num_experts is None:
        return DenseMlp(ParamSpec((d, 2, f), ("embed", None, "mlp")), ParamSpec((f, d), ("mlp", "embed")))
    e, fs = mlp.num_experts, mlp.shared_intermediate_size
    shared = fs is not None
    return ExpertMlp(
        router=ParamSpec((d, e), ("embed", None)),
        w_gate_up=ParamSpec((e, d, 2, f), ("experts", "embed", None, "mlp")),
        w_down=ParamSpec((e, f, d), ("experts", "mlp", "embed")),
        shared_gate_up=ParamSpec((d, 2, fs), ("embed", None, "mlp")) if shared else None,
        shared_down=ParamSpec((fs, d), ("mlp", "embed")) if shared else None,
        shared_gate=ParamSpec((d,), ("embed",)) if shared else None,
    )


def fuse_mlp(weights: DenseWeights | ExpertWeights, cast: Callable[[Array], Array]) -> DenseMlp | ExpertMlp:
    """One layer's MLP (checkpoint layout without its leading axis) in the serving layout: gate and up stacked on
    the axis before F (so a split of F over devices keeps each device's gate and up columns together)."""
    if isinstance(weights, DenseWeights):
        return DenseMlp(cast(jnp.stack([weights.w_gate, weights.w_up], axis=-2)), cast(weights.w_down))
    shared = weights.shared_w_gate is not None
    return ExpertMlp(
        router=cast(weights.router),
        w_gate_up=cast(jnp.stack([weights.w_gate, weights.w_up], axis=-2)),
        w_down=cast(weights.w_down),
        shared_gate_up=cast(jnp.stack([weights.shared_w_gate, weights.shared_w_up], axis=-2)) if shared else None,
        shared_down=cast(weights.shared_w_down) if shared else None,
        shared_gate=cast(weights.shared_gate) if shared else None,
    )


def route(
    x: Float[Array, "T D"], router: Float[Array, "D E"], top_k: int, normalize: bool
) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """Each token's top_k experts and their float32 weights: softmax over all experts' logits (float32, so close
    logits are told apart as in the checkpoint's training), the top_k probabilities, renormalised to sum 1 when
    `normalize` (Mixtral always; Qwen's norm_topk_prob)."""
    logits = jnp.einsum("td,de->te", x, router, preferred_element_type=jnp.float32)
    weights, expert_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return expert_ids, weights


def sort_by_expert(expert_ids: Int[Array, "T k"], num_experts: int) -> tuple[Int[Array, " R"], Int[Array, " E"]]:
    """The routed rows (R = T * k; row r is token r // k's (r % k)-th choice) in expert order, and each expert's
    row count: expert e owns the group_sizes[e] rows after those of experts < e, ties kept in token order."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def grouped_gate_up(
    lhs: Float[Array, "R D"], rhs: Float[Array, "E D 2 F"], group_sizes: Int[Array, " E"]
) -> Float[Array, "R F"]:
    """silu(gate) * up of each row with its expert's weights (rows sorted by expert, `group_sizes` rows each), in
    float32 and cast to lhs's dtype: `jaxserve.kernels.moe.grouped_gate_up`'s semantics in XLA. Gate and up are
    two ragged_dots over slices of rhs, which keep rhs's split of F over devices (a reshape to [E, D, 2F] would
    not)."""
    gate = jax.lax.ragged_dot(lhs, rhs[:, :, 0], group_sizes, preferred_element_type=jnp.float32)
    up = jax.lax.ragged_dot(lhs, rhs[:, :, 1], group_sizes, preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(lhs.dtype)


class ExpertSplit(NamedTuple):
    """How one MoE layer's expert weights lie on the step's mesh: the PartitionSpecs of w_gate_up and w_down as
    the rules table that placed them gives them (hashable: a static argument of the layer's jit)."""

    w_gate_up: PartitionSpec
    w_down: PartitionSpec


def expert_split(hidden_size: int, mlp: LayerMlp, mesh: Mesh, rules: Rules | None = None) -> ExpertSplit:
    """The split of one MoE layer's expert weights over `mesh` under `rules` (None: LOGICAL_AXIS_RULES), from their
    one declaration (`mlp_specs`)."""
    specs = mlp_specs(hidden_size, mlp)
    return ExpertSplit(
        partition_spec(specs.w_gate_up, mesh, "w_gate_up", rules), partition_spec(specs.w_down, mesh, "w_down", rules)
    )


def experts_mlp(
    x: Float[Array, "T D"],
    weights: ExpertMlp,
    mlp: LayerMlp,
    meta: AttentionMetadata | None = None,
    split: ExpertSplit | None = None,
) -> Float[Array, "T D"]:
    """The routed experts' weighted sum for each token (plus the gated shared expert where the layer has one).
    meta: the step's attention metadata; its paged pallas backend runs the grouped GEMMs as Pallas kernels (per
    device under tensor parallelism, the experts split as `split` says: None, as the default rules table says),
    everything else as XLA's ragged_dot."""
    expert_ids, route_weights = route(x, weights.router, mlp.top_k, mlp.normalize_top_k)
    order, group_sizes = sort_by_expert(expert_ids, weights.router.shape[1])
    routing = (order, group_sizes, route_weights)
    if _runs_pallas(meta):
        combined = _pallas_experts(x, weights.w_gate_up, weights.w_down, *routing, meta, mlp, split)
    else:  # FP8 stacks dequantized to x's dtype for XLA's ragged_dot
        w_gate_up, w_down = (
            w.dequantize(x.dtype) if isinstance(w, Fp8Experts) else w for w in (weights.w_gate_up, weights.w_down)
        )
        combined = _routed_experts(x, w_gate_up, w_down, *routing, gate_up=_gathered_gate_up, down=jax.lax.ragged_dot)
    if weights.shared_gate_up is not None:
        shared = gated_mlp(x, weights.shared_gate_up, weights.shared_down)
        scale = jax.nn.sigmoid(jnp.einsum("td,d->t", x, weights.shared_gate, preferred_element_type=jnp.float32))
        combined = combined + scale[:, None] * shared.astype(jnp.float32)
    return combined.astype(x.dtype)


def _gathered_gate_up(
    x: Float[Array, "T D"],
    w_gate_up: Float[Array, "E D 2 F"],
    group_sizes: Int[Array, " E"],
    *,
    lhs_rows: Int[Array, " R"],
) -> Float[Array, "R F"]:
    """`grouped_gate_up` of the rows x[lhs_rows] (gathered here; the Pallas kernel gathers in its loads)."""
    return grouped_gate_up(jnp.take(x, lhs_rows, axis=0), w_gate_up, group_sizes)


def _routed_experts(
    x: Float[Array, "T D"],
    w_gate_up: Float[Array, "E D 2 F"],
    w_down: Float[Array, "E F D"],
    order: Int[Array, " R"],
    group_sizes: Int[Array, " E"],
    route_weights: Float[Array, "T k"],
    *,
    gate_up: Callable[..., Array],
    down: Callable[..., Array],
) -> Float[Array, "T D"]:
    """Each token's weighted sum of its experts' outputs, float32: the grouped GEMMs `gate_up` (silu(gate) * up of
    the rows in expert order: routed row order[i]'s token, x[order[i] // k], is row i) and `down`
    (`_gathered_gate_up` and ragged_dot, or the Pallas kernels, which gather the rows in their loads), then back to
    token order."""
    num_tokens, top_k = route_weights.shape
    out = down(gate_up(x, w_gate_up, group_sizes, lhs_rows=order // top_k), w_down, group_sizes)
    # Back to token order: routed row r (token r // k, choice r % k) sits at the position where `order` holds r.
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    per_choice = jnp.take(out, position, axis=0).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkd,tk->td", per_choice.astype(jnp.float32), route_weights)


def _values_and_scale(w: Array | Fp8Experts) -> tuple[Array, Array | None]:
    return (w.values, w.scale) if isinstance(w, Fp8Experts) else (w, None)


def _without_din(spec: PartitionSpec) -> PartitionSpec:
    """The PartitionSpec of an expert stack's scale: the stack's without its Din axis (axis 1)."""
    return PartitionSpec(*spec[:1], *spec[2:])


def _pallas_experts(x, w_gate_up, w_down, order, group_sizes, route_weights, meta, mlp, split: ExpertSplit | None):
    """`_routed_experts` with the Pallas grouped GEMMs (FP8 stacks read as FP8 tiles with their scales); under a
    mesh, per device under shard_map on the expert weights as they are split, and summed over the model axis where
    they are:
    - tensor-parallel experts ("mlp" over the model axis): every row through each device's F slice of gate/up
      and of down, which gives a partial sum of each row's output;
    - expert parallelism ("experts" over it): a device holds E / tp whole experts, whose rows are a contiguous
      run of the sorted (replicated) rows; it passes its experts' group sizes and the rows of the experts
      before them as the kernels' row_offset, so its other rows come out zero, unread and uncopied.
    The psum is of the combined [T, D] in float32, not of the [T * k, D] rows."""
    kernel_options = dict(interpret=meta.interpret)
    mesh = meta.mesh
    (w_gate_up, gate_up_scale), (w_down, down_scale) = _values_and_scale(w_gate_up), _values_and_scale(w_down)
    if mesh is None or mesh.size == 1:
        gate_up = partial(kernels.grouped_gate_up, rhs_scale=gate_up_scale, **kernel_options)
        down = partial(kernels.grouped_matmul, rhs_scale=down_scale, **kernel_options)
        return _routed_experts(x, w_gate_up, w_down, order, group_sizes, route_weights, gate_up=gate_up, down=down)
    split = expert_split(x.shape[-1], mlp, mesh) if split is None else split
    by_expert, by_hidden = split.w_gate_up[0] == MODEL_AXIS, split.w_gate_up[3] == MODEL_AXIS
    if (split.w_down[0] == MODEL_AXIS, split.w_down[1] == MODEL_AXIS) != (by_expert, by_hidden):
        raise ValueError(f"w_gate_up and w_down must split experts or their hidden alike, got {split}")
    num_experts = group_sizes.shape[0]

    def per_device(x, w_gate_up, w_down, order, group_sizes, route_weights, gate_up_scale, down_scale):
        row_offset = None
        if by_expert:
            local = w_gate_up.shape[0]
            first = jax.lax.axis_index(MODEL_AXIS) * local
            row_offset = jnp.sum(jnp.where(jnp.arange(num_experts) < first, group_sizes, 0), dtype=jnp.int32)
            group_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first, local)
        options = dict(row_offset=row_offset, **kernel_options)
        gate_up = partial(kernels.grouped_gate_up, rhs_scale=gate_up_scale, **options)
        down = partial(kernels.grouped_matmul, rhs_scale=down_scale, **options)
        out = _routed_experts(x, w_gate_up, w_down, order, group_sizes, route_weights, gate_up=gate_up, down=down)
        return jax.lax.psum(out, MODEL_AXIS) if by_expert or by_hidden else out

    replicated = PartitionSpec()
    scale_specs = (
        replicated if gate_up_scale is None else _without_din(split.w_gate_up),  # None: no leaves
        replicated if down_scale is None else _without_din(split.w_down),
    )
    in_specs = (replicated, split.w_gate_up, split.w_down, replicated, replicated, replicated, *scale_specs)
    run = jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=replicated, check_vma=False)
    return run(x, w_gate_up, w_down, order, group_sizes, route_weights, gate_up_scale, down_scale)


def mlp_block(
    x: Float[Array, "T D"],
    weights: DenseMlp | ExpertMlp,
    mlp: LayerMlp,
    meta: AttentionMetadata | None = None,
    split: ExpertSplit | None = None,
) -> Float[Array, "T D"]:
    """One layer's MLP on the normed input, as its declaration says: dense SwiGLU or the mixture of experts (its
    grouped GEMMs as the step's metadata and the experts' split say: `experts_mlp`)."""
    if mlp.num_experts is None:
        return gated_mlp(x, weights.w_gate_up, weights.w_down)
    return experts_mlp(x, weights, mlp, meta, split)

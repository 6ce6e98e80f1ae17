"""FP8 linear weights: float8_e4m3fn values with a float32 scale per output channel, and the one matmul helper
(`linear`) every family's projections go through, for plain and quantized weights alike.

A weight of the serving layout is [*in, *out] (its einsum contracts the leading `in` axes with the input's
trailing ones: wqkv [D, K, G+2, Dh] contracts D, wo [H, Dh, D] contracts H and Dh). Quantized, it becomes an
`Fp8Weight`: values = round(w / scale) in e4m3, stored output-major as [*out, *in] (each output channel's inputs
contiguous: the K-major operand cuBLASLt's FP8 GEMM reads without a transpose), and
scale[*out] = max |w| over the `in` axes / 448 (e4m3's largest finite value), so each output channel uses the
format's whole range.

The product (`linear`) quantizes the input the same way per token (dynamic: each row's max |x| over the
contracted axes), multiplies in FP8 with float32 accumulation and scales the float32 result by both scales:
y[t, o] = (sum_i xq[t, i] wq[o, i]) * x_scale[t] * w_scale[o]. On Hopper XLA runs it as cuBLASLt's FP8 GEMM
(or, for a few rows, its own Triton GEMM of the FP8 operands), reading the weight's FP8 bytes once; stored
[*in, *out] instead, the weight was transposed on every call and the product ran slower than bf16's
(docs/performance.md, "FP8"). Elsewhere XLA emulates the FP8 product.

Legend beyond docs' (STYLE.md): *in / *out the contracted and kept axes of a weight.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxserve.models.lora import FoldedWeight, LoraLinear, add_lora, folded_product

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero channel or row keeps a finite scale (its values are zeros either way)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """A linear weight in FP8: values [*out, *in] in float8_e4m3fn (output-major), scale [*out] in float32 (per
    output channel); the [*in, *out] weight is moveaxis(values, out axes to the back) * scale."""

    values: Array
    scale: Float[Array, "..."]

    @property
    def num_in_axes(self) -> int:
        return self.values.ndim - self.scale.ndim

    def dequantize(self, dtype=jnp.float32) -> Array:
        """The [*in, *out] weight, values * scale, in `dtype` (the float32 reference the tests compare against)."""
        return (serving_order(self.values, self.num_in_axes).astype(jnp.float32) * self.scale).astype(dtype)


def stored_order(w: Array, num_in_axes: int) -> Array:
    """A [*in, *out] array as [*out, *in] (how `Fp8Weight.values` lies)."""
    return jnp.moveaxis(w, tuple(range(num_in_axes)), tuple(range(w.ndim - num_in_axes, w.ndim)))


def serving_order(values: Array, num_in_axes: int) -> Array:
    """`stored_order`'s inverse: [*out, *in] as [*in, *out]."""
    n = values.ndim
    return jnp.moveaxis(values, tuple(range(n - num_in_axes, n)), tuple(range(num_in_axes)))


def dequantized(rhs: Array, rhs_scale: Array | None) -> Array:
    """An FP8 expert stack [E, Din, *out] as float32 values * rhs_scale[E, *out] (rhs itself without a scale): the
    operand of the grouped GEMMs' references (`jaxserve.kernels.moe`) and of `Fp8Experts.dequantize`."""
    return rhs if rhs_scale is None else rhs.astype(jnp.float32) * jnp.expand_dims(rhs_scale, 1)


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class Fp8Experts:
    """A mixture of experts' weight stack in FP8, read by the grouped GEMMs (`jaxserve.kernels.moe`, which convert
    each tile to the rows' dtype in registers): values in the stack's own layout, [E, Din, *out] (gate/up
    [E, D, 2, F], down [E, F, D]), in float8_e4m3fn; scale [E, *out] float32, per expert and output channel (max
    |w| over Din / 448). The weight is values * scale[:, None]."""

    values: Array
    scale: Float[Array, "..."]

    def dequantize(self, dtype=jnp.float32) -> Array:
        """values * scale in `dtype` (the xla backend's and the dense reference's operand; the tests' float32)."""
        return dequantized(self.values, self.scale).astype(dtype)


def _scale(amax: Array) -> Array:
    """The e4m3 scale of values whose largest magnitude is amax: amax maps to 448, e4m3's largest finite value."""
    return jnp.maximum(amax / FP8_MAX, _MIN_SCALE)


def quantize_experts(w: Array) -> Fp8Experts:
    """The FP8 form of an [E, Din, *out] expert stack: a scale per expert and output channel, values rounded to
    nearest in e4m3. Traceable."""
    if w.ndim < 3:
        raise ValueError(f"an expert stack is [E, Din, *out], got shape {w.shape}")
    w = w.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(w), axis=1))
    return Fp8Experts(values=(w / jnp.expand_dims(scale, 1)).astype(FP8_DTYPE), scale=scale)


def quantized_experts_spec(spec: Any) -> Fp8Experts:
    """The ParamSpec pair of a quantized expert stack: the values as the stack, the scale without its Din axis."""
    scale = dataclasses.replace(
        spec, shape=spec.shape[:1] + spec.shape[2:], logical_axes=spec.logical_axes[:1] + spec.logical_axes[2:]
    )
    return Fp8Experts(values=spec, scale=scale)


def quantize(w: Array, num_in_axes: int) -> Fp8Weight:
    """The FP8 form of a [*in, *out] weight: a scale per output channel (max |w| over the leading num_in_axes
    axes / 448), values rounded to nearest in e4m3. Traceable (the serving-layout fuser runs it per layer)."""
    if not 1 <= num_in_axes < w.ndim:
        raise ValueError(f"num_in_axes must be in [1, {w.ndim - 1}] for a weight of shape {w.shape}, got {num_in_axes}")
    w = w.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(w), axis=tuple(range(num_in_axes))))
    return Fp8Weight(values=stored_order((w / scale).astype(FP8_DTYPE), num_in_axes), scale=scale)


def quantize_rows(x: Array, num_in_axes: int) -> tuple[Array, Float[Array, "..."]]:
    """Dynamic per-token quantization of an input [*rows, *in]: e4m3 values and a float32 scale per row (max |x|
    over the trailing num_in_axes axes / 448), the scale shaped [*rows]."""
    axes = tuple(range(x.ndim - num_in_axes, x.ndim))
    x = x.astype(jnp.float32)
    scale = _scale(jnp.max(jnp.abs(x), axis=axes))
    values = (x / jnp.expand_dims(scale, axes)).astype(FP8_DTYPE)
    return values, scale


def linear(spec: str, x: Array, w: Array | Fp8Weight | LoraLinear, out_dtype: Any = None) -> Array:
    """jnp.einsum(spec, x, w) in `out_dtype` (None: x's dtype; float32 for logits), for a plain weight or an
    `Fp8Weight` (then the FP8 product above), and a `LoraLinear` (either of those with a step's adapters: their
    low-rank product added, `lora.add_lora`; or a plain weight with a folded in, `lora.folded_product`). `spec`
    contracts w's leading axes with x's trailing ones and keeps x's leading axes first, then w's trailing ones, e.g.
    "td,dkge->tkge" or "the,hed->td". An `Fp8Weight` is
    contracted on its stored values' trailing axes in order (dot_general with no transpose of either operand:
    XLA hands both to the GEMM as they lie)."""
    if isinstance(w, LoraLinear):
        if isinstance(w.base, FoldedWeight):  # a folded into the weight: one GEMM for x @ w and x @ a
            return folded_product(x, w).astype(out_dtype or x.dtype)
        return add_lora(linear(spec, x, w.base, out_dtype), x, w).astype(out_dtype or x.dtype)
    if not isinstance(w, Fp8Weight):
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    num_in = w.num_in_axes
    rows = x.ndim - num_in
    x_in = tuple(range(rows, x.ndim))
    w_in = tuple(range(w.values.ndim - num_in, w.values.ndim))
    if x.shape[rows:] != w.values.shape[w.scale.ndim :]:
        raise ValueError(
            f"{spec}: input {x.shape} does not end in the weight's input axes {w.values.shape[w.scale.ndim :]}"
        )
    xq, x_scale = quantize_rows(x, num_in)
    out = jax.lax.dot_general(xq, w.values, ((x_in, w_in), ((), ())), preferred_element_type=jnp.float32)
    x_scale = x_scale.reshape(x_scale.shape + (1,) * w.scale.ndim)
    return (out * x_scale * w.scale).astype(x.dtype if out_dtype is None else out_dtype)


def check_lm_head_quantization(tied: bool, quantization: str | None, quantize_lm_head: bool) -> None:
    """ValueError unless quantize_lm_head is off, or on with a quantization and an untied lm_head."""
    if not quantize_lm_head:
        return
    if quantization is None:
        raise ValueError("quantize_lm_head=True needs quantization='fp8' (the lm_head is quantized as the linears are)")
    if tied:
        raise ValueError(
            "quantize_lm_head=True: this model ties its lm_head to the embedding (tie_word_embeddings), which stays "
            "in the serving dtype; only an untied lm_head is quantized"
        )


def lm_head_spec(spec: Any, quantization: str | None, quantize_lm_head: bool) -> Any:
    """The serving spec of a family's lm_head ([D, V], None when tied): as it is, or its FP8 pair (values [V, D],
    scale [V]: a scale per vocabulary entry) with quantize_lm_head."""
    check_lm_head_quantization(spec is None, quantization, quantize_lm_head)
    return quantized_spec(spec, 1) if quantize_lm_head else spec


def place_or_quantize(value: Any, sharding: Any, dtype: Any, quantize: bool) -> Any:
    """A family's top-level weight (embed, final_norm, lm_head; None stays None) on the device: placed as
    `common.place` places it, or with `quantize` (an untied lm_head under quantize_lm_head) quantized on the device
    from its source values as a linear of one input axis, into an `Fp8Weight` with `sharding` (its values' and
    scale's)."""
    from jaxserve.models.common import place  # common imports this module

    if value is None or not quantize:
        return None if value is None else place(value, sharding, dtype)
    return _lm_head_quantizer(sharding)(value)


@functools.lru_cache(maxsize=16)
def _lm_head_quantizer(sharding: Any) -> Any:
    return jax.jit(lambda w: quantize(w, 1), out_shardings=sharding)


def quantized_spec(spec: Any, num_in_axes: int) -> Fp8Weight:
    """The ParamSpec pair of a quantized weight (`models.common.ParamSpec`): the values as the weight's axes in
    stored order ([*out, *in]), the scale as its output axes."""
    n = num_in_axes
    values = dataclasses.replace(
        spec, shape=spec.shape[n:] + spec.shape[:n], logical_axes=spec.logical_axes[n:] + spec.logical_axes[:n]
    )
    scale = dataclasses.replace(spec, shape=spec.shape[n:], logical_axes=spec.logical_axes[n:])
    return Fp8Weight(values=values, scale=scale)


def quantize_linears(
    layer: Any, convert: Callable[[Any, int], Any], convert_experts: Callable[[Any], Any] | None = None
) -> Any:
    """`layer` (a serving-layout dataclass) with each linear weight its class declares in LINEARS (field name ->
    contracted leading axes) replaced by convert(weight, num_in_axes), each expert stack it declares in EXPERTS by
    convert_experts(stack), nested dataclasses likewise (an MoE layer's MLP). convert / convert_experts: `quantize`
    / `quantize_experts` for arrays, `quantized_spec` / `quantized_experts_spec` for ParamSpecs."""
    changes = {}
    for field in dataclasses.fields(layer):
        value = getattr(layer, field.name)
        if value is None:
            continue
        if field.name in getattr(type(layer), "LINEARS", {}):
            changes[field.name] = convert(value, type(layer).LINEARS[field.name])
        elif field.name in getattr(type(layer), "EXPERTS", ()) and convert_experts is not None:
            changes[field.name] = convert_experts(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes[field.name] = quantize_linears(value, convert, convert_experts)
    return dataclasses.replace(layer, **changes)


def quantize_layer(layer: Any, quantization: str | None) -> Any:
    """A serving layer's linear weights and expert stacks in `quantization` (None: as they are)."""
    return layer if quantization is None else quantize_linears(layer, quantize, quantize_experts)


def quantize_layer_specs(layer: Any, quantization: str | None) -> Any:
    """A serving layer's ParamSpecs with its linear weights' and expert stacks' specs as `quantization` stores
    them."""
    return layer if quantization is None else quantize_linears(layer, quantized_spec, quantized_experts_spec)

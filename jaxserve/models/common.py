"""Shared building blocks of every model family: parameter specs, checkpoint rules, config.json value
checks, norms, rotary embeddings (every scaling variant of the dense families), the split of a fused qkv
projection and the gated MLP.

Family files import these; nothing here knows about a particular architecture.

Shape legend (used in einsum strings and jaxtyping annotations): T tokens (flat), B sequences,
D model dim, F MLP hidden, V vocab, H query heads, K kv heads, Dh head dim, L layers, E experts.
"""

from __future__ import annotations

import functools
import math
import reprlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxserve.models.quant import linear


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """Shape and logical sharding axes of one weight; `jaxserve/sharding/rules.py` maps the axes to the mesh.

    Logical axis names: "layers", "vocab", "embed" (D), "heads" (H), "kv_heads" (K), "head_dim" (Dh),
    "mlp" (F), "experts" (E), or None for a dimension that is never split.
    """

    shape: tuple[int, ...]
    logical_axes: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"ParamSpec shape {self.shape} and logical_axes {self.logical_axes} differ in rank")


@dataclass(frozen=True, slots=True)
class CheckpointRule:
    """Maps checkpoint tensors (Hugging Face names) onto one field of a weights dataclass.

    `pattern` is a regular expression matched against the whole Hugging Face tensor name; for a
    stacked per-layer field it has exactly one group, the layer index. `field` is the dataclass
    path, e.g. "layers.wq". `transform`:
      - "linear": a torch Linear weight [out, in]; transposed to [in, out], then reshaped to the
        field's per-layer shape (e.g. [D, H*Dh] -> [D, H, Dh]);
      - "reshape": reshaped to the field's per-layer shape (biases, norms, embeddings);
      - "skip": tensors the model does not read (a multimodal checkpoint's vision tower); `field` is "" and the
        loader logs how many it skipped.
    A field stacked over more than the layers (a mixture of experts' [L, E, ...] weights) has one group per
    stacked axis, in order (layer, then expert). `layers`: for a field stacked over some of the model's layers
    only (an MoE model's dense layers, or its expert layers), the model layer each slot holds, in order; the
    pattern's first group is the model's layer index, and a tensor of any other layer is refused.
    """

    pattern: str
    field: str
    transform: Literal["linear", "reshape", "skip"] = "reshape"
    layers: tuple[int, ...] | None = None


_KIND_NOUNS = {
    "int": "an int",
    "number": "a number",
    "bool": "a bool (true or false)",
    "str": "a string",
    "object": "a JSON object",
    "str_list": "a list of strings",
    "int_list": "a list of ints",
}
_KIND_TYPES = {"bool": bool, "str": str, "object": dict}


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """What one config.json value must be: its JSON type and, for numbers, a bound.

    `at_least` is an inclusive lower bound (counts: "an int >= 1"), `above` an exclusive one
    ("a number > 0"). A bool is never taken for a number, a float never for an int.
    """

    kind: Literal["int", "number", "bool", "str", "object", "str_list", "int_list"]
    at_least: float | None = None
    above: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KIND_NOUNS:
            raise ValueError(f"ConfigKey kind must be one of {', '.join(_KIND_NOUNS)}, got {self.kind!r}")

    def describe(self) -> str:
        text = _KIND_NOUNS[self.kind]
        if self.at_least is not None:
            text += f" >= {self.at_least:g}"
        if self.above is not None:
            text += f" > {self.above:g}"
        return text

    def accepts(self, value: object) -> bool:
        if self.kind in ("int", "number"):
            if isinstance(value, bool) or not isinstance(value, int if self.kind == "int" else (int, float)):
                return False
            return (self.at_least is None or value >= self.at_least) and (self.above is None or value > self.above)
        if self.kind == "str_list":
            return isinstance(value, list) and all(isinstance(v, str) for v in value)
        if self.kind == "int_list":
            return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return isinstance(value, _KIND_TYPES[self.kind])


def check_config_keys(
    config: Mapping, keys: Mapping[str, ConfigKey], *, required: Collection[str] = (), prefix: str = ""
) -> None:
    """Checks the values of `config` named in `keys` (absent ones are not checked; null means "the default"
    unless the key is `required`), e.g. "num_hidden_layers must be an int >= 1, got 'thirty'"."""
    for name, key in keys.items():
        if name not in config or (config[name] is None and name not in required):
            continue
        value = config[name]
        if not key.accepts(value):
            shown = "null" if value is None else reprlib.repr(value)
            raise ValueError(f"{prefix}{name} must be {key.describe()}, got {shown}")


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings
# ----------------------------------------------------------------------------------------------

RopeVariant = Literal["default", "linear", "dynamic", "llama3", "yarn"]
_ROPE_VARIANTS: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")
_NUMBER = ConfigKey("number")
# The rope keys `RopeConfig.from_hf` reads at the top of config.json, and inside its rope_scaling /
# rope_parameters object.
_ROPE_TOP_KEYS = {
    "rope_scaling": ConfigKey("object"),
    "rope_parameters": ConfigKey("object"),
    "rope_theta": ConfigKey("number", above=0),
    "partial_rotary_factor": _NUMBER,
    "original_max_position_embeddings": ConfigKey("int", at_least=1),
}
_ROPE_PARAMETER_KEYS = {
    "rope_type": ConfigKey("str"),
    "type": ConfigKey("str"),
    "rope_theta": ConfigKey("number", above=0),
    "partial_rotary_factor": _NUMBER,
    "factor": ConfigKey("number", above=0),
    "original_max_position_embeddings": ConfigKey("int", at_least=1),
    **dict.fromkeys(("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"), _NUMBER),
    **dict.fromkeys(("attention_factor", "mscale", "mscale_all_dim"), _NUMBER),
    "truncate": ConfigKey("bool"),
}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, one scaling variant of the ones Hugging Face uses for dense decoders.

    `original_max_position_embeddings` is the context length the scaling is relative to: the
    pretraining length for "llama3" and "yarn", the model's `max_position_embeddings` for "dynamic"
    (that is what Hugging Face divides by). `attention_factor` (yarn only) scales cos and sin; None
    derives it from `factor`, `mscale` and `mscale_all_dim` as Hugging Face does.
    """

    theta: float = 10000.0
    variant: RopeVariant = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.variant not in _ROPE_VARIANTS:
            raise ValueError(f"rope variant must be one of {_ROPE_VARIANTS}, got {self.variant!r}")
        if not self.theta > 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        needs_length = self.variant in ("dynamic", "llama3", "yarn")
        if needs_length and (self.original_max_position_embeddings or 0) < 1:
            raise ValueError(
                f"rope variant {self.variant!r} needs original_max_position_embeddings >= 1, "
                f"got {self.original_max_position_embeddings}"
            )
        if self.variant == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor, got {self.high_freq_factor} "
                f"and {self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, hf: dict, *, max_position_embeddings: int) -> RopeConfig:
        """Reads `rope_parameters` (transformers >= 5) or the older `rope_theta` + `rope_scaling`."""
        check_config_keys(hf, _ROPE_TOP_KEYS)
        source = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        params = dict(hf.get(source) or {})
        check_config_keys(params, _ROPE_PARAMETER_KEYS, prefix=f"{source}.")
        variant = params.get("rope_type", params.get("type", "default"))
        if variant not in _ROPE_VARIANTS:
            raise ValueError(f"rope_type must be one of {_ROPE_VARIANTS}, got {variant!r}")
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor must be 1.0 for this family, got {partial}")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        # Phi-3-style configs keep the pretraining length next to rope_scaling; Hugging Face prefers it.
        original = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
        if variant == "dynamic":
            original = max_position_embeddings
        elif variant in ("llama3", "yarn") and original is None:
            original = max_position_embeddings
        factor = params.get("factor")
        if factor is None:
            # Yarn without a factor (DeepSeek-style) stretches to max_position_embeddings.
            factor = max_position_embeddings / original if variant == "yarn" else 1.0
        return cls(
            theta=float(theta),
            variant=variant,
            factor=float(factor),
            original_max_position_embeddings=None if variant in ("default", "linear") else int(original),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )

    def attention_scaling(self) -> float:
        """Factor on cos and sin (so on q and k): 1.0 except for yarn."""
        if self.variant != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)


def _yarn_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Blends interpolated (slow) and extrapolated (fast) frequencies with a linear ramp over dims."""
    base, dim, original = rope.theta, head_dim, rope.original_max_position_embeddings
    assert original is not None

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids a division by zero, as Hugging Face does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 / rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    interpolation = extrapolation / rope.factor
    return interpolation * ramp + extrapolation * (1.0 - ramp)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend in between."""
    assert rope.original_max_position_embeddings is not None
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [Dh/2] (float32) of every variant except "dynamic", which depends on positions.

    Computed on the host in float64 and rounded once, so they are the correctly rounded values.
    """
    if rope.variant == "dynamic":
        raise ValueError("dynamic NTK rope depends on the positions; use rope_frequencies")
    if rope.variant == "yarn":
        return _yarn_inv_freq(rope, head_dim).astype(np.float32)
    inv_freq = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope.variant == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.variant == "llama3":
        inv_freq = _llama3_inv_freq(rope, inv_freq)
    return inv_freq.astype(np.float32)


def _dynamic_inv_freq(rope: RopeConfig, head_dim: int, positions: Int[Array, " T"]) -> Float[Array, " Dh/2"]:
    """Dynamic NTK: the base grows with the longest sequence in this batch.

    Hugging Face recomputes `inv_freq` whenever max(position) + 1 exceeds the lengths it has seen,
    and goes back to the unscaled frequencies below `max_position_embeddings`. Here the scale is a
    pure function of this call's positions: seq_len = max(max(positions) + 1, max_position_embeddings)
    over every token of the batch. During generation positions only grow, so this matches Hugging
    Face step for step; keys already in the cache keep the rotation they were written with, as in
    Hugging Face's cache. A consequence: a token's frequencies depend on the other sequences in its
    batch once any of them is longer than max_position_embeddings.
    """
    original = rope.original_max_position_embeddings
    assert original is not None
    seq_len = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1.0, float(original))
    base = rope.theta * ((rope.factor * seq_len / original) - (rope.factor - 1.0)) ** (head_dim / (head_dim - 2))
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    return 1.0 / base**exponents


def rope_frequencies(
    rope: RopeConfig, head_dim: int, positions: Int[Array, " T"]
) -> tuple[Float[Array, "T Dh/2"], Float[Array, "T Dh/2"]]:
    """cos and sin of position * inv_freq, in float32, already multiplied by the attention scaling.

    float32 on purpose: positions reach 1e5 and beyond, and in bfloat16 (8 mantissa bits) the angle
    position * inv_freq would be off by whole radians, scrambling exactly the relative positions
    rope exists to encode.
    """
    if rope.variant == "dynamic":
        inv_freq = _dynamic_inv_freq(rope, head_dim, positions)
    else:
        inv_freq = jnp.asarray(rope_inv_freq(rope, head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    scaling = rope.attention_scaling()
    return jnp.cos(angles) * scaling, jnp.sin(angles) * scaling


def split_qkv(
    qkv: Float[Array, "T K G+2 Dh"],
) -> tuple[Float[Array, "T H Dh"], Float[Array, "T K Dh"], Float[Array, "T K Dh"]]:
    """q, k and v of a fused projection grouped by kv head (for each kv head its G query heads, then its key,
    then its value): query head k * G + g reads kv head k, as in Hugging Face's repeat_kv."""
    num_tokens, num_kv_heads, group_and_kv, head_dim = qkv.shape
    group = group_and_kv - 2
    q = qkv[:, :, :group].reshape(num_tokens, num_kv_heads * group, head_dim)
    return q, qkv[:, :, group], qkv[:, :, group + 1]


def apply_rope(
    x: Float[Array, "T N Dh"], cos: Float[Array, "T Dh/2"], sin: Float[Array, "T Dh/2"]
) -> Float[Array, "T N Dh"]:
    """Rotate-half (NeoX / Hugging Face) convention: dims i and i + Dh/2 form a rotating pair.

    Computed in float32 for the same reason as `rope_frequencies`; the result has x's dtype.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Norms and MLP
# ----------------------------------------------------------------------------------------------


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "... D"]:
    """RMSNorm over the last axis, statistics in float32.

    The weight multiplies after the cast back to x's dtype, as Hugging Face Llama does; multiplying
    before the cast rounds differently in bfloat16 and drifts from the reference.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed.astype(x.dtype) * weight).astype(x.dtype)


def gated_mlp(
    x: Float[Array, "T D"], w_gate_up: Float[Array, "D 2 F"], w_down: Float[Array, "F D"]
) -> Float[Array, "T D"]:
    """SwiGLU, down(silu(gate(x)) * up(x)), with gate and up in one matrix: one GEMM for both."""
    gate_up = linear("td,dcf->tcf", x, w_gate_up)
    return linear("tf,fd->td", jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)


def place(value: Any, sharding: Any, dtype: Any = None) -> Any:
    """An array on the device (with `sharding`, or the default device's when None), floating-point
    values cast to `dtype` when given; always a buffer of its own, never `value`'s (whoever holds the
    result may free it: the runner does on sleep, close and update_weights). `value` may lie on other
    devices than `sharding`'s (a trainer's mesh)."""
    if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating) and value.dtype != dtype:
        if sharding is not None:  # jit refuses an argument laid out over other devices than its output
            value = jax.device_put(value, sharding)
        return _caster(jnp.dtype(dtype), sharding)(value)
    if isinstance(value, jax.Array):
        value = jnp.copy(value)  # device_put hands back the same array when it is already in place
    return jax.device_put(value, sharding)


def serving_layers(
    layers: Any, num_layers: int, fuse: Any, source: Any = None, replacing: tuple | None = None
) -> tuple:
    """Each layer of stacked [L, ...] checkpoint-layout weights (numpy or jax arrays) through `fuse` (a jitted
    function to one serving layer), one layer at a time: host weights cross to the device layer by layer, and
    the device holds the serving copy plus one layer of the source at most. `source`: shardings each layer is
    first moved to (the checkpoint layout on the serving mesh, so `fuse` sees one input layout whatever the
    trainer's); `replacing`: serving layers whose buffers are deleted as their replacements are built."""
    on_device = all(isinstance(w, jax.Array) for w in jax.tree.leaves(layers))
    out = []
    for i in range(num_layers):
        # Device arrays: one compiled slice of every weight per layer (slicing them one op at a time
        # dispatches and compiles each op: a second at start on CPU); host arrays: numpy views.
        layer = take_layer(layers, i) if on_device else jax.tree.map(lambda w, i=i: w[i], layers)
        out.append(fuse(layer if source is None else jax.device_put(layer, source)))
        # Waited for: dispatch is asynchronous, and without the wait every layer's transfer is in flight at once,
        # each holding a host staging copy of its numpy source (a 61 GB model then needs twice that in RAM).
        jax.block_until_ready(out[-1])
        if replacing is not None:
            delete_arrays(replacing[i])
    return tuple(out)


@jax.jit
def take_layer(layers: Any, i: Int[Array, ""]) -> Any:
    """Layer i of stacked [L, ...] weights (i traced: one executable serves every layer)."""
    return jax.tree.map(lambda w: w[i], layers)


def delete_arrays(tree: Any) -> None:
    """Frees the device buffers of a tree's jax arrays now, rather than when the last reference goes."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


@functools.lru_cache(maxsize=64)
def _caster(dtype: Any, sharding: Any) -> Any:
    return jax.jit(lambda w: w.astype(dtype), out_shardings=sharding)

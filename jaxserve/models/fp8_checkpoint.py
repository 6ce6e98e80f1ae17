"""FP8 checkpoints as they are published: a Hugging Face config's `quantization_config` and the scale tensors
beside each FP8 weight, turned back into float32 weights at load (the engine then quantizes them again per output
channel: `quantization="fp8"`, which `LLM` turns on for these checkpoints).

Formats read:
- `quant_method: "fp8"` (transformers' FineGrainedFP8, the Qwen3 and DeepSeek FP8 releases): `X.weight` in
  float8_e4m3fn [out, in] and `X.weight_scale_inv` in float32, [ceil(out / bo), ceil(in / bi)] for
  `weight_block_size: [bo, bi]` (each block's weight is values * scale_inv), or one value per tensor without a
  block size. `activation_scheme` "dynamic" (ours is dynamic either way).
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (or "naive-quantized") and 8-bit float
  weights (llm-compressor's FP8 releases, e.g. the FP8 Llama models): `X.weight` in float8_e4m3fn [out, in] and
  `X.weight_scale` [out, 1] (strategy "channel") or [1] / [] (strategy "tensor"); `X.input_scale` (a static
  activation scale) is dropped, with one log line: activations are quantized per token at run time.
Calibrated KV-cache scales (`self_attn.k_scale`, `v_scale`, or one `kv_scale` for both: a `kv_cache_scheme`, one
value a layer) are folded into the attention weights at load (`folded_kv_scales`; scale tensors in a checkpoint
whose config declares no scheme are dropped): k_proj is divided by k_scale and q_proj multiplied by it (or, with
Qwen3's and Gemma 3's q/k norms, which would undo a scale on the projection, the norm weights), v_proj divided by
v_scale and o_proj multiplied by it. The model computes the same function, and the
K and V it writes are K / k_scale and V / v_scale: what an FP8 KV cache (`kv_cache_dtype="fp8"`) stores is e4m3 of
those, as the calibration intends, with no scale left to apply at run time (on any attention backend).
Any other `quant_method`, format or weight type is an error that names it. Tensors without a scale (norms,
embeddings, the layers a config leaves unquantized) are read as they are.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

_SCALE_SUFFIXES = {"fp8": ".weight_scale_inv", "compressed-tensors": ".weight_scale"}
# One layer's attention tensors, and its KV-cache scales: (prefix, tensor) of a Hugging Face name.
_ATTENTION_TENSOR = re.compile(r"(.*\.layers\.\d+\.self_attn\.)((?:[qkvo]_proj\.(?:weight|bias))|[qk]_norm\.weight)")
_KV_SCALE = re.compile(r"(.*\.layers\.\d+\.self_attn\.)(k_scale|v_scale|kv_scale)")


@dataclass(frozen=True, slots=True)
class Fp8CheckpointFormat:
    """How a checkpoint's FP8 weights are scaled. block: (bo, bi) for block-wise scales, None for per-tensor or
    per-channel ones (the scale's shape says which)."""

    method: str  # "fp8" | "compressed-tensors"
    block: tuple[int, int] | None

    @property
    def scale_suffix(self) -> str:
        return _SCALE_SUFFIXES[self.method]


def checkpoint_format(hf_config: dict) -> Fp8CheckpointFormat | None:
    """The FP8 format of a config's `quantization_config` (None without one); a ValueError names anything else."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config fmt {qc.get('fmt')!r} is not supported: FP8 weights must be e4m3")
        block = qc.get("weight_block_size")
        if block is not None and (
            not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block)
        ):
            raise ValueError(f"quantization_config weight_block_size must be [rows, columns], got {block!r}")
        return Fp8CheckpointFormat("fp8", None if block is None else (block[0], block[1]))
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return Fp8CheckpointFormat("compressed-tensors", None)
    raise ValueError(
        f"quantization_config quant_method {method!r} is not supported: jaxserve reads FP8 checkpoints "
        "('fp8', and 'compressed-tensors' with float-quantized 8-bit weights)"
    )


def _check_compressed_tensors(qc: dict) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported: jaxserve reads 'float-quantized' FP8 weights"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ValueError(
                f"compressed-tensors config group {name!r} has {weights.get('num_bits')}-bit {weights.get('type')} "
                "weights: jaxserve reads 8-bit float (FP8) weights only"
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors config group {name!r} has weight strategy {weights.get('strategy')!r}: "
                "jaxserve reads 'tensor' and 'channel' scales"
            )


def dequantize(values: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    """float32 values * scale: one scale per (bo, bi) block of [out, in] values, or a scale that broadcasts
    against them ([out, 1] per channel, [1] or [] per tensor)."""
    values, scale = values.astype(np.float32), np.asarray(scale, np.float32)
    if block is None:
        return values * (scale if scale.ndim == values.ndim else scale.reshape(-1)[0])
    (out, inp), (bo, bi) = values.shape, block
    want = (-(-out // bo), -(-inp // bi))
    if scale.shape != want:
        got = list(scale.shape)
        raise ValueError(f"a [{out}, {inp}] weight with {bo} x {bi} blocks needs a {list(want)} scale, got {got}")
    return values * np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[:out, :inp]


def dequantized_tensors(
    tensors: Iterator[tuple[str, np.ndarray]], fmt: Fp8CheckpointFormat
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each FP8 weight and its scale replaced by the float32 weight (a weight waits
    for its scale, and the scale for its weight, in whatever order the files hold them); a weight without its
    scale, or a scale without its weight, is a ValueError that names it."""
    waiting_values: dict[str, np.ndarray] = {}
    waiting_scales: dict[str, np.ndarray] = {}
    dropped = 0
    for name, array in tensors:
        if name.endswith(".input_scale"):
            dropped += 1
            continue
        if name.endswith(fmt.scale_suffix):
            base = name.removesuffix(fmt.scale_suffix) + ".weight"
            if base in waiting_values:
                yield base, _dequantized(base, waiting_values.pop(base), array, fmt)
            else:
                waiting_scales[base] = array
        elif array.dtype.name.startswith("float8"):
            if name in waiting_scales:
                yield name, _dequantized(name, array, waiting_scales.pop(name), fmt)
            else:
                waiting_values[name] = array
        else:
            yield name, array
    if waiting_values:
        name = next(iter(waiting_values))
        raise ValueError(f"FP8 weight {name!r} has no {name.removesuffix('.weight')}{fmt.scale_suffix} beside it")
    if waiting_scales:
        name = next(iter(waiting_scales))
        raise ValueError(f"scale {name.removesuffix('.weight')}{fmt.scale_suffix} has no FP8 weight {name!r}")
    if dropped:
        logger.info(
            "FP8 checkpoint: %d static activation scales (input_scale) dropped: activations are quantized "
            "per token at run time",
            dropped,
        )


def _dequantized(name: str, values: np.ndarray, scale: np.ndarray, fmt: Fp8CheckpointFormat) -> np.ndarray:
    try:
        return dequantize(values, scale, fmt.block)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


def has_kv_cache_scales(hf_config: dict) -> bool:
    """Whether the config's quantization_config declares calibrated KV-cache scales (a `kv_cache_scheme`)."""
    return (hf_config.get("quantization_config") or {}).get("kv_cache_scheme") is not None


def folded_kv_scales(
    tensors: Iterator[tuple[str, np.ndarray]], *, calibrated: bool, qk_norm: bool, norm_offset: float = 0.0
) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors with each layer's KV-cache scales folded into its attention weights (module
    docstring), the scale tensors themselves consumed. calibrated: the config declares the scales
    (`has_kv_cache_scales`); without that, scale tensors are dropped with a log line and nothing waits. qk_norm:
    the layers normalise q and k per head (the k scale goes into the norm weights); norm_offset: 1 where the norm
    multiplies by (1 + w) (Gemma). A layer's attention tensors wait for its scales; a layer without scales keeps
    its weights (a scale of 1)."""
    if not calibrated:
        yield from _without_kv_scales(tensors)
        return
    waiting: dict[str, list[tuple[str, np.ndarray]]] = defaultdict(list)
    scales: dict[str, dict[str, float]] = defaultdict(dict)
    folded = 0

    def fold(prefix: str, tensor: str, array: np.ndarray) -> np.ndarray:
        k, v = scales[prefix]["k"], scales[prefix]["v"]
        factor = {
            "q_proj": 1.0 if qk_norm else k,
            "k_proj": 1.0 if qk_norm else 1.0 / k,
            "v_proj": 1.0 / v,
            "o_proj": v if tensor.endswith("weight") else 1.0,  # o_proj's bias is added after the product
            "q_norm": k,
            "k_norm": 1.0 / k,
        }[tensor.split(".")[0]]
        if factor == 1.0:
            return array
        if tensor.endswith("norm.weight"):  # (offset + w) * factor = offset + w'
            return ((norm_offset + array.astype(np.float32)) * factor - norm_offset).astype(array.dtype)
        return (array.astype(np.float32) * np.float32(factor)).astype(array.dtype)

    for name, array in tensors:
        scale = _KV_SCALE.fullmatch(name)
        if scale is not None:
            prefix, which = scale.groups()
            if np.size(array) != 1:
                raise ValueError(f"KV-cache scale {name} has shape {list(np.shape(array))}: one value a layer is read")
            for key in ("k", "v") if which == "kv_scale" else (which[0],):
                scales[prefix][key] = float(np.asarray(array, np.float32).reshape(()))
            if len(scales[prefix]) == 2:
                folded += 1
                for waiting_name, waiting_array in waiting.pop(prefix, []):
                    yield waiting_name, fold(prefix, waiting_name[len(prefix) :], waiting_array)
            continue
        attention = _ATTENTION_TENSOR.fullmatch(name)
        if attention is None:
            yield name, array
        elif len(scales.get(attention.group(1), {})) == 2:
            yield name, fold(attention.group(1), attention.group(2), array)
        else:
            waiting[attention.group(1)].append((name, array))
    for prefix, pair in scales.items():
        if len(pair) != 2:
            raise ValueError(f"{prefix}{'k' if 'v' in pair else 'v'}_scale is missing beside its pair")
    for held in waiting.values():  # layers without scales: as they are
        yield from held
    if folded:
        logger.info(
            "FP8 checkpoint: the KV-cache scales of %d layers folded into their attention weights (an FP8 KV "
            "cache stores K / k_scale and V / v_scale)",
            folded,
        )


def _without_kv_scales(tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors less any KV-cache scale (a checkpoint whose config declares no kv_cache_scheme)."""
    dropped = 0
    for name, array in tensors:
        if _KV_SCALE.fullmatch(name) is None:
            yield name, array
        else:
            dropped += 1
    if dropped:
        logger.info("FP8 checkpoint: %d KV-cache scales without a kv_cache_scheme dropped (a scale of 1)", dropped)

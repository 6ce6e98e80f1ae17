"""LoRA adapters on the host: what a request names (`LoRARequest`, vLLM's), an adapter read from a PEFT directory or
from PEFT-named arrays in memory (`LoraAdapter`), and which adapter holds which of the engine's slots
(`LoraSlots`, least recently used first out). The device side is `jaxserve/models/lora.py`.

An adapter is kept as its (layer, module) -> (A, B) pairs as they came, without a copy or a cast on the host: PEFT's
layout (lora_A.weight [r, in], lora_B.weight [out, r]) or qwix's, transposed (A [in, r], B [r, out]), as float32 or
bfloat16 numpy arrays (arrays on a device are copied to the host in their dtype; other dtypes are read as float32);
and its scaling (alpha / r, or alpha / sqrt(r) with rsLoRA). The engine writes them into a slot of its tables
(transposed where needed, scaled, cast and placed on the device) when a request needs the adapter.

Host policy: no jax here.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# The modules adapters may target (models/lora.py MODULES): attention's q/k/v/o and the MLP's gate/up/down.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A PEFT tensor name: [base_model.model.][model.][language_model.]layers.N.(self_attn|mlp).MODULE.lora_(A|B)
# [.adapter].weight
_PEFT_NAME = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight"
)
# adapter_config.json options that change what the adapter computes beyond x @ A @ B * scaling: refused by name.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained modules besides the adapter)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "lora_bias": "lora_bias",
    "use_qalora": "QALoRA (use_qalora)",
}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request is served with (vLLM's `LoRARequest`): its name, a positive integer id, and the PEFT
    directory it is read from the first time (None: an adapter the LLM already holds, `LLM.load_lora`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """An adapter's weights: (layer, module) -> (A [r, in], B [out, r]) (PEFT's lora_A / lora_B) or, `transposed`,
    (A [in, r], B [r, out]) (qwix's), float32 or bfloat16; the scaling its product is multiplied by; its rank;
    `version`, which changes whenever its weights do (the prefix cache keys blocks by it); and `path`, the PEFT
    directory it was read from (None: from memory), which the other processes of a multi-process run read it from."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    scaling: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)  # its adapter_config (what a later update is read with)
    version: int = 0
    transposed: bool = False
    path: str | None = None

    def __post_init__(self) -> None:
        # One dtype for all its arrays (the kind of adapter the engine's slot writes are compiled for): float32
        # where they differ.
        if len({array.dtype for pair in self.weights.values() for array in pair}) > 1:
            for key, (a, b) in self.weights.items():
                self.weights[key] = (a.astype(np.float32), b.astype(np.float32))

    @property
    def dtype(self) -> np.dtype:
        """Its arrays' dtype: float32 or bfloat16."""
        a, _ = next(iter(self.weights.values()))
        return a.dtype

    def peft_shapes(self) -> dict[tuple[int, str], tuple[tuple[int, ...], tuple[int, ...]]]:
        """(layer, module) -> the shapes of A and B in PEFT's layout ([r, in], [out, r]), whatever the stored one."""
        if not self.transposed:
            return {key: (a.shape, b.shape) for key, (a, b) in self.weights.items()}
        return {key: (a.shape[::-1], b.shape[::-1]) for key, (a, b) in self.weights.items()}

    @property
    def cache_root(self) -> bytes:
        """The root of this adapter's prefix-cache hashes: a block computed under it is never reused for the base
        model, another adapter, or another version of it."""
        return hashlib.blake2b(f"lora\0{self.name}\0{self.version}".encode(), digest_size=16).digest()


def read_adapter(name: str, source: Any, config: Any = None) -> LoraAdapter:
    """An adapter from a PEFT directory (a path; `config` None), from PEFT-named tensors in memory with their
    adapter_config (`from_peft`), or from a tunix / qwix parameter tree (`*_lora_a` / `*_lora_b`, nested or
    dotted names) with a config giving qwix's lora_alpha (`from_qwix`)."""
    if isinstance(source, str | os.PathLike):
        if config is not None:
            raise ValueError(f"LoRA adapter {name!r}: a PEFT directory brings its own adapter_config; pass no config")
        return read_peft_dir(name, source)
    if not isinstance(source, Mapping):
        raise TypeError(f"LoRA adapter {name!r}: a PEFT directory or a dict of tensors, got {type(source).__name__}")
    if config is None:
        raise ValueError(f"LoRA adapter {name!r}: tensors in memory need their adapter_config (config=...)")
    flat = flat_names(source)
    _start_host_copies(flat.values())
    if any(_QWIX_NAME.fullmatch(key) for key in flat):
        return from_qwix(name, flat, config)
    return from_peft(name, flat, config)


def split_qwix(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the base parameters, the qwix LoRA parameters `*_lora_a` / `*_lora_b`) of a flat parameter dict."""
    lora = {key: value for key, value in flat.items() if key.endswith(("_lora_a", "_lora_b"))}
    return {key: value for key, value in flat.items() if key not in lora}, lora


def flat_names(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A nested dict (a Flax NNX pure dict: layer indices as int keys) as {dotted name: leaf}; a flat one as is."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = getattr(node, "value", node)  # an nnx Variable's value

    walk(tree, "")
    return flat


# tunix's projections with qwix's LoRA pair beside them: Llama3 / Qwen3's q/k/v/o weights `w` and every family's
# MLP kernels (a projection each), and Gemma's einsum weights (q / kv / qkv: one A for the projections they hold).
_QWIX_NAME = re.compile(r"layers\.(\d+)\.(?:attn|mlp)\.(\w+_proj|\w+_einsum)\.(?:w|kernel)_lora_([ab])")
# Gemma's einsum weights: the projections each holds, in the order of its b's leading axis after the rank (one
# projection: no such axis). qwix gives an einsum's A the weight's contracted axes then the rank, and B the rank then
# its other axes: q_einsum A [D, r], B [r, H, Dh]; kv_einsum B [r, 2, K, Dh]; qkv_einsum B [r, 3, H, Dh];
# attn_vec_einsum A [H, Dh, r], B [r, D].
_QWIX_EINSUMS = {
    "q_einsum": ("q_proj",),
    "kv_einsum": ("k_proj", "v_proj"),
    "qkv_einsum": ("q_proj", "k_proj", "v_proj"),
    "attn_vec_einsum": ("o_proj",),
}


def from_qwix(name: str, flat: Mapping[str, Any], config: Mapping[str, Any]) -> LoraAdapter:
    """An adapter from a tunix model's qwix LoRA parameters: `layers.N.attn.{q,k,v,o}_proj.w_lora_a` [*in, r] /
    `_lora_b` [r, *out] and `layers.N.mlp.{gate,up,down}_proj.kernel_lora_a` / `_lora_b` (their input and output
    axes in tunix's order, which is Hugging Face's once flattened), or a Gemma's `layers.N.attn.{q,kv,qkv,
    attn_vec}_einsum.w_lora_a` / `_lora_b` (`_QWIX_EINSUMS`), scaled by qwix's alpha / r (config {"lora_alpha":
    alpha}). Other parameters are an error: pass the LoRA parameters only."""
    alpha = dict(config).get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(
            f"LoRA adapter {name!r}: a qwix tree needs config={{'lora_alpha': <qwix alpha>}}, got {alpha!r}"
        )
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, value in flat.items():
        match = _QWIX_NAME.fullmatch(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: {key} is not a qwix LoRA parameter of a tunix projection")
        source = match.group(2)
        if source not in MODULES and source not in _QWIX_EINSUMS:
            raise ValueError(f"LoRA adapter {name!r}: {key} targets {source}; adapters may target {list(MODULES)}")
        pairs[(int(match.group(1)), source)][match.group(3)] = host_array(value)
    weights, ranks = {}, set()
    for (layer, source), halves in sorted(pairs.items()):
        if set(halves) != {"a", "b"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {source} has _lora_{''.join(halves)} only")
        a, b = halves["a"], halves["b"]
        rank = a.shape[-1]
        modules = _QWIX_EINSUMS.get(source, (source,))
        if b.shape[0] != rank or (len(modules) > 1 and (b.ndim < 3 or b.shape[1] != len(modules))):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {source}: lora_a {a.shape}, lora_b {b.shape}")
        ranks.add(rank)
        parts = [b] if len(modules) == 1 else [b[:, i] for i in range(len(modules))]
        for module, part in zip(modules, parts, strict=True):  # qwix's layout, 2-D: [in, r] and [r, out]
            if (layer, module) in weights:
                raise ValueError(f"LoRA adapter {name!r}: two qwix parameters of layer {layer} hold {module}")
            weights[(layer, module)] = (a.reshape(-1, rank), part.reshape(rank, -1))
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} holds no qwix LoRA parameters")
    if len(ranks) > 1:
        raise ValueError(f"LoRA adapter {name!r}: its modules have ranks {sorted(ranks)}; one rank is served")
    (rank,) = ranks
    return LoraAdapter(name, rank, weights, alpha / rank, {"lora_alpha": alpha}, transposed=True)


def read_peft_dir(name: str, path: str | os.PathLike) -> LoraAdapter:
    """The adapter a PEFT directory holds (adapter_config.json and adapter_model.safetensors, as
    `PeftModel.save_pretrained` writes them)."""
    from safetensors.numpy import load_file

    directory = Path(path)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {directory} has no adapter_config.json (a PEFT adapter directory)")
    if not weights_path.is_file():
        found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
        raise ValueError(f"LoRA adapter {name!r}: {directory} has no adapter_model.safetensors (found {found})")
    config = json.loads(config_path.read_text())
    return replace(from_peft(name, load_file(str(weights_path)), config), path=str(directory))


def from_peft(name: str, tensors: Mapping[str, Any], config: Mapping[str, Any]) -> LoraAdapter:
    """An adapter from PEFT-named tensors (`lora_A.weight` [r, in], `lora_B.weight` [out, r]; numpy or anything
    np.asarray takes) and its adapter_config (a dict, or a peft `LoraConfig`). ValueError names an unsupported
    option, a tensor that has no place, a module outside `MODULES`, or an A without its B."""
    config = _config_dict(config)
    rank, scaling = _rank_and_scaling(name, config)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, value in tensors.items():
        match = _PEFT_NAME.fullmatch(key)
        if match is None:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key} is not a lora_A / lora_B weight of a decoder layer's projection"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in MODULES:
            raise ValueError(f"LoRA adapter {name!r}: {key} targets {module}; adapters may target {list(MODULES)}")
        pairs[(layer, module)][half] = host_array(value)
    weights = {}
    for (layer, module), halves in sorted(pairs.items()):
        if set(halves) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(halves)} only")
        a, b = halves["A"], halves["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module} has lora_A {a.shape} and lora_B {b.shape}, "
                f"expected [r, in] and [out, r] with r = {rank} (adapter_config's r)"
            )
        weights[(layer, module)] = (a, b)
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} holds no lora_A / lora_B weights")
    return LoraAdapter(name, rank, weights, scaling, config)


def _start_host_copies(values: Any) -> None:
    """Starts every device array's copy to host memory at once (jax's `copy_to_host_async`): `host_array` then
    waits for each, instead of one blocking copy after another (~0.4 ms each for a few hundred arrays)."""
    for value in values:
        start = getattr(value, "copy_to_host_async", None)
        if start is not None:
            start()


def host_array(value: Any) -> np.ndarray:
    """An adapter tensor as a numpy array in its own dtype when that is float32 or bfloat16 (a jax array on a device
    is copied to the host as it is: no cast there, where it is slow), as float32 otherwise."""
    array = np.asarray(value)
    if array.dtype not in _KEPT_DTYPES:
        array = array.astype(np.float32)
    return array


_KEPT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))


def _config_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise TypeError(f"a LoRA adapter's config must be a dict or a peft LoraConfig, got {type(config).__name__}")
    return dict(config)


def _rank_and_scaling(name: str, config: dict[str, Any]) -> tuple[int, float]:
    """adapter_config's rank and the scaling of its product; ValueError for what this engine does not compute."""
    peft_type = str(config.get("peft_type", "LORA"))
    if peft_type.split(".")[-1].upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    for option, what in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise ValueError(
                f"LoRA adapter {name!r}: {what} is not supported (adapter_config {option}={config[option]!r})"
            )
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config r must be an int >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


@dataclass(slots=True)
class LoraSlots:
    """Which adapter holds which of an engine's slots 1..max_loras (slot 0 is the base model), and how many running
    requests pin each. `acquire` gives a request its adapter's slot: the one it holds, else a free slot, else the
    least recently used one no running request pins (its adapter is evicted); None when every slot is pinned (the
    request waits). A slot that changes hands is listed in `pending` until the engine has written it."""

    max_loras: int
    holder: dict[int, str] = field(default_factory=dict)  # slot -> adapter name
    pins: collections.Counter = field(default_factory=collections.Counter)  # adapter name -> running requests
    recency: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # adapter name -> slot, LRU first
    pending: dict[int, str] = field(default_factory=dict)  # slot -> adapter name, to be written before the next step

    def slot_of(self, name: str) -> int | None:
        return self.recency.get(name)

    def acquire(self, name: str) -> int | None:
        slot = self.recency.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            evicted = self.holder.get(slot)
            if evicted is not None:
                del self.recency[evicted]
            self.holder[slot], self.recency[name], self.pending[slot] = name, slot, name
        self.recency.move_to_end(name)
        self.pins[name] += 1
        return slot

    def release(self, name: str) -> None:
        if self.pins[name] < 1:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        self.pins[name] -= 1

    def forget(self, name: str) -> int | None:
        """Drops an adapter that no running request pins (unload or replace); returns the slot it held."""
        if self.pins[name]:
            raise RuntimeError(f"adapter {name!r} is in use by {self.pins[name]} running requests")
        slot = self.recency.pop(name, None)
        if slot is not None:
            del self.holder[slot]
            self.pending.pop(slot, None)
        return slot

    def _free_slot(self) -> int | None:
        for slot in range(1, self.max_loras + 1):
            if slot not in self.holder:
                return slot
        for name, slot in self.recency.items():  # least recently used first
            if not self.pins[name]:
                return slot
        return None

"""Checkpoint loading: Hugging Face safetensors directories, GGUF files, orbax checkpoints and in-memory
parameter trees, all into a family's weights dataclass (see `jaxserve/models/llama.py` for the protocol).

Every source goes through one assembly step, `load_from_tensors`: each tensor name is matched
against the family's `checkpoint_rules(cfg)`, transposed / reshaped as its rule says, checked
against `param_specs(cfg)` and written into its field, per-layer tensors into their slot of the
stacked [L, ...] array. It fails loudly, naming the tensor or field: a tensor no rule matches, the
same tensor twice, a missing tensor or layer, a wrong shape. Tensors are read and converted one at
a time, so the host holds one copy of the model in the target dtype plus one tensor.

Orbax layout, written by `save_orbax` and recognised by `jaxserve/models/hub.py`:
    <dir>/config.json   the Hugging Face config (the registry picks family and config from it)
    <dir>/params/       an orbax StandardCheckpointer checkpoint of the weights dataclass pytree
    <dir>/tokenizer*    tokenizer files, when saved with one (tokenizer.json, tokenizer_config.json, ...)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve.models import fp8_checkpoint
from jaxserve.models.common import CheckpointRule, ParamSpec
from jaxserve.models.files import ModelFileError, check_safetensors, read_fp8_safetensor, read_json_object
from jaxserve.models.tunix_params import is_tunix_tree, to_jaxserve_params

if TYPE_CHECKING:
    from jaxserve.models.registry import ModelConfig, ModelFamily

DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
ORBAX_PARAMS_DIR = "params"
# Tensors some checkpoints carry that no model needs: rope tables are recomputed from the config.
log = logging.getLogger(__name__)
_HARMLESS_TENSORS = re.compile(r"(.*\.)?rotary_emb\.inv_freq")
# How errors name a stacked slot's index along each logical axis ("layer 3, expert 5").
_AXIS_NOUNS = {"layers": "layer", "experts": "expert"}
# A directory holds a tokenizer when it has one of these (generation_config.json alone is not one).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Files that make a directory's tokenizer (copied next to an orbax checkpoint).
_TOKENIZER_FILES = re.compile(
    r"tokenizer.*|special_tokens_map\.json|vocab\.json|merges\.txt|generation_config\.json|chat_template\.jinja|.*\.model"
)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run: family module, its config, weights on device, and where its tokenizer lives.

    `tokenizer_source` is what `jaxserve.tokenizer.Tokenizer.from_source` takes: a directory with
    tokenizer files or a .gguf file; None when the checkpoint carries no tokenizer.
    """

    family: ModelFamily
    config: ModelConfig
    weights: Any
    hf_config: dict
    tokenizer_source: str | None
    source: str


def numpy_dtype(dtype: str) -> Any:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def load_model(source: str | os.PathLike, *, dtype: str = "bfloat16", on_device: bool = True) -> LoadedModel:
    """Loads a local Hugging Face directory, a .gguf file, an orbax directory, the default model or a hub id.

    on_device=False leaves a checkpoint's weights in host memory (numpy arrays; an orbax checkpoint is
    restored to the device either way), for a consumer that lays them out on the device itself: `LLM`
    builds its serving layout from them one layer at a time, so the device never holds the checkpoint
    layout beside it."""
    from jaxserve.models import gguf
    from jaxserve.models.convert import cached_conversion
    from jaxserve.models.hub import DEFAULT_MODEL, ResolvedSource, resolve_model_source

    np_dtype = numpy_dtype(dtype)
    resolved = resolve_model_source(source)
    path = resolved.path
    if resolved.kind == "gguf" and os.fspath(source) == DEFAULT_MODEL:
        # Converted once into a Hugging Face directory in the cache (jaxserve/models/convert.py), loaded from there.
        path = cached_conversion(path)
        resolved = ResolvedSource("hf_dir", path)
    if resolved.kind == "gguf":
        checkpoint = gguf.open_gguf(path)
        family, cfg = _resolve_family(checkpoint.hf_config, path, "the config from its metadata: ")
        weights = _assemble(family, cfg, checkpoint.tensors(), np_dtype, on_device)
        return LoadedModel(family, cfg, weights, checkpoint.hf_config, str(path), str(source))
    hf_config = read_hf_config(path)
    family, cfg = _resolve_family(hf_config, path / "config.json")
    if resolved.kind == "orbax":
        weights = load_orbax(path / ORBAX_PARAMS_DIR, family, cfg, dtype)
    else:
        tensors = SafetensorsCheckpoint(path).tensors()
        try:
            fp8 = fp8_checkpoint.checkpoint_format(hf_config)
        except ValueError as e:
            raise ModelFileError(path / "config.json", str(e)) from e
        if fp8 is not None:  # FP8 weights and their scales, as float32 weights (`LLM` serves them in FP8)
            tensors = fp8_checkpoint.dequantized_tensors(tensors, fp8)
            qk_norm = bool(getattr(getattr(cfg, "base", cfg), "qk_norm", False))  # an MoE config's base
            norm_offset = getattr(family, "RMS_NORM_OFFSET", 0.0)
            calibrated = fp8_checkpoint.has_kv_cache_scales(hf_config)
            tensors = fp8_checkpoint.folded_kv_scales(
                tensors, calibrated=calibrated, qk_norm=qk_norm, norm_offset=norm_offset
            )
        weights = _assemble(family, cfg, tensors, np_dtype, on_device)
    tokenizer_source = str(path) if any((path / name).is_file() for name in _TOKENIZER_MARKERS) else None
    return LoadedModel(family, cfg, weights, hf_config, tokenizer_source, str(source))


def read_hf_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json")
    return read_json_object(config_path)


def _resolve_family(hf_config: dict, path: Path, context: str = "") -> tuple[ModelFamily, ModelConfig]:
    """`registry.resolve`, its errors (the family's, which know no paths) naming the file the config came from."""
    from jaxserve.models import registry

    try:
        return registry.resolve(hf_config)
    except ValueError as e:
        raise ModelFileError(path, f"{context}{e}") from e


# --- safetensors -------------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate tensor {key!r} in model.safetensors.index.json")
        seen[key] = value
    return seen


def _read_weight_map(index_path: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from model.safetensors.index.json."""
    weight_map = read_json_object(index_path, object_pairs_hook=_no_duplicate_keys).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelFileError(index_path, "expected a 'weight_map' object of tensor name -> shard file name")
    return weight_map


def _safetensors_names(file: Path) -> list[str]:
    """The tensor names of a safetensors file, after checking its header against its size."""
    from safetensors import SafetensorError, safe_open

    check_safetensors(file)
    try:
        with safe_open(file, framework="numpy") as f:
            return list(f.keys())
    except SafetensorError as e:  # what check_safetensors does not look at
        raise ModelFileError(file, f"not a readable safetensors file ({e})") from e


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face directory (model.safetensors, or shards listed by the index), read lazily."""

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        index_path = directory / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = _read_weight_map(index_path)
            files = sorted({directory / name for name in weight_map.values()})
        elif (directory / "model.safetensors").is_file():
            weight_map, files = None, [directory / "model.safetensors"]
        else:
            found = sorted(p.name for p in directory.iterdir())
            raise FileNotFoundError(
                f"{directory} has no model.safetensors or model.safetensors.index.json (found: {', '.join(found)})"
            )
        self.location: dict[str, Path] = {}
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"safetensors shard {file} listed in {index_path.name} does not exist")
            for name in _safetensors_names(file):
                if name in self.location:
                    raise ValueError(f"duplicate tensor {name!r}: in both {self.location[name].name} and {file.name}")
                self.location[name] = file
        for name, file in (weight_map or {}).items():
            if self.location.get(name) != directory / file:
                raise ValueError(f"{index_path.name} lists tensor {name!r} in {file}, which does not hold it")

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) one at a time, each file opened once."""
        from safetensors import safe_open

        for file in sorted(set(self.location.values())):
            header = None  # read once, for a file with float8 tensors (an FP8 checkpoint's weights)
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118
                    if f.get_slice(name).get_dtype().startswith("F8_"):
                        header = check_safetensors(file) if header is None else header
                        yield name, read_fp8_safetensor(file, name, *header)
                    else:
                        yield name, f.get_tensor(name)


# --- assembly of named tensors into the weights dataclass --------------------------------------


def spec_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted field path -> leaf of a weights-shaped dataclass tree (ParamSpec, array or None)."""
    leaves: dict[str, Any] = {}
    for field in dataclasses.fields(tree):
        value = getattr(tree, field.name)
        path = prefix + field.name
        if dataclasses.is_dataclass(value) and not isinstance(value, ParamSpec):
            leaves.update(spec_leaves(value, path + "."))
        else:
            leaves[path] = value
    return leaves


def build_tree(spec_tree: Any, leaves: Mapping[str, Any], prefix: str = "") -> Any:
    """The weights dataclass with `leaves[path]` at every field (None where absent)."""
    values = {}
    for field in dataclasses.fields(spec_tree):
        value = getattr(spec_tree, field.name)
        path = prefix + field.name
        if dataclasses.is_dataclass(value) and not isinstance(value, ParamSpec):
            values[field.name] = build_tree(value, leaves, path + ".")
        else:
            values[field.name] = leaves.get(path)
    return type(spec_tree)(**values)


def _groups_into(got: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `got` is `target` with runs of consecutive dims merged, e.g. (576,) into (9, 64)."""
    i = 0
    for size in got:
        product = 1
        while i < len(target) and product < size:
            product *= target[i]
            i += 1
        if product != size:
            return False
    return all(d == 1 for d in target[i:])


def _expected_linear(got: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, int]:
    """The [out, in] torch Linear shape that transposes into `target`, preferring one that agrees with `got`."""
    candidates = [(int(np.prod(target[k:])), int(np.prod(target[:k]))) for k in range(1, len(target))]
    for c in candidates:
        if len(got) == 2 and (c[1] == got[1] or c[0] == got[0]):
            return c
    return candidates[0] if candidates else (1, int(np.prod(target)))


def _to_field_layout(name: str, array: np.ndarray, rule: CheckpointRule, target: tuple[int, ...]) -> np.ndarray:
    got = tuple(array.shape)
    if rule.transform == "linear":
        if len(got) != 2 or not _groups_into(got[::-1], target):
            raise ValueError(
                f"tensor {name}: shape {got}, expected {_expected_linear(got, target)} "
                f"([out, in] Linear weight for field {rule.field} of per-layer shape {target})"
            )
        return array.T.reshape(target)
    if not _groups_into(got, target):
        raise ValueError(f"tensor {name}: shape {got}, expected {target} (field {rule.field})")
    return array.reshape(target)


def _example_name(pattern: str, index: tuple[int, ...]) -> str:
    """A readable tensor name from a rule's regex, e.g. model.layers.3.self_attn.q_proj.weight."""
    parts = iter(str(i) for i in index)
    name = re.sub(r"\((?:\\d\+|\[0-9\]\+)\)", lambda _: next(parts, "N"), pattern)
    return name.replace("\\", "")


@dataclass(slots=True)
class _Field:
    """One weight being filled: its spec, its rule, the host buffer and which stacked slots hold a tensor."""

    spec: ParamSpec
    rule: CheckpointRule
    depth: int  # leading stacked axes (layers, experts) indexed by the rule's regex groups
    data: np.ndarray
    source: dict[tuple[int, ...], str]  # slot -> tensor name that filled it

    @property
    def slot_shape(self) -> tuple[int, ...]:
        return self.spec.shape[self.depth :]

    def model_index(self, slot: tuple[int, ...]) -> tuple[int, ...]:
        """The regex groups' values (model layer, expert, ...) of a stacked slot."""
        layers = self.rule.layers
        return slot if layers is None or not slot else (layers[slot[0]], *slot[1:])

    def where(self, slot: tuple[int, ...]) -> str:
        """A slot in words, e.g. "layer 3, expert 5", by the logical axes of the stacked dims."""
        nouns = [_AXIS_NOUNS.get(axis, str(axis)) for axis in self.spec.logical_axes[: self.depth]]
        return ", ".join(f"{noun} {i}" for noun, i in zip(nouns, self.model_index(slot), strict=True))

    def slot(self, name: str, index: tuple[int, ...]) -> tuple[int, ...]:
        """The stacked slot that tensor `name` (its regex groups: `index`) fills; a ValueError for a layer the field
        does not hold or an index beyond the config's."""
        layers = self.rule.layers
        if layers is not None:
            if index[0] not in layers:
                raise ValueError(
                    f"unexpected tensor {name}: layer {index[0]} has no {self.rule.field} in this config (the layers "
                    f"that have: {list(layers)})"
                )
            index = (layers.index(index[0]), *index[1:])
        nouns = [_AXIS_NOUNS.get(axis, str(axis)) for axis in self.spec.logical_axes[: self.depth]]
        for noun, i, n in zip(nouns, index, self.spec.shape[: self.depth], strict=True):
            if i >= n:
                raise ValueError(f"tensor {name}: {noun} {i} out of range, the config has {n} ({self.rule.field})")
        return index


def _match(name: str, rules: list[tuple[re.Pattern, CheckpointRule]]) -> tuple[CheckpointRule, tuple[int, ...]] | None:
    matches = [(rule, m) for pattern, rule in rules if (m := pattern.fullmatch(name))]
    if len(matches) > 1:
        raise ValueError(f"tensor {name} matches several checkpoint rules: {[r.pattern for r, _ in matches]}")
    if not matches:
        return None
    rule, m = matches[0]
    return rule, tuple(int(g) for g in m.groups())


def _prepare_fields(family: ModelFamily, cfg: Any, np_dtype: Any) -> tuple[dict[str, _Field], list]:
    specs = spec_leaves(family.param_specs(cfg))
    rules = [(re.compile(r.pattern), r) for r in family.checkpoint_rules(cfg)]
    fields: dict[str, _Field] = {}
    for pattern, rule in rules:
        if rule.transform == "skip":
            continue
        if rule.field not in specs:
            raise ValueError(f"checkpoint rule {rule.pattern!r} names field {rule.field!r}, which the weights lack")
        spec = specs[rule.field]
        if spec is None:
            continue  # this config has no such field; a tensor for it is reported as unexpected
        if rule.field in fields:
            raise ValueError(f"field {rule.field} has two checkpoint rules")
        fields[rule.field] = _Field(spec, rule, pattern.groups, np.empty(spec.shape, np_dtype), {})
    uncovered = [path for path, spec in specs.items() if spec is not None and path not in fields]
    if uncovered:
        raise ValueError(f"fields {uncovered} have no checkpoint rule in {family.__name__}.checkpoint_rules")
    return fields, rules


def _place(name: str, array: np.ndarray, fields: dict[str, _Field], rules: list) -> bool:
    """Puts one tensor into its field; False when a "skip" rule says the model does not read it."""
    matched = _match(name, rules)
    if matched is None:
        if _HARMLESS_TENSORS.fullmatch(name):
            return True
        raise ValueError(f"unknown tensor {name}: no checkpoint rule matches it")
    rule, index = matched
    if rule.transform == "skip":
        return False
    field = fields.get(rule.field)
    if field is None:
        raise ValueError(f"unexpected tensor {name}: field {rule.field} is absent in this model's config")
    slot = field.slot(name, index)
    if slot in field.source:
        raise ValueError(
            f"duplicate tensor for field {rule.field} at {field.where(slot)}: {field.source[slot]} and {name}"
        )
    field.data[slot] = _to_field_layout(name, np.asarray(array), rule, field.slot_shape)
    field.source[slot] = name
    return True


def _check_complete(fields: dict[str, _Field]) -> None:
    stacked = [f for f in fields.values() if f.depth]
    if stacked:
        # Every model layer: those of the fields stacked over all of them, and of those over some of them.
        layers = set().union(*(f.rule.layers or range(f.spec.shape[0]) for f in stacked))
        seen = {f.model_index(slot)[0] for f in stacked for slot in f.source}
        missing_layers = sorted(layers - seen)
        if missing_layers:
            raise ValueError(
                f"missing layer {missing_layers[0]}: no tensors for layers {missing_layers} of {len(layers)}"
            )
    for path, field in fields.items():
        for slot in np.ndindex(*field.spec.shape[: field.depth]):
            if slot not in field.source:
                name = _example_name(field.rule.pattern, field.model_index(slot))
                where = f", {field.where(slot)}" if slot else ""
                raise ValueError(f"missing tensor {name} (field {path}{where})")


def _assemble(
    family: ModelFamily, cfg: Any, tensors: Iterable[tuple[str, np.ndarray]], np_dtype: Any, on_device: bool = True
) -> Any:
    fields, rules = _prepare_fields(family, cfg, np_dtype)
    seen: set[str] = set()
    skipped = 0
    for name, array in tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor {name}")
        seen.add(name)
        skipped += not _place(name, array, fields, rules)
    if skipped:
        log.info(
            "skipped %d tensors the %s model does not read (a multimodal checkpoint's vision tower)",
            skipped,
            family.__name__.rsplit(".", 1)[-1],
        )
    _check_complete(fields)
    leaves = {}
    for path in list(fields):
        data = fields.pop(path).data
        leaves[path] = jnp.asarray(data) if on_device else data  # drop each host buffer once it is on device
    return build_tree(family.param_specs(cfg), leaves)


def load_from_tensors(family: ModelFamily, cfg: Any, tensors: Mapping[str, np.ndarray], dtype: str = "bfloat16") -> Any:
    """Weights from Hugging Face-named tensors (values may be numpy or jax arrays), validated against the specs."""
    np_dtype = numpy_dtype(dtype)
    return _assemble(family, cfg, ((name, tensors[name]) for name in tensors), np_dtype)


# --- in-memory parameter trees -----------------------------------------------------------------


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, path + "."))
        else:
            flat[path] = value
    return flat


def _flax_to_torch_names(flat: dict[str, Any]) -> dict[str, Any]:
    """Flax modules name a Linear's [in, out] matrix `kernel` and an embedding `embedding`; torch uses `weight`."""
    renamed = {}
    for name, value in flat.items():
        if name.endswith(".kernel"):
            renamed[name.removesuffix(".kernel") + ".weight"] = np.asarray(value).T
        elif name.endswith(".embedding"):
            renamed[name.removesuffix(".embedding") + ".weight"] = value
        else:
            renamed[name] = value
    return renamed


def _cast_fields(spec_tree: Any, leaves: Mapping[str, Any], dtype: str, cast: bool = True) -> Any:
    """Our field names -> validated, cast jax arrays in the weights dataclass; without `cast`, floating-point
    arrays as they are (numpy or jax, on whatever devices)."""
    specs = spec_leaves(spec_tree)
    extra = sorted(set(leaves) - set(specs))
    if extra:
        raise ValueError(f"unknown parameters {extra}; the weights have fields {sorted(specs)}")
    out = {}
    for path, spec in specs.items():
        value = leaves.get(path)
        if spec is None:
            if value is not None:
                raise ValueError(f"parameter {path} given, but this config has no such field")
            continue
        if value is None:
            raise ValueError(f"missing parameter {path} (expected shape {spec.shape})")
        if tuple(value.shape) != spec.shape:
            raise ValueError(f"parameter {path}: shape {tuple(value.shape)}, expected {spec.shape}")
        if cast:
            out[path] = jnp.asarray(value, dtype=jnp.dtype(dtype))
        elif not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"parameter {path}: dtype {value.dtype}, expected a floating-point array")
        else:
            out[path] = value
    return build_tree(spec_tree, out)


def load_from_pytree(family: ModelFamily, cfg: Any, params: Any, dtype: str = "bfloat16", *, cast: bool = True) -> Any:
    """Weights from parameters already in memory, validated against `param_specs(cfg)` and cast to `dtype`.

    `params` is the family's weights dataclass, or a nested dict (a Flax param tree, with or without
    its top-level "params" key) keyed by our field names ("embed", "layers" -> "wq", ...), by
    Hugging Face names ("model" -> "layers" -> "0" -> "self_attn" -> "q_proj" -> "weight" / "kernel")
    or by google-tunix's ("embedder" -> "input_embedding", "layers" -> "0" -> "attn" -> "q_einsum" -> "w",
    ...: `jaxserve.models.tunix_params`).
    Arrays that already match stay on their device; only the cast copies them. `cast=False` leaves
    field-named floating-point arrays in their own dtype, for a caller that casts them layer by layer
    (`to_serving`), so no cast copy of the whole tree is made (Hugging Face-named trees are assembled
    on the host and cast there either way).
    """
    numpy_dtype(dtype)
    spec_tree = family.param_specs(cfg)
    if isinstance(params, type(spec_tree)):
        return _cast_fields(spec_tree, spec_leaves(params), dtype, cast)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a {type(spec_tree).__name__} or a nested dict, got {type(params).__name__}")
    if set(params) == {"params"}:
        params = params["params"]
    flat = _flatten(params)
    if set(flat) & set(spec_leaves(spec_tree)):
        return _cast_fields(spec_tree, flat, dtype, cast)
    if is_tunix_tree(flat):
        return _cast_fields(spec_tree, _flatten(to_jaxserve_params(flat)), dtype, cast)
    return load_from_tensors(family, cfg, _flax_to_torch_names(flat), dtype)


# --- orbax ---------------------------------------------------------------------------------------


def save_orbax(
    path: str | os.PathLike,
    weights: Any,
    *,
    hf_config: Mapping | None = None,
    tokenizer_source: str | os.PathLike | None = None,
) -> Path:
    """Writes `weights` as an orbax checkpoint under <path>/params; with `hf_config` (and a tokenizer) the
    directory is a complete model that `load_model(path)` loads. Refuses to overwrite an existing checkpoint."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if (path / ORBAX_PARAMS_DIR).exists():
        raise FileExistsError(f"{path / ORBAX_PARAMS_DIR} already exists")
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / ORBAX_PARAMS_DIR, weights)
    checkpointer.wait_until_finished()
    if hf_config is not None:
        with open(path / "config.json", "w") as f:
            json.dump(dict(hf_config), f, indent=2)
    if tokenizer_source is not None:
        _save_tokenizer(Path(tokenizer_source), path)
    return path


def _save_tokenizer(source: Path, target: Path) -> None:
    if source.is_dir():
        for file in source.iterdir():
            if _TOKENIZER_FILES.fullmatch(file.name) and file.is_file():
                shutil.copy2(file, target / file.name)
        return
    from jaxserve.models.gguf import gguf_tokenizer

    tokenizer, eos_ids = gguf_tokenizer(source)
    tokenizer.save_pretrained(target)
    with open(target / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": list(eos_ids)}, f)


def load_orbax(path: str | os.PathLike, family: ModelFamily, cfg: Any, dtype: str = "bfloat16") -> Any:
    """Restores an orbax checkpoint of the weights dataclass, checked against `param_specs(cfg)`, in `dtype`."""
    import orbax.checkpoint as ocp

    numpy_dtype(dtype)
    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"orbax checkpoint not found: {path}")
    spec_tree = family.param_specs(cfg)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype), sharding=sharding),
        spec_tree,
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path).item_metadata
        if stored is not None:
            _check_orbax_shapes(path, stored.tree, target)
        try:
            return checkpointer.restore(path, target)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"orbax checkpoint {path} does not match the config's parameter specs: {e}") from e


def _check_orbax_shapes(path: Path, stored: Any, target: Any) -> None:
    """Refuses a checkpoint whose arrays differ from `target` in name or shape before anything is read: a
    restore that fails part-way leaves orbax's other reads pending on an event loop it has closed."""

    def shapes(tree: Any) -> dict[str, tuple[int, ...]]:
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return {jax.tree_util.keystr(p, simple=True, separator="."): tuple(x.shape) for p, x in leaves}

    got, want = shapes(stored), shapes(target)
    problems = [f"{k}: stored {got[k]}, expected {want[k]}" for k in want if k in got and got[k] != want[k]]
    problems += [f"{k}: missing" for k in want if k not in got]
    problems += [f"{k}: not a parameter of this config" for k in got if k not in want]
    if problems:
        raise ValueError(f"orbax checkpoint {path} does not match the config's parameter specs: {'; '.join(problems)}")

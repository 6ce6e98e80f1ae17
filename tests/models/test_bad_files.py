"""Bad model files, config values and sources: each is a clear error naming what is wrong, raised where
the file is read; truncation at any byte of a GGUF or safetensors file included. Bad files are built from
small valid ones (random tensors of a tiny Llama), which still load exactly as before."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import gguf
import huggingface_hub
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.models import llama, registry
from jaxserve.models.files import ModelFileError
from jaxserve.models.gguf import gguf_reader, gguf_tokenizer
from jaxserve.models.loader import SafetensorsCheckpoint, load_from_tensors, load_model

# Smaller than conftest's tiny config, so a sweep over every cut point stays quick (files of ~100 KB).
_SMALL = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def random_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 tensors of a Llama config."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(hf["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {layer + "input_layernorm.weight": (d,), layer + "post_attention_layernorm.weight": (d,)}
        shapes |= {layer + f"self_attn.{p}_proj.weight": (n, d) for p, n in (("q", q), ("k", kv), ("v", kv))}
        shapes |= {layer + "self_attn.o_proj.weight": (d, q), layer + "mlp.down_proj.weight": (d, f)}
        shapes |= {layer + f"mlp.{p}_proj.weight": (f, d) for p in ("gate", "up")}
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


def write_hf_dir(directory: Path, hf_config: dict | str | bytes, tensors: dict | None = None) -> Path:
    """config.json (a dict, or raw text) and, with tensors, model.safetensors."""
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(hf_config) if isinstance(hf_config, dict) else hf_config
    (directory / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    if tensors is not None:
        save_file(tensors, directory / "model.safetensors")
    return directory


@pytest.fixture(scope="module")
def valid(tmp_path_factory, tiny_hf_config, write_gguf) -> SimpleNamespace:
    """A valid GGUF file and Hugging Face directory of the same tensors, and the weights both must give."""
    config = tiny_hf_config("llama", **_SMALL)
    tensors = random_tensors(config)
    root = tmp_path_factory.mktemp("valid")
    expected = load_from_tensors(llama, llama.LlamaConfig.from_hf(config), tensors, "float32")
    return SimpleNamespace(
        config=config,
        tensors=tensors,
        gguf=write_gguf(root / "tiny.gguf", "llama", config, tensors),
        hf=write_hf_dir(root / "hf", config, tensors),
        expected=expected,
    )


def error_of(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as e:  # the test asserts which one
        return e
    return None


def test_valid_files_load_exactly_as_before(valid):
    for source in (valid.gguf, valid.hf):
        loaded = load_model(source, dtype="float32")
        expected = llama.LlamaConfig.from_hf(valid.config)
        assert loaded.config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)  # GGUF stores it as float32
        assert dataclasses.replace(loaded.config, rms_norm_eps=expected.rms_norm_eps) == expected
        for got, want in zip(jax.tree.leaves(loaded.weights), jax.tree.leaves(valid.expected), strict=True):
            np.testing.assert_array_equal(got, want)


# --- GGUF ------------------------------------------------------------------------------------------


def gguf_layout(path: Path) -> SimpleNamespace:
    """Offsets in a valid GGUF file: its tensor table, last table entry (after the name), tensor data, and
    the end of the last tensor's bytes (and that tensor's name)."""
    reader = gguf.GGUFReader(path)
    first, last = reader.tensors[0], reader.tensors[-1]  # the table's first and last entries
    end, last_data = max((t.data_offset + int(t.n_bytes), t.name) for t in reader.tensors)
    return SimpleNamespace(
        table=first.field.offset,
        last_entry=last.field.offset + 8 + len(last.name.encode()),
        last_entry_name=last.name,
        last_entry_dims=len(last.shape),
        data=reader.data_offset,
        end=end,
        last_data=last_data,
    )


@pytest.mark.parametrize("region", ["header", "tensor data"])
def test_gguf_truncated_at_any_byte(tmp_path, valid, region):
    data, layout = valid.gguf.read_bytes(), gguf_layout(valid.gguf)
    if region == "header":  # every byte of magic, metadata, tensor table and padding
        cuts = range(layout.data)
    else:
        cuts = [*range(layout.data, layout.end, (layout.end - layout.data) // 64), layout.end - 1]
    path = tmp_path / "cut.gguf"
    for cut in cuts:
        path.write_bytes(data[:cut])
        error = error_of(gguf_reader, path)
        problem = "empty file (0 bytes), not a GGUF file" if cut == 0 else "truncated GGUF file: "
        assert isinstance(error, ModelFileError) and str(error).startswith(f"{path}: {problem}"), (cut, error)


def test_truncated_gguf_says_where_it_ends(tmp_path, valid):
    data, layout = valid.gguf.read_bytes(), gguf_layout(valid.gguf)
    cuts = {
        2: "it ends (at 2 bytes) inside the magic",
        6: "inside the version",
        28: "inside the length of the key of metadata entry 0",
        40: "inside the key of metadata entry 0",
        layout.table + 12: "inside the name of tensor 0 of",
        layout.last_entry + 2: f"inside the tensor-table entry of {layout.last_entry_name!r}",
        (layout.data + layout.end) // 2: "needs bytes up to",
        layout.end - 1: f"{layout.last_data!r} needs bytes up to {layout.end}, but the file has {layout.end - 1}",
    }
    for cut, where in cuts.items():
        path = tmp_path / f"cut_{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match="truncated GGUF file") as raised:
            load_model(path)
        assert str(raised.value).startswith(f"{path}: ") and where in str(raised.value), (cut, raised.value)
    with pytest.raises(ModelFileError, match="truncated GGUF file"):
        gguf_tokenizer(path)  # the tokenizer reads the file through the same check


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"", "empty file (0 bytes), not a GGUF file"),
        (b"hello, this is a text file", "not a GGUF file: it starts with b'hell', not b'GGUF'"),
        (b"PK\x03\x04 a zip archive", r"not a GGUF file: it starts with b'PK\x03\x04', not b'GGUF'"),
        ("version 99", "unsupported GGUF version 99; versions (2, 3) are read"),
    ],
)
def test_file_named_gguf_that_is_not_one(tmp_path, valid, content, problem):
    if content == "version 99":
        content = bytearray(valid.gguf.read_bytes())
        content[4:8] = struct.pack("<I", 99)
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError) as raised:
        load_model(path)
    assert str(raised.value) == f"{path}: {problem}"


def test_corrupt_gguf_names_what_is_wrong(tmp_path, valid):
    data, layout = valid.gguf.read_bytes(), gguf_layout(valid.gguf)
    first_value_type = 24 + 8 + len("general.architecture")  # magic, version, counts; the first key
    last_type = layout.last_entry + 4 + 8 * layout.last_entry_dims
    patches = {
        first_value_type: "the value of metadata key 'general.architecture' has unknown value type 99",
        layout.last_entry: f"tensor {layout.last_entry_name!r} has 99 dims (ggml has at most 4)",
        last_type: f"tensor {layout.last_entry_name!r} has unknown ggml type 99",
    }
    for offset, problem in patches.items():
        corrupt = bytearray(data)
        corrupt[offset : offset + 4] = struct.pack("<I", 99)
        path = tmp_path / f"corrupt_{offset}.gguf"
        path.write_bytes(corrupt)
        with pytest.raises(ModelFileError) as raised:
            load_model(path)
        assert str(raised.value) == f"{path}: corrupt GGUF file: {problem}"


def test_a_vocabulary_string_that_is_not_utf8_is_named(tmp_path, valid):
    """The header read decodes every string of an array (the vocabulary) and names the key of a bad one."""
    data = bytearray(valid.gguf.read_bytes())
    first_token = data.index("\u0100".encode(), data.index(b"tokenizer.ggml.tokens"))  # the writer's first token
    data[first_token] = 0xFF
    path = tmp_path / "bad_token.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFileError) as raised:
        load_model(path)
    key = "the value of metadata key 'tokenizer.ggml.tokens'"
    assert str(raised.value) == f"{path}: corrupt GGUF file: {key} is not UTF-8 (invalid start byte)"


@pytest.mark.parametrize(
    "overrides,problem",
    [
        ({"num_attention_heads": 0}, "GGUF metadata qwen2.attention.head_count must be >= 1, got 0"),
        ({"rms_norm_eps": 0.0}, "the config from its metadata: rms_norm_eps must be a number > 0, got 0.0"),
    ],
)
def test_bad_gguf_metadata_names_file_and_key(tmp_path, valid, write_gguf, overrides, problem):
    # qwen2: its q/k rows are not permuted, so the writer takes any head count
    path = write_gguf(tmp_path / "bad.gguf", "qwen2", valid.config | overrides, valid.tensors)
    with pytest.raises(ModelFileError) as raised:
        load_model(path)
    assert str(raised.value) == f"{path}: {problem}"


# --- safetensors -----------------------------------------------------------------------------------


def safetensors_bytes(header: object, data: bytes = b"") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    return struct.pack("<Q", len(text)) + text.encode() + data


def test_safetensors_truncated_at_any_byte(tmp_path, valid):
    data = (valid.hf / "model.safetensors").read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    cuts = [*range(header_end + 1), *range(header_end + 1, len(data), (len(data) - header_end) // 64), len(data) - 1]
    directory = write_hf_dir(tmp_path / "cut", valid.config)
    path = directory / "model.safetensors"
    for cut in cuts:
        path.write_bytes(data[:cut])
        error = error_of(SafetensorsCheckpoint, directory)
        problem = "empty file (0 bytes), not a safetensors file" if cut == 0 else "truncated safetensors file: "
        assert isinstance(error, ModelFileError) and str(error).startswith(f"{path}: {problem}"), (cut, error)


_F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    "content,problem",
    [
        (b"", "empty file (0 bytes), not a safetensors file"),
        (b"\x10\x00\x00", "truncated safetensors file: 3 bytes, less than its 8-byte header length"),
        (b"hello, this is a text file", "not a safetensors file: its first 8 bytes b'hello, t' give a header length"),
        (safetensors_bytes('{"w": ', bytes(8)), "not a safetensors file: its header is not valid JSON"),
        (safetensors_bytes([1, 2]), "not a safetensors file: its header is an array, not an object"),
        (
            safetensors_bytes({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8)),
            "malformed safetensors header entry for tensor 'w'",
        ),
        (
            safetensors_bytes({"w": _F32_2 | {"data_offsets": [0, 4]}}, bytes(4)),
            "tensor 'w' (F32, shape [2]) needs 8 bytes, its data_offsets span 4",
        ),
        (safetensors_bytes({"w": _F32_2}, bytes(4)), "truncated safetensors file: tensor 'w' needs data bytes 0..8"),
        (safetensors_bytes({"w": _F32_2}, bytes(12)), "4 bytes after the last tensor's data: not a safetensors file"),
    ],
)
def test_file_that_is_not_safetensors(tmp_path, valid, content, problem):
    directory = write_hf_dir(tmp_path / "bad", valid.config)
    (directory / "model.safetensors").write_bytes(content)
    with pytest.raises(ModelFileError) as raised:
        load_model(directory)
    assert str(raised.value).startswith(f"{directory / 'model.safetensors'}: {problem}"), raised.value


def test_sharded_checkpoint_names_the_bad_shard_and_index(tmp_path, valid):
    names = sorted(valid.tensors)
    directory = write_hf_dir(tmp_path / "sharded", valid.config)
    weight_map = {}
    for i, part in enumerate((names[:6], names[6:])):
        save_file({k: valid.tensors[k] for k in part}, directory / f"shard-{i}.safetensors")
        weight_map |= dict.fromkeys(part, f"shard-{i}.safetensors")
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    shard = directory / "shard-1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ModelFileError, match=rf"^{re.escape(str(shard))}: truncated safetensors file: tensor '"):
        load_model(directory)
    for text, problem in [
        ('{"weight_map": {', "not valid JSON: Expecting property name"),
        ('{"metadata": {}}', "expected a 'weight_map' object of tensor name -> shard file name"),
        ('{"weight_map": {"model.norm.weight": 3}}', "expected a 'weight_map' object"),
    ]:
        index.write_text(text)
        with pytest.raises(ModelFileError, match=f"^{re.escape(str(index))}: {problem}"):
            load_model(directory)


# --- config.json -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,problem",
    [
        ("", "empty file, expected a JSON object"),
        (
            '{"vocab_size": 160,',
            "not valid JSON: Expecting property name enclosed in double quotes at line 1 column 20",
        ),
        ('{"vocab_size": 160} trailing', "not valid JSON: Extra data at line 1 column 21"),
        ("[1, 2]", "expected a JSON object, got an array"),
        ('"LlamaForCausalLM"', "expected a JSON object, got a string"),
        (b'{"a": "\xff"}', "not UTF-8 text (byte 7), expected a JSON object"),
    ],
)
def test_malformed_config_json(tmp_path, text, problem):
    directory = write_hf_dir(tmp_path / "model", text)
    with pytest.raises(ModelFileError) as raised:
        load_model(directory)
    assert str(raised.value) == f"{directory / 'config.json'}: {problem}"


_NO_ROPE_PARAMETERS = {"rope_parameters": None}  # transformers 5 writes rope_parameters, 4 wrote rope_scaling


@pytest.mark.parametrize(
    "family,overrides,problem",
    [
        ("llama", {"num_hidden_layers": "thirty"}, "num_hidden_layers must be an int >= 1, got 'thirty'"),
        ("llama", {"hidden_size": 64.5}, "hidden_size must be an int >= 1, got 64.5"),
        ("llama", {"num_attention_heads": None}, "num_attention_heads must be an int >= 1, got null"),
        ("llama", {"vocab_size": -5}, "vocab_size must be an int >= 1, got -5"),
        ("llama", {"head_dim": True}, "head_dim must be an int >= 1, got True"),
        ("llama", {"rms_norm_eps": 0}, "rms_norm_eps must be a number > 0, got 0"),
        ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be a bool (true or false), got 'false'"),
        ("llama", {"architectures": "Llama"}, "architectures must be a list of strings, got 'Llama'"),
        ("llama", {"model_type": ["llama"]}, "model_type must be a string, got ['llama']"),
        ("llama", _NO_ROPE_PARAMETERS | {"rope_scaling": "linear"}, "rope_scaling must be a JSON object, got 'linear'"),
        (
            "llama",
            _NO_ROPE_PARAMETERS | {"rope_scaling": {"rope_type": "linear", "factor": "two"}},
            "rope_scaling.factor must be a number > 0, got 'two'",
        ),
        ("llama", {"rope_parameters": {"rope_type": 3}}, "rope_parameters.rope_type must be a string, got 3"),
        ("llama", {"rope_theta": "1e4"}, "rope_theta must be a number > 0, got '1e4'"),
        ("mistral", {"sliding_window": "4096"}, "sliding_window must be an int >= 1, got '4096'"),
        ("qwen2", {"layer_types": "full_attention"}, "layer_types must be a list of strings, got 'full_attention'"),
    ],
)
def test_bad_config_value_names_path_key_and_expectation(tmp_path, tiny_hf_config, family, overrides, problem):
    config = tiny_hf_config(family) | overrides
    with pytest.raises(ValueError) as raised:
        registry.resolve(config)
    assert str(raised.value) == problem  # the family knows no paths ...
    directory = write_hf_dir(tmp_path / "model", config)
    with pytest.raises(ModelFileError) as raised:
        load_model(directory)
    assert str(raised.value) == f"{directory / 'config.json'}: {problem}"  # ... the loader adds it


# --- model sources ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "  "])
def test_empty_model_name_is_refused(tmp_path, monkeypatch, valid, name):
    shutil.copytree(valid.hf, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)  # a model in the current directory must not be picked up
    with pytest.raises(ValueError, match=f"model must be a local directory, .* or a hub id org/name; got {name!r}"):
        load_model(name)


@pytest.mark.parametrize("name", ["no_such_dir", "no_such_model.gguf", "a/b/c"])
def test_missing_path_names_where_it_looked(tmp_path, name):
    with pytest.raises(FileNotFoundError) as raised:
        load_model(tmp_path / name)
    assert f"model '{tmp_path / name}' not found: no local directory or .gguf file at {tmp_path / name}" in str(
        raised.value
    )


def test_hub_id_offline_names_the_local_path_it_tried(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError) as raised:
        load_model("my-models/tiny")
    message = str(raised.value)
    assert "could not download 'my-models/tiny' from the Hugging Face hub (LocalEntryNotFoundError" in message
    assert f"no local directory or file {tmp_path / 'my-models' / 'tiny'}" in message

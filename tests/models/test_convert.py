"""A GGUF converted once into a Hugging Face directory in the cache (jaxserve/models/convert.py): the converted model
loads the same weights, config and tokenizer as the GGUF; a second load converts nothing; a GGUF that
changes is converted again; the default model goes through it."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from safetensors.numpy import load_file

from jaxserve.models import convert, hub
from jaxserve.models.loader import load_model


@pytest.fixture
def tiny_gguf(tmp_path, tiny_hf_config, hf_model, write_gguf):
    """A tiny Q8_0 llama GGUF and a writer of another one at the same path (other weights)."""
    config = tiny_hf_config("llama")

    def write(seed: int) -> Path:
        model = hf_model(config, seed=seed)
        model.save_pretrained(tmp_path / f"hf{seed}")
        tensors = load_file(tmp_path / f"hf{seed}" / "model.safetensors")
        return write_gguf(
            tmp_path / "tiny.gguf", "llama", config, tensors, GGMLQuantizationType.Q8_0, token_scores=True
        )

    return write


def assert_same_weights(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a.weights), jax.tree.leaves(b.weights), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def counting(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    original = convert.convert_gguf

    def recording(gguf_path: Path, directory: Path) -> None:
        calls.append(gguf_path)
        original(gguf_path, directory)

    monkeypatch.setattr(convert, "convert_gguf", recording)
    return calls


def test_a_converted_gguf_loads_what_the_gguf_holds_and_is_converted_once(tmp_path, tiny_gguf, monkeypatch):
    path = tiny_gguf(seed=0)
    calls = counting(monkeypatch)
    directory = convert.cached_conversion(path, tmp_path / "cache")
    assert directory == tmp_path / "cache" / "converted" / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json", "source.json"} <= {
        p.name for p in directory.iterdir()
    }
    direct, converted = load_model(path, dtype="float32"), load_model(directory, dtype="float32")
    assert converted.hf_config == direct.hf_config and converted.config == direct.config
    assert_same_weights(converted, direct)  # dequantised once, stored in float32: exactly the same values
    assert converted.tokenizer_source == str(directory)

    assert convert.cached_conversion(path, tmp_path / "cache") == directory
    os.utime(path, ns=(0, 10**18))  # touched, same bytes: hashed, kept, its stamp updated
    assert convert.cached_conversion(path, tmp_path / "cache") == directory
    assert convert.is_current(directory, path)
    assert len(calls) == 1

    changed = tiny_gguf(seed=1)  # other weights at the same path
    assert not convert.is_current(directory, changed)
    assert convert.cached_conversion(changed, tmp_path / "cache") == directory
    assert len(calls) == 2
    assert_same_weights(load_model(directory, dtype="float32"), load_model(changed, dtype="float32"))
    assert not [p for p in directory.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_an_interrupted_conversion_leaves_nothing_that_looks_complete(tmp_path, tiny_gguf, monkeypatch):
    path = tiny_gguf(seed=0)

    def failing(gguf_path: Path, directory: Path) -> None:
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "convert_gguf", failing)
    with pytest.raises(KeyboardInterrupt):
        convert.cached_conversion(path, tmp_path / "cache")
    assert list((tmp_path / "cache" / "converted").iterdir()) == []


def test_the_default_model_is_loaded_from_its_conversion(tmp_path, tiny_gguf, monkeypatch):
    path = tiny_gguf(seed=0)
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub, "default_model_path", lambda: path)
    calls = counting(monkeypatch)
    loaded = load_model(hub.DEFAULT_MODEL, dtype="float32")
    assert loaded.tokenizer_source == str(tmp_path / "cache" / "converted" / "tiny")
    assert_same_weights(loaded, load_model(path, dtype="float32"))
    load_model(hub.DEFAULT_MODEL, dtype="float32")
    assert len(calls) == 1


@pytest.mark.slow
def test_the_default_models_converted_tokenizer_is_the_ggufs():
    from jaxserve.tokenizer import Tokenizer

    gguf_path = hub.resolve_model_source(hub.DEFAULT_MODEL).path
    converted = Tokenizer.from_source(convert.cached_conversion(gguf_path))
    original = Tokenizer.from_source(gguf_path)
    assert converted.eos_token_ids == original.eos_token_ids and converted.bos_token_id == original.bos_token_id
    assert converted.vocab_size == original.vocab_size
    texts = ["Hello world", " leading space", "ünïcode 漢字 \t tabs\n\nlines", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert converted.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert converted.decode(ids) == original.decode(ids)
        assert converted.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert converted.apply_chat_template(messages) == original.apply_chat_template(messages)
    assert converted.apply_chat_template(messages[1:]) == original.apply_chat_template(messages[1:])

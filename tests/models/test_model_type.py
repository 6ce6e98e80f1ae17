"""Configs without `architectures` resolve by `model_type`, as transformers' auto classes resolve them: a
config built with `transformers.LlamaConfig(...)` (architectures None) and its `to_dict()`, a Qwen3 config
object, a config.json without the key (Hugging Face directory and orbax checkpoint). Each serves
transformers' greedy tokens (float32, tiny random model); an unknown model_type is an error naming the
supported architectures and model types."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from jaxserve.config import CompileConfig
from jaxserve.llm import LLM
from jaxserve.models import gemma, llama, llama_moe, registry
from jaxserve.models.files import ModelFileError
from jaxserve.models.loader import load_model, save_orbax
from jaxserve.sampling import SamplingParams

pytestmark = [pytest.mark.needs_torch, pytest.mark.usefixtures("single_threaded_torch")]

NEW_TOKENS = 8
PROMPTS = [[5, 17, 3, 99, 41], [7, 150, 64, 12, 9, 33, 120, 88, 2, 14, 70]]
ENGINE = dict(
    dtype="float32",
    max_batch_size=2,
    max_num_tokens=32,
    max_seq_len=64,
    compile_config=CompileConfig(decode_batch_sizes=(2,), token_buckets=(32,), penalty_variants=False),
    attention_backend="xla",
    show_progress=False,
)
SUPPORTED = (
    r"supported architectures: Gemma2ForCausalLM, .*LlamaForCausalLM, .*; "
    r"supported model types: gemma, gemma2, gemma3, gemma3_text, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, "
    r"qwen3_moe"
)


class IdTokenizer:
    """Prompts are token ids here; decoding only has to give some text."""

    vocab_size = 160
    eos_token_ids = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % self.vocab_size for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def config_object(tiny_hf_config, model_type: str) -> transformers.PretrainedConfig:
    """A transformers config object built from keyword arguments: its `architectures` is None."""
    hf = tiny_hf_config(model_type)
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    assert config.architectures is None and config.to_dict()["architectures"] is None
    return config


def transformers_tokens(model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy tokens for PROMPTS, left-padded into one batch (positions follow the mask)."""
    width = max(map(len, PROMPTS))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    model.generation_config.eos_token_id = None  # NEW_TOKENS whatever comes out
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0
        )
    return out[:, width:].tolist()


def served_tokens(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
    llm.close()
    return [o.outputs[0].token_ids for o in outputs]


def state_dict_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The model's tensors by their Hugging Face names, as a training framework might hold them."""
    return {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize(
    ("model_type", "form"), [("llama", "object"), ("llama", "to_dict"), ("qwen3", "object"), ("mistral", "to_dict")]
)
def test_from_params_resolves_a_config_without_architectures_by_model_type(tiny_hf_config, hf_model, model_type, form):
    config = config_object(tiny_hf_config, model_type)
    model = hf_model(config.to_dict())
    given = config if form == "object" else config.to_dict()
    llm = LLM.from_params(state_dict_params(model), given, IdTokenizer(), **ENGINE)
    assert llm.model.family is llama and llm.model.config == llama.LlamaConfig.from_hf(config.to_dict())
    assert served_tokens(llm) == transformers_tokens(model)


@pytest.fixture(scope="module")
def llama_without_architectures(tmp_path_factory, tiny_hf_config, hf_model) -> tuple[torch.nn.Module, Path]:
    """A tiny random Llama saved with save_pretrained, its config.json then stripped of `architectures`."""
    model = hf_model(config_object(tiny_hf_config, "llama").to_dict())
    directory = tmp_path_factory.mktemp("no_architectures")
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    assert config.pop("architectures") == ["LlamaForCausalLM"]  # save_pretrained writes it: take it out
    (directory / "config.json").write_text(json.dumps(config))
    return model, directory


def test_hf_directory_without_architectures_serves_transformers_tokens(llama_without_architectures):
    model, directory = llama_without_architectures
    llm = LLM(str(directory), tokenizer=IdTokenizer(), **ENGINE)
    assert "architectures" not in llm.model.hf_config and llm.model.family is llama
    assert served_tokens(llm) == transformers_tokens(model)


def test_orbax_checkpoint_without_architectures_serves_transformers_tokens(llama_without_architectures, tmp_path):
    model, directory = llama_without_architectures
    loaded = load_model(directory, dtype="float32")
    save_orbax(tmp_path / "ckpt", loaded.weights, hf_config=loaded.hf_config)
    assert "architectures" not in json.loads((tmp_path / "ckpt" / "config.json").read_text())
    llm = LLM(str(tmp_path / "ckpt"), tokenizer=IdTokenizer(), **ENGINE)
    assert served_tokens(llm) == transformers_tokens(model)


def test_unknown_model_type_is_an_error_naming_the_supported_ones(tmp_path, tiny_hf_config):
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)
    with pytest.raises(ValueError, match=f"no 'architectures' entry and model_type 'gpt2', .*; {SUPPORTED}"):
        LLM.from_params({}, gpt2, IdTokenizer(), **ENGINE)
    with pytest.raises(ValueError, match=f"no 'architectures' entry and no 'model_type'; {SUPPORTED}"):
        registry.resolve({k: v for k, v in tiny_hf_config("llama").items() if k not in ("architectures", "model_type")})
    with pytest.raises(ValueError, match=f"unsupported architecture GPT2LMHeadModel; {SUPPORTED}"):
        registry.resolve({"architectures": ["GPT2LMHeadModel"], "model_type": "llama"})  # architectures decide
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "vocab_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelFileError, match=f"config.json: config has no 'architectures' .*'gpt_neox'.*; {SUPPORTED}"):
        load_model(tmp_path)


def test_model_types_are_derived_from_the_familys_architectures():
    architectures = {**llama.ARCHITECTURES, **gemma.ARCHITECTURES, **llama_moe.ARCHITECTURES}
    assert registry.supported_model_types() == sorted(set(architectures.values()))
    assert registry.supported_architectures() == sorted(architectures)
    for architecture, model_type in architectures.items():
        hf = transformers.AutoConfig.for_model(model_type).to_dict()
        assert hf["model_type"] == model_type
        by_type = registry.resolve(hf)[1]
        assert by_type == registry.resolve({**hf, "architectures": [architecture]})[1]

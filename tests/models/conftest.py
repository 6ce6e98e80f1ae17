"""Helpers for testing model families against Hugging Face transformers on tiny random configs.

Exposed as fixtures that return functions, so any test file under tests/models can use them:
  - `tiny_hf_config(family, **overrides) -> dict`: a config.json dict as transformers writes it;
  - `hf_model(hf_config) -> torch model`: float32, eager attention, every parameter random
    (norm weights and biases included, so a misplaced norm or bias changes the output);
  - `weights_from_state_dict(family_module, cfg, state_dict) -> weights`: applies the family's
    `checkpoint_rules` strictly (an unknown, duplicate or missing tensor fails the test).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.common import ParamSpec

# hidden 64, 4 query heads sharing 2 kv heads, 2 layers, vocab 160: big enough for GQA, small to compile.
_TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def make_tiny_hf_config(family: str, **overrides: Any) -> dict:
    config = _CONFIG_CLASSES[family](**{**_TINY, **overrides})
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    return config.to_dict()


def make_hf_model(hf_config: dict, seed: int = 0) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**hf_config)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            else:  # [out, in] or [V, D]: unit-scale outputs, so greedy argmaxes are not near-ties
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
    return model


def _set_path(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        tree = tree.setdefault(name, {})
    tree[leaf] = value


def weights_from_hf_state_dict(family: Any, cfg: Any, state_dict: dict[str, torch.Tensor]) -> Any:
    """The family's weights from a Hugging Face state dict, through its checkpoint rules only."""
    rules = family.checkpoint_rules(cfg)
    specs = family.param_specs(cfg)
    if cfg.tie_word_embeddings:
        # torch's state_dict repeats the tied tensor; saved checkpoints leave it out.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    pieces: dict[str, dict[int | None, np.ndarray]] = {}
    for name, tensor in state_dict.items():
        matches = [(rule, m) for rule in rules if (m := re.fullmatch(rule.pattern, name))]
        assert len(matches) == 1, f"tensor {name} matches {len(matches)} checkpoint rules"
        rule, match = matches[0]
        layer = int(match.group(1)) if match.groups() else None
        spec: ParamSpec = _get_path(specs, rule.field)
        array = tensor.detach().numpy()
        if rule.transform == "linear":
            array = array.T
        shape = spec.shape[1:] if layer is not None else spec.shape
        slot = pieces.setdefault(rule.field, {})
        assert layer not in slot, f"tensor {name} fills {rule.field} layer {layer} twice"
        slot[layer] = array.reshape(shape)
    tree: dict = {}
    for path, spec in _spec_paths(specs):
        slot = pieces.pop(path, None)
        assert slot is not None, f"no checkpoint tensor fills {path}"
        if None in slot:
            value = slot[None]
        else:
            assert sorted(slot) == list(range(spec.shape[0])), f"{path} has layers {sorted(slot)}"
            value = np.stack([slot[i] for i in range(spec.shape[0])])
        assert value.shape == spec.shape, f"{path}: {value.shape} != {spec.shape}"
        _set_path(tree, path, jnp.asarray(value))
    assert not pieces, f"rules fill fields absent from param_specs: {sorted(pieces)}"
    return _build(specs, tree)


def _get_path(tree: Any, path: str) -> Any:
    for name in path.split("."):
        tree = getattr(tree, name)
    return tree


def _spec_paths(specs: Any) -> list[tuple[str, ParamSpec]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(specs)
    return [(".".join(k.name for k in path), spec) for path, spec in leaves]


def _build(specs: Any, tree: dict) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs)
    values = [_get_dict_path(tree, [k.name for k in path]) for path, _ in leaves]
    return jax.tree_util.tree_unflatten(treedef, values)


def _get_dict_path(tree: dict, names: list[str]) -> Any:
    for name in names:
        tree = tree[name]
    return tree


@pytest.fixture(scope="module")
def single_threaded_torch():
    """Tiny models gain nothing from torch's thread pool, and on shared CI cores its spinning threads
    slow Hugging Face generation tenfold; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_hf_config() -> Callable[..., dict]:
    return make_tiny_hf_config


@pytest.fixture(scope="session")
def hf_model() -> Callable[..., torch.nn.Module]:
    return make_hf_model


@pytest.fixture(scope="session")
def weights_from_state_dict() -> Callable[..., Any]:
    return weights_from_hf_state_dict

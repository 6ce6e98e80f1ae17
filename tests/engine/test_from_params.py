"""LLM.from_params: parameters already in memory (our weights dataclass, a Hugging Face-named Flax NNX
State with [in, out] kernels) and a Hugging Face config (dict or object) served without conversion, with
the dense reference's greedy tokens."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import transformers
from flax import nnx

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

VOCAB = 160
NEW_TOKENS = 6
ENGINE = dict(
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=64,
    compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    attention_backend="xla",
    show_progress=False,
)


def hf_named_state(weights, cfg) -> nnx.State:
    """The weights as a Flax NNX model mirroring Hugging Face's module names would hold them."""
    d = cfg.hidden_size
    layers = {}
    for i in range(cfg.num_layers):
        w = {name: np.asarray(getattr(weights.layers, name)[i]) for name in ("wq", "wk", "wv", "wo")}
        layers[i] = {
            "input_layernorm": {"weight": np.asarray(weights.layers.attn_norm[i])},
            "post_attention_layernorm": {"weight": np.asarray(weights.layers.mlp_norm[i])},
            "self_attn": {
                "q_proj": {"kernel": w["wq"].reshape(d, -1)},
                "k_proj": {"kernel": w["wk"].reshape(d, -1)},
                "v_proj": {"kernel": w["wv"].reshape(d, -1)},
                "o_proj": {"kernel": w["wo"].reshape(-1, d)},
            },
            "mlp": {
                "gate_proj": {"kernel": np.asarray(weights.layers.w_gate[i])},
                "up_proj": {"kernel": np.asarray(weights.layers.w_up[i])},
                "down_proj": {"kernel": np.asarray(weights.layers.w_down[i])},
            },
        }
    tree = {
        "model": {
            "embed_tokens": {"embedding": np.asarray(weights.embed)},
            "layers": layers,
            "norm": {"weight": np.asarray(weights.final_norm)},
        }
    }
    if weights.lm_head is not None:
        tree["lm_head"] = {"kernel": np.asarray(weights.lm_head)}
    with warnings.catch_warnings():  # flax announces that State will become a plain dict (also accepted)
        warnings.simplefilter("ignore", DeprecationWarning)
        return nnx.State(tree)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, VOCAB, n).tolist() for n in (3, 17, 9)]


@pytest.mark.parametrize("form", ["weights_dataclass", "nnx_state_hf_names"])
def test_from_params_serves_the_dense_references_tokens(tiny_model, char_tokenizer, form):
    model = tiny_model("llama")
    params = model.weights if form == "weights_dataclass" else hf_named_state(model.weights, model.config)
    llm = LLM.from_params(params, model.hf_config, char_tokenizer(), **ENGINE)
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, prompts(), NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert np.dtype(llm.engine.runner.spec.dtype) == np.float32  # "auto": the parameters' own dtype


def test_from_params_takes_a_transformers_config_and_refuses_what_does_not_fit(tiny_model, char_tokenizer):
    model = tiny_model("llama")
    config = transformers.LlamaConfig(**{k: v for k, v in model.hf_config.items() if k != "transformers_version"})
    llm = LLM.from_params(model.weights, config, char_tokenizer(), **ENGINE)
    assert llm.engine.steps.vocab_size == VOCAB
    with pytest.raises(TypeError, match="config must be a Hugging Face config"):
        LLM.from_params(model.weights, ["not", "a", "config"], char_tokenizer(), **ENGINE)
    with pytest.raises(ValueError, match="missing tensor"):
        state = nnx.to_pure_dict(hf_named_state(model.weights, model.config))
        del state["model"]["norm"]
        LLM.from_params(state, model.hf_config, char_tokenizer(), **ENGINE)

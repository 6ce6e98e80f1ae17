"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against Hugging Face transformers in float32 on
tiny random configs: odd expert counts (7, 5), both norm_topk_prob settings, dense layers among the expert layers
(mlp_only_layers, decoder_sparse_step 2), Qwen2-MoE's shared expert and q/k/v biases, Qwen3-MoE's q/k norm and
Mixtral's sliding window, routers scaled up so that tokens pick different experts. The checkpoints are what
transformers' save_pretrained writes (per-expert tensors), loaded by `load_model`: config parsing, each layer's
MLP block, whole-model logits through prefill and decode, greedy generation, and the loader's errors for expert
tensors that are missing, out of range or on a dense layer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch

from jaxserve.dense import generate_dense
from jaxserve.models import llama_moe, moe
from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.layers import LayerMlp
from jaxserve.models.loader import LoadedModel, load_model
from jaxserve.models.registry import resolve

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

# name -> (Hugging Face model_type, config overrides); the expert layers of each, in order.
FAMILIES: dict[str, tuple[str, dict]] = {
    # 7 experts, top 3 renormalised; layer 1 dense (mlp_only_layers); q/k norm; a window of 8 on every layer.
    "qwen3_moe": (
        "qwen3_moe",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "num_experts": 7,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "use_sliding_window": True,
            "sliding_window": 8,
        },
    ),
    # 5 experts, top 2 not renormalised, every second layer sparse, a shared expert of width 48, q/k/v biases.
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_hidden_layers": 4,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
    # 5 experts, top 2 renormalised, experts of width 40 (intermediate_size), a window of 8.
    "mixtral": (
        "mixtral",
        {
            "num_hidden_layers": 2,
            "num_local_experts": 5,
            "num_experts_per_tok": 2,
            "intermediate_size": 40,
            "sliding_window": 8,
        },
    ),
}
EXPERT_LAYERS = {"qwen3_moe": (0, 2), "qwen2_moe": (1, 3), "mixtral": (0, 1)}
ROUTER_SCALE = 3.0  # router logits of a few units: decisive choices that differ from token to token


@dataclass
class Case:
    name: str
    hf_config: dict
    model: torch.nn.Module
    directory: Path
    loaded: LoadedModel

    @property
    def cfg(self) -> llama_moe.MoeConfig:
        return self.loaded.config


def _make_case(name: str, directory: Path, tiny_hf_config, hf_model) -> Case:
    model_type, overrides = FAMILIES[name]
    hf_config = tiny_hf_config(model_type, **overrides)
    model = hf_model(hf_config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.mul_(ROUTER_SCALE)
    model.save_pretrained(directory)
    return Case(name, hf_config, model, directory, load_model(directory, dtype="float32"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory, tiny_hf_config, hf_model) -> Case:
    return _make_case(request.param, tmp_path_factory.mktemp(request.param), tiny_hf_config, hf_model)


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    err = np.abs(np.asarray(ours, np.float64) - ref).max()
    assert err <= 1e-5 * np.abs(ref).max(), f"max abs error {err} vs max |value| {np.abs(ref).max()}"


# ---- Config ------------------------------------------------------------------------------------------------


def test_config_declares_each_layers_mlp_as_transformers_builds_it(case: Case) -> None:
    cfg, hf = case.cfg, case.hf_config
    assert case.loaded.family is llama_moe
    sparse = tuple(
        i for i, layer in enumerate(case.model.model.layers) if type(layer.mlp).__name__.endswith("MoeBlock")
    )
    assert cfg.moe_layers == sparse == EXPERT_LAYERS[case.name]
    assert cfg.dense_layers == tuple(i for i in range(cfg.num_layers) if i not in sparse)
    experts = cfg.mlp_layers[sparse[0]]
    assert experts.num_experts == hf.get("num_experts", hf.get("num_local_experts"))
    assert experts.top_k == hf["num_experts_per_tok"]
    assert experts.normalize_top_k == hf.get("norm_topk_prob", True)  # Mixtral always renormalises
    assert experts.shared_intermediate_size == hf.get("shared_expert_intermediate_size")
    assert {layer.sliding_window for layer in cfg.attention_layers} == {hf.get("sliding_window") or None}
    assert cfg.base.qk_norm == (case.name == "qwen3_moe") and cfg.base.attention_bias == (case.name == "qwen2_moe")
    for i in cfg.dense_layers:
        assert cfg.mlp_layers[i] == LayerMlp(hf["intermediate_size"])


_QWEN3 = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_experts": 7,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be <= the number of experts \(7\), got 9"),
        ({"num_experts": 0}, r"num_experts must be an int >= 1, got 0"),
        ({"num_local_experts": 5}, r"num_experts and num_local_experts differ: 7 and 5"),
        ({"moe_intermediate_size": -1}, r"moe_intermediate_size must be an int >= 1, got -1"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step must be an int >= 1, got 0"),
        ({"mlp_only_layers": [1, 5]}, r"mlp_only_layers must hold layer indices in \[0, 3\), got \[5\]"),
        ({"mlp_only_layers": "1"}, r"mlp_only_layers must be a list of ints, got '1'"),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob must be a bool \(true or false\), got 'yes'"),
        ({"attention_bias": True}, r"attention_bias must be false"),
        ({"hidden_act": "gelu"}, r"hidden_act must be 'silu'"),
        ({"model_type": "qwen2_moe", "shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size must be"),
        ({"model_type": "qwen2_moe", "qkv_bias": 1}, r"qkv_bias must be a bool"),
        ({"model_type": "deepseek_v3"}, r"model_type must be one of \['mixtral', 'qwen2_moe', 'qwen3_moe'\]"),
    ],
)
def test_bad_configs_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llama_moe.MoeConfig.from_hf({**_QWEN3, **overrides})


def test_defaults_as_transformers_reads_them() -> None:
    """Keys left out take transformers' defaults: Qwen3-MoE's head_dim is hidden // heads (not Qwen3's 128),
    Mixtral's rope base is 1e6 and it has no window (not Mistral's 4096), Qwen2-MoE's 0 window means none."""
    _, qwen3 = resolve({k: v for k, v in _QWEN3.items() if k != "num_experts"})
    assert qwen3.head_dim == 16 and qwen3.mlp_layers[0] == LayerMlp(768, 128, 2)
    mixtral = {**_QWEN3, "model_type": "mixtral"}
    del mixtral["num_experts"]
    _, cfg = resolve(mixtral)
    assert cfg.base.rope.theta == 1e6 and cfg.base.sliding_window is None and cfg.base.rms_norm_eps == 1e-5
    assert cfg.mlp_layers == (LayerMlp(48, 8, 2, normalize_top_k=True),) * 3
    _, qwen2 = resolve({**_QWEN3, "model_type": "qwen2_moe", "sliding_window": 0, "use_sliding_window": False})
    assert qwen2.base.sliding_window is None and qwen2.base.attention_bias
    assert qwen2.mlp_layers[0].shared_intermediate_size == 5632


# ---- Numerics against Hugging Face ----------------------------------------------------------------


def test_mlp_blocks_match_hf_and_routing_differs_between_tokens(case: Case) -> None:
    """Each layer's MLP (dense or experts) on 24 random rows; in expert layers every expert receives rows and
    most tokens' top-k sets differ from one another."""
    torch.manual_seed(3)
    x = torch.randn(1, 24, case.cfg.hidden_size)
    serving = llama_moe.to_serving(case.loaded.weights, case.cfg)
    for i, (layer, mlp) in enumerate(zip(serving.layers, case.cfg.mlp_layers, strict=True)):
        with torch.no_grad():
            ref = case.model.model.layers[i].mlp(x)[0].numpy()
        xs = jnp.asarray(x[0].numpy())
        _assert_close(np.asarray(moe.mlp_block(xs, layer.mlp, mlp)), ref)
        if mlp.kind == "moe":
            ids, _ = moe.route(xs, layer.mlp.router, mlp.top_k, mlp.normalize_top_k)
            assert np.bincount(np.asarray(ids).ravel(), minlength=mlp.num_experts).min() > 0, f"layer {i}"
            assert len({tuple(sorted(row)) for row in np.asarray(ids).tolist()}) > 6, f"layer {i}"


@partial(jax.jit, static_argnames=("cfg",))
def _logits(weights, token_ids, positions, seq_ids, kv_cache, cfg):
    weights = llama_moe.to_serving(weights, cfg)
    meta = DenseAttentionMetadata(seq_ids)
    hidden, kv_cache = llama_moe.forward(weights, token_ids, positions, kv_cache, meta, cfg)
    return llama_moe.compute_logits(weights, hidden, cfg), kv_cache


def _hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].double().numpy()


def test_prefill_then_decode_logits_match_hf(case: Case) -> None:
    """Two sequences (24 and 17 tokens, longer than the windows of 8) prefilled in one flat batch, then 3 batched
    decode steps."""
    rng = np.random.default_rng(4)
    lengths, decode_steps = (24, 17), 3
    cfg, weights = case.cfg, case.loaded.weights
    sequences = [rng.integers(0, cfg.vocab_size, n + decode_steps).astype(np.int32) for n in lengths]
    cache = init_dense_cache(cfg, 2, max(lengths) + decode_steps, jnp.float32)
    tokens = np.concatenate([s[:n] for s, n in zip(sequences, lengths, strict=True)])
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    seq_ids = np.repeat([0, 1], lengths).astype(np.int32)
    logits, cache = _logits(weights, tokens, positions, seq_ids, cache, cfg)
    ours = [[np.asarray(logits)[: lengths[0]]], [np.asarray(logits)[lengths[0] :]]]
    for step in range(decode_steps):
        step_positions = np.array(lengths, np.int32) + step
        step_tokens = np.array([s[p] for s, p in zip(sequences, step_positions, strict=True)], np.int32)
        logits, cache = _logits(weights, step_tokens, step_positions, np.array([0, 1], np.int32), cache, cfg)
        for b in range(2):
            ours[b].append(np.asarray(logits)[b : b + 1])
    for b, sequence in enumerate(sequences):
        _assert_close(np.concatenate(ours[b]), _hf_logits(case.model, sequence))


def test_greedy_generation_matches_hf_generate(case: Case) -> None:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, case.cfg.vocab_size, n).tolist() for n in (5, 13)]
    ours = generate_dense(llama_moe, case.cfg, case.loaded.weights, prompts, 24)
    case.model.generation_config.eos_token_id = None  # 24 tokens whatever comes out
    refs = []
    for prompt in prompts:  # one at a time: no padding, so the windows see the same positions
        with torch.no_grad():
            out = case.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=0)
        refs.append(out[0, len(prompt) :].tolist())
    assert ours == refs


# ---- Checkpoint tensors --------------------------------------------------------------------------------


def _rewrite(case: Case, directory: Path, edit) -> Path:
    """A copy of the case's checkpoint with its tensors passed through `edit` (a dict -> dict function)."""
    tensors = safetensors.torch.load_file(case.directory / "model.safetensors")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(case.hf_config))
    safetensors.torch.save_file(edit(tensors), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_expert_tensors_missing_out_of_range_or_on_a_dense_layer_are_named(
    tmp_path: Path, tiny_hf_config, hf_model
) -> None:
    """Qwen2-MoE's tensors (dense and expert layers, a shared expert): the other families' rules differ only in
    their names."""
    case = _make_case("qwen2_moe", tmp_path / "checkpoint", tiny_hf_config, hf_model)
    expert = "model.layers.3.mlp.experts.4.up_proj.weight"

    def without(tensors: dict) -> dict:
        return {k: v for k, v in tensors.items() if k != expert}

    with pytest.raises(ValueError, match=rf"missing tensor {expert} \(field experts\.w_up, layer 3, expert 4\)"):
        load_model(_rewrite(case, tmp_path / "missing", without), dtype="float32")

    def extra_expert(tensors: dict) -> dict:
        return tensors | {"model.layers.1.mlp.experts.5.up_proj.weight": tensors[expert].clone()}

    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight: expert 5 out of range, the config has 5"):
        load_model(_rewrite(case, tmp_path / "range", extra_expert), dtype="float32")

    def experts_on_a_dense_layer(tensors: dict) -> dict:
        return tensors | {"model.layers.0.mlp.experts.0.up_proj.weight": tensors[expert].clone()}

    with pytest.raises(
        ValueError, match=r"layer 0 has no experts\.w_up in this config \(the layers that have: \[1, 3\]\)"
    ):
        load_model(_rewrite(case, tmp_path / "dense", experts_on_a_dense_layer), dtype="float32")

    def no_shared_gate(tensors: dict) -> dict:
        return {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.shared_expert_gate.weight"}

    with pytest.raises(ValueError, match=r"missing tensor model\.layers\.1\.mlp\.shared_expert_gate\.weight"):
        load_model(_rewrite(case, tmp_path / "shared", no_shared_gate), dtype="float32")


# ---- Random-weight shapes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "total", "active"), [("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9)])
def test_random_weight_shapes_read_as_transformers_reads_them(name: str, total: float, active: float) -> None:
    """The hub configs' shapes, their layers as transformers builds them, and the published parameter counts
    (total and active: the experts a token reaches, top_k of num_experts, with everything else), from abstract
    weights: nothing is allocated."""
    import transformers

    from jaxserve.models import shapes

    hf = shapes.shape(name)
    _, cfg = resolve(hf)
    reference = transformers.AutoConfig.for_model(**hf)
    experts = cfg.mlp_layers[0]
    assert cfg.moe_layers == tuple(range(reference.num_hidden_layers))
    assert experts.num_experts == reference.num_experts and experts.top_k == reference.num_experts_per_tok
    assert experts.normalize_top_k and cfg.base.sliding_window is None
    assert (
        cfg.head_dim == getattr(reference, "head_dim", None) or reference.hidden_size // reference.num_attention_heads
    )
    abstract = jax.eval_shape(lambda: llama_moe.init_weights(cfg, jax.random.key(0), jnp.bfloat16))
    count = sum(np.prod(w.shape) for w in jax.tree.leaves(abstract))
    routed = sum(np.prod(w.shape) for w in (abstract.experts.w_gate, abstract.experts.w_up, abstract.experts.w_down))
    reached = count - routed + routed * experts.top_k // experts.num_experts
    assert abs(count / 1e9 - total) < 0.05, count  # published as 30.5B and 46.7B
    assert abs(reached / 1e9 - active) < 0.06, reached  # published as 3.3B and 12.9B activated

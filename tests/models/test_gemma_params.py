"""Gemma weights from what a trainer hands over: google-tunix's parameter trees (its Gemma, Gemma 2 and Gemma3
modules' names and layouts, built here by hand from a transformers model's tensors, so tunix is not needed;
tests/integrations/test_tunix_gemma.py checks the same mapping against tunix's own forward) and orbax checkpoints.
Each gives exactly the weights the family's Hugging Face load gives; `LLM.from_params` on a tunix tree serves
the dense reference's greedy tokens; a tree that does not fit is an error naming the parameter."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.llm import LLM
from jaxserve.models import gemma
from jaxserve.models.loader import load_from_pytree, load_model, save_orbax
from jaxserve.models.registry import resolve
from jaxserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

# name -> (model_type, overrides): one kv head (tunix's kv_einsum [2, 1, D, Dh]), as many kv heads as query
# heads (its fused qkv_einsum) and grouped kv heads with q/k norms and H * Dh unlike D.
CASES = {
    "gemma": ("gemma", {"head_dim": 16, "num_key_value_heads": 1}),
    "gemma2": (
        "gemma2",
        {"head_dim": 16, "num_key_value_heads": 4, "query_pre_attn_scalar": 16, "sliding_window": 8},
    ),
    "gemma3": (
        "gemma3_text",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


@dataclass
class Case:
    hf_config: dict
    cfg: gemma.GemmaConfig
    weights: gemma.GemmaWeights  # through the family's Hugging Face checkpoint rules
    tunix: dict  # the same tensors as a tunix module holds them


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_hf_config, hf_model, weights_from_state_dict) -> Case:
    return make_case(request.param, tiny_hf_config, hf_model, weights_from_state_dict)


@pytest.fixture(scope="module")
def gemma3_case(tiny_hf_config, hf_model, weights_from_state_dict) -> Case:
    return make_case("gemma3", tiny_hf_config, hf_model, weights_from_state_dict)


def make_case(name: str, tiny_hf_config, hf_model, weights_from_state_dict) -> Case:
    model_type, overrides = CASES[name]
    hf_config = tiny_hf_config(model_type, **overrides)
    state_dict = hf_model(hf_config).state_dict()
    _, cfg = resolve(hf_config)
    weights = weights_from_state_dict(gemma, cfg, state_dict)
    return Case(hf_config, cfg, weights, tunix_tree({name: t.numpy() for name, t in state_dict.items()}, cfg))


def tunix_tree(t: dict[str, np.ndarray], cfg: gemma.GemmaConfig) -> dict:
    """`nnx.to_pure_dict` of a tunix Gemma / Gemma3's Params, from Hugging Face tensors: q/k/v einsum weights
    [heads, D, Dh] (k and v stacked, or q, k and v when the head counts are equal), attn_vec_einsum [H, Dh, D],
    [in, out] kernels, norm scales as they are (both multiply by 1 + w)."""
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def heads(name: str, n: int) -> np.ndarray:  # [n * Dh, D] -> [n, D, Dh]
        return t[name].reshape(n, dh, -1).transpose(0, 2, 1)

    layers = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        q, key, value = (heads(p + f"self_attn.{x}_proj.weight", n) for x, n in (("q", h), ("k", k), ("v", k)))
        attn = {"attn_vec_einsum": {"w": t[p + "self_attn.o_proj.weight"].T.reshape(h, dh, -1)}}
        if h == k:
            attn["qkv_einsum"] = {"w": np.stack([q, key, value])}
        else:
            attn |= {"q_einsum": {"w": q}, "kv_einsum": {"w": np.stack([key, value])}}
        layer = {
            "pre_attention_norm": {"scale": t[p + "input_layernorm.weight"]},
            "attn": attn,
            "mlp": {m: {"kernel": t[p + f"mlp.{m}.weight"].T} for m in ("gate_proj", "up_proj", "down_proj")},
        }
        if cfg.version == 1:
            layer["pre_ffw_norm"] = {"scale": t[p + "post_attention_layernorm.weight"]}
        else:  # Gemma 2 and Gemma3 name the attention output's norm differently
            post_attn = "post_attn_norm" if cfg.version == 2 else "post_attention_norm"
            layer[post_attn] = {"scale": t[p + "post_attention_layernorm.weight"]}
            layer["pre_ffw_norm"] = {"scale": t[p + "pre_feedforward_layernorm.weight"]}
            layer["post_ffw_norm"] = {"scale": t[p + "post_feedforward_layernorm.weight"]}
        if cfg.version == 3:
            attn["_query_norm"] = {"scale": t[p + "self_attn.q_norm.weight"]}
            attn["_key_norm"] = {"scale": t[p + "self_attn.k_norm.weight"]}
        layers[i] = layer
    return {
        "embedder": {"input_embedding": t["model.embed_tokens.weight"]},
        "layers": layers,
        "final_norm": {"scale": t["model.norm.weight"]},
    }


def assert_same_weights(got: gemma.GemmaWeights, want: gemma.GemmaWeights) -> None:
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree_util.tree_leaves_with_path(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_tunix_names_load_the_hf_weights(case: Case) -> None:
    assert_same_weights(load_from_pytree(gemma, case.cfg, case.tunix, "float32"), case.weights)
    if case.cfg.version == 3:  # a multimodal Gemma3's vision side is not served
        vision = {"vision_encoder": {"siglip_encoder": {"w": np.zeros(3)}}}
        tree = {**case.tunix, **vision, "embedder": {**case.tunix["embedder"], "mm_input_projection": {"w": 0}}}
        assert_same_weights(load_from_pytree(gemma, case.cfg, tree, "float32"), case.weights)


class IdTokenizer:
    """Prompts are token ids here; decoding only has to give some text."""

    eos_token_ids = ()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 160 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def test_from_params_on_tunix_names_serves_the_dense_references_tokens(gemma3_case: Case) -> None:
    """One engine: the versions' trees differ in names and layouts, which the test above checks."""
    case = gemma3_case
    engine = dict(
        max_batch_size=2,
        max_num_tokens=32,
        max_seq_len=64,
        compile_config=CompileConfig(decode_batch_sizes=(2,), token_buckets=(32,), penalty_variants=False),
        attention_backend="xla",
        show_progress=False,
    )
    prompts = [[5, 17, 3, 99, 41], [7, 150, 64, 12, 9, 33, 120, 88, 2, 14, 70]]  # the second past the window
    llm = LLM.from_params(case.tunix, case.hf_config, IdTokenizer(), **engine)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    llm.close()
    assert [o.outputs[0].token_ids for o in outputs] == generate_dense(gemma, case.cfg, case.weights, prompts, 6)


def _layer(tree: dict, i: int = 0) -> dict:
    return tree["layers"][i]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda t: _layer(t)["attn"].update(rope={"w": 0}),
            r"tunix parameter layers\.0\.attn\.rope\.w has no counterpart",
        ),
        (
            lambda t: _layer(t)["attn"].update(kv_einsum={"w": np.zeros((3, 2, 64, 32))}),
            r"tunix parameter layers\.0\.attn\.kv_einsum\.w: shape \(3, 2, 64, 32\), expected \[2, K, D, Dh\]",
        ),
        (
            lambda t: _layer(t)["attn"].update(qkv_einsum={"w": np.zeros((3, 4, 64, 32))}),
            r"tunix parameters layers\.0\.attn\.q_einsum\.w and layers\.0\.attn\.qkv_einsum\.w both hold wq of layer 0",
        ),
        (
            lambda t: _layer(t)["attn"]["q_einsum"].update(w_lora_a=0),
            r"LoRA parameter layers\.0\.attn\.q_einsum\.w_lora_a: .* merge the adapters",
        ),
        (
            lambda t: t["layers"].update({2: t["layers"].pop(1)}),
            r"missing tunix parameter layers\.1\.\S+ \(\w+ of layer 1; the tree has 3 layers",
        ),
        (
            lambda t: _layer(t)["attn"]["_key_norm"].update(scale=np.zeros(16)),
            r"layers of k_norm differ in shape: layers\.0\.attn\._key_norm\.scale \(16,\), "
            r"layers\.1\.attn\._key_norm\.scale \(32,\)",
        ),
        (
            lambda t: _layer(t, 1)["attn"].pop("_query_norm"),
            r"missing tunix parameter layers\.1\.attn\._query_norm\.scale \(q_norm of layer 1; the tree has 2 layers",
        ),
    ],
)
def test_tunix_trees_that_do_not_fit_are_errors_naming_the_parameter(gemma3_case: Case, change, message) -> None:
    case = gemma3_case
    tree = jax.tree.map(lambda x: x, case.tunix)  # a copy of the dicts, not of the arrays
    change(tree)
    with pytest.raises(ValueError, match=message):
        load_from_pytree(gemma, case.cfg, tree, "float32")


def test_orbax_checkpoint_of_gemma_weights_loads_them(case: Case, tmp_path) -> None:
    save_orbax(tmp_path / "ckpt", case.weights, hf_config=case.hf_config)
    loaded = load_model(tmp_path / "ckpt", dtype="float32")
    assert loaded.family is gemma and loaded.config == case.cfg
    assert_same_weights(loaded.weights, case.weights)

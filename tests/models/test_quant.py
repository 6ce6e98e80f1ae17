"""FP8 linear weights (jaxserve/models/quant.py): quantization per output channel, the FP8 product against a float32
reference of its dequantized operands for every projection's einsum, the quantized serving specs, and each
family's quantized serving layout (which fields are FP8, and that a forward through them stays close to the
unquantized one while a wrong scale would not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import gemma, llama, llama_moe, quant, registry
from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.common import ParamSpec

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

# (einsum, weight shape, input shape): every projection of the families (wqkv, wo, gate/up, down).
PRODUCTS = [
    ("td,dkge->tkge", (48, 2, 4, 16), (5, 48)),
    ("the,hed->td", (4, 16, 48), (5, 4, 16)),
    ("td,dcf->tcf", (48, 2, 40), (5, 48)),
    ("tf,fd->td", (40, 48), (5, 40)),
]


def _weight(rng: np.random.Generator, shape: tuple[int, ...], num_in: int) -> np.ndarray:
    """Random weights whose output channels differ in magnitude by up to 1000x (a per-input or per-tensor scale
    would lose the small channels)."""
    channel_scale = 10.0 ** rng.uniform(-3, 0, shape[num_in:])
    return (rng.standard_normal(shape) * channel_scale).astype(np.float32)


@pytest.mark.parametrize("spec, w_shape, x_shape", PRODUCTS, ids=["qkv", "o", "gate_up", "down"])
def test_quantize_keeps_each_output_channel_to_e4m3_precision(spec, w_shape, x_shape):
    num_in = len(_contracted(spec))
    w = _weight(np.random.default_rng(0), w_shape, num_in)
    q = quant.quantize(jnp.asarray(w), num_in)
    # Stored output-major ([*out, *in]: each channel's inputs contiguous, cuBLASLt's FP8 operand layout).
    assert q.values.dtype == jnp.float8_e4m3fn and q.values.shape == w_shape[num_in:] + w_shape[:num_in]
    assert q.scale.dtype == jnp.float32 and q.scale.shape == w_shape[num_in:]
    stored = np.asarray(quant.serving_order(q.values, num_in), np.float32)
    np.testing.assert_array_equal(stored * np.asarray(q.scale), q.dequantize())
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=tuple(range(num_in))) / 448, rtol=1e-6)
    # Each element to within half an e4m3 step of its channel's range: 2^-4 of itself, or 2^-10 of the
    # channel's max where it is subnormal.
    err = np.abs(np.asarray(q.dequantize()) - w)
    bound = np.maximum(np.abs(w) * 2.0**-4, np.asarray(q.scale) * 2.0**-10)
    assert (err <= bound * 1.0001).all()


def _contracted(spec: str) -> str:
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return "".join(c for c in x if c in w and c not in out)


@pytest.mark.parametrize("spec, w_shape, x_shape", PRODUCTS, ids=["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fp8_product_equals_the_float32_product_of_its_dequantized_operands(spec, w_shape, x_shape, dtype):
    rng = np.random.default_rng(1)
    num_in = len(_contracted(spec))
    w = quant.quantize(jnp.asarray(_weight(rng, w_shape, num_in)), num_in)
    x = jnp.asarray(rng.standard_normal(x_shape) * 10.0 ** rng.uniform(-2, 1, x_shape[:1] + (1,) * (len(x_shape) - 1)))
    x = x.astype(dtype)
    out = quant.linear(spec, x, w)
    assert out.dtype == dtype
    xq, x_scale = quant.quantize_rows(x, num_in)
    x_deq = np.asarray(xq, np.float32) * np.asarray(x_scale).reshape(x_scale.shape + (1,) * num_in)
    want = np.einsum(spec, x_deq.astype(np.float64), np.asarray(w.dequantize(), np.float64))
    tol = 1e-5 if dtype == jnp.float32 else 2.0**-8
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=tol, atol=tol * np.abs(want).max())
    # And close to the unquantized product: e4m3 keeps about 2^-4 of each operand.
    exact = np.einsum(spec, np.asarray(x, np.float64), np.asarray(_weight(np.random.default_rng(1), w_shape, num_in)))
    assert np.abs(np.asarray(out, np.float64) - exact).max() <= 0.1 * np.abs(exact).max()


@pytest.mark.parametrize("spec, w_shape, x_shape", PRODUCTS, ids=["qkv", "o", "gate_up", "down"])
def test_fp8_product_contracts_the_stored_weight_as_it_lies(spec, w_shape, x_shape):
    """One dot_general of the e4m3 operands, each contracted on its trailing axes in order and neither transposed:
    the layout cuBLASLt's FP8 GEMM reads directly. (A weight stored [*in, *out], or contracted out of order, is
    transposed by XLA on every call: on an H100 that made the FP8 product slower than bf16's, docs/performance.md.)"""
    num_in = len(_contracted(spec))
    w = quant.quantize(jnp.ones(w_shape), num_in)
    x = jnp.ones(x_shape, jnp.bfloat16)
    text = jax.jit(lambda x, w: quant.linear(spec, x, w)).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1 and "transpose" not in text
    x_in = list(range(len(x_shape) - num_in, len(x_shape)))
    w_in = list(range(len(w_shape) - num_in, len(w_shape)))
    assert f"contracting_dims = {x_in} x {w_in}" in dots[0] and dots[0].count("f8E4M3FN") == 2, dots[0]


def test_rows_are_quantized_each_by_its_own_scale():
    x = jnp.asarray([[1.0, -2.0, 0.5], [1e-3, 2e-3, -4e-3], [0.0, 0.0, 0.0]], jnp.float32)
    values, scale = quant.quantize_rows(x, 1)
    np.testing.assert_allclose(scale[:2], [2.0 / 448, 4e-3 / 448], rtol=1e-6)
    assert np.isfinite(np.asarray(scale[2])) and not np.asarray(values[2], np.float32).any()
    np.testing.assert_allclose(np.asarray(values, np.float32)[:2] * np.asarray(scale)[:2, None], x[:2], rtol=2**-4)


def test_plain_weights_take_the_einsum():
    x, w = jnp.ones((3, 4)), jnp.full((4, 2), 0.5)
    np.testing.assert_array_equal(quant.linear("td,df->tf", x, w), jnp.einsum("td,df->tf", x, w))


def test_quantized_spec_scales_over_the_output_axes():
    spec = ParamSpec((64, 2, 6, 16), ("embed", "kv_heads", None, "head_dim"))
    q = quant.quantized_spec(spec, 1)
    assert q.values == ParamSpec((2, 6, 16, 64), ("kv_heads", None, "head_dim", "embed"))  # stored [*out, *in]
    assert q.scale == ParamSpec((2, 6, 16), ("kv_heads", None, "head_dim"))
    wo = quant.quantized_spec(ParamSpec((4, 16, 64), ("heads", "head_dim", "embed")), 2)
    assert wo.values == ParamSpec((64, 4, 16), ("embed", "heads", "head_dim"))
    assert wo.scale == ParamSpec((64,), ("embed",))
    with pytest.raises(ValueError, match="num_in_axes must be in"):
        quant.quantize(jnp.ones((4, 4)), 2)


def _tiny(family_module, hf_extra: dict):
    import transformers

    classes = {
        llama: transformers.LlamaConfig,
        gemma: transformers.Gemma3TextConfig,
        llama_moe: transformers.Qwen3MoeConfig,
    }
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    hf = classes[family_module](**base, num_key_value_heads=2, max_position_embeddings=128, **hf_extra).to_dict()
    hf["architectures"] = [
        {llama: "LlamaForCausalLM", gemma: "Gemma3ForCausalLM", llama_moe: "Qwen3MoeForCausalLM"}[family_module]
    ]
    return registry.resolve(hf)


FAMILIES = {
    "llama": (llama, {}),
    "gemma3": (gemma, {"head_dim": 16, "sliding_window": 8}),
    "qwen3_moe": (
        llama_moe,
        {
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
        },
    ),
}


def _logits(family, cfg, serving, tokens):
    n = len(tokens)
    cache = init_dense_cache(cfg, 1, n, serving.embed.dtype)
    hidden, _ = family.forward(
        serving, jnp.asarray(tokens), jnp.arange(n), cache, DenseAttentionMetadata(jnp.zeros(n, jnp.int32)), cfg
    )
    return np.asarray(family.compute_logits(serving, hidden, cfg))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_quantizes_its_linear_weights_and_stays_close(name):
    family, cfg = _tiny(*FAMILIES[name])
    weights = family.init_weights(cfg, jax.random.key(0), jnp.float32)
    plain = family.to_serving(weights, cfg)
    fp8 = family.to_serving(weights, cfg, quantization="fp8")
    specs = family.serving_specs(cfg, quantization="fp8")
    # The quantized tree has the quantized specs' structure and shapes, and is FP8 exactly where they say.
    assert jax.tree.structure(fp8) == jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, ParamSpec))
    for leaf, spec in zip(
        jax.tree.leaves(fp8), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, ParamSpec)), strict=True
    ):
        assert leaf.shape == spec.shape
    layer = fp8.layers[-1]
    assert isinstance(layer.wqkv, quant.Fp8Weight) and isinstance(layer.wo, quant.Fp8Weight)
    assert not isinstance(fp8.embed, quant.Fp8Weight) and fp8.embed.dtype == jnp.float32
    if name == "qwen3_moe":
        assert isinstance(fp8.layers[1].mlp.w_down, quant.Fp8Weight)  # the dense layer
        experts = fp8.layers[0].mlp  # the expert stacks: e4m3 in their own layout, a scale per expert and column
        assert isinstance(experts.w_gate_up, quant.Fp8Experts) and isinstance(experts.w_down, quant.Fp8Experts)
        assert experts.w_gate_up.values.shape == (4, 64, 2, 32) and experts.w_gate_up.scale.shape == (4, 2, 32)
        assert experts.w_down.values.dtype == jnp.float8_e4m3fn and experts.w_down.scale.shape == (4, 64)
    else:
        assert isinstance(layer.w_gate_up, quant.Fp8Weight) and isinstance(layer.w_down, quant.Fp8Weight)
    # The quantized forward stays within FP8's precision of the plain one: each FP8 product of Gaussian operands is
    # 3.5% (relative RMS) off the exact one (e4m3 keeps 2.5% of each operand), and two layers of four products
    # (random weights: no trained structure damps the errors) compound that to 8-12%. The exact check of each
    # product is test_fp8_product_equals_the_float32_product_of_its_dequantized_operands.
    tokens = [3, 17, 42, 9, 60, 1, 88, 25, 7, 50, 33, 12]
    want = _logits(family, cfg, plain, tokens)
    got = _logits(family, cfg, fp8, tokens)
    rel_rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert rel_rms <= 0.15, rel_rms


def test_expert_stacks_quantize_per_expert_and_output_channel():
    rng = np.random.default_rng(3)
    # [E, Din, 2, F]: experts and channels whose magnitudes differ by up to 1000x.
    w = rng.standard_normal((3, 24, 2, 8)) * 10.0 ** rng.uniform(-3, 0, (3, 1, 2, 8))
    q = quant.quantize_experts(jnp.asarray(w, jnp.float32))
    assert q.values.shape == w.shape and q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 2, 8)
    np.testing.assert_allclose(q.scale, np.abs(w).max(axis=1) / 448, rtol=1e-6)
    err = np.abs(np.asarray(q.dequantize()) - w)
    assert (err <= np.maximum(np.abs(w) * 2.0**-4, np.asarray(q.scale)[:, None] * 2.0**-10) * 1.0001).all()
    spec = quant.quantized_experts_spec(ParamSpec((3, 24, 2, 8), ("experts", "embed", None, "mlp")))
    assert spec.values == ParamSpec((3, 24, 2, 8), ("experts", "embed", None, "mlp"))
    assert spec.scale == ParamSpec((3, 2, 8), ("experts", None, "mlp"))
    with pytest.raises(ValueError, match="an expert stack is"):
        quant.quantize_experts(jnp.ones((4, 4)))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_an_untied_lm_head_quantizes_per_vocabulary_entry_and_stays_close(name):
    family_module, extra = FAMILIES[name]
    family, cfg = _tiny(family_module, {**extra, "tie_word_embeddings": False})  # Gemma ties by default
    weights = family.init_weights(cfg, jax.random.key(1), jnp.float32)
    fp8 = family.to_serving(weights, cfg, quantization="fp8")
    with_head = family.to_serving(weights, cfg, quantization="fp8", quantize_lm_head=True)
    specs = family.serving_specs(cfg, quantization="fp8", quantize_lm_head=True)
    assert specs.lm_head.values == ParamSpec((96, 64), ("vocab", "embed"))
    assert specs.lm_head.scale == ParamSpec((96,), ("vocab",))
    head = with_head.lm_head
    assert isinstance(head, quant.Fp8Weight) and head.values.shape == (96, 64) and head.scale.shape == (96,)
    np.testing.assert_allclose(head.scale, np.abs(np.asarray(weights.lm_head)).max(axis=0) / 448, rtol=1e-6)
    tokens = [3, 17, 42, 9, 60, 1, 88, 25]
    want, got = _logits(family, cfg, fp8, tokens), _logits(family, cfg, with_head, tokens)
    assert got.dtype == np.float32
    rel_rms = np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2))
    assert 0 < rel_rms <= 0.06, rel_rms  # one more FP8 product: ~3.5% relative RMS
    tied_family, tied_cfg = _tiny(family_module, {**extra, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="ties its lm_head"):
        tied_family.serving_specs(tied_cfg, quantization="fp8", quantize_lm_head=True)
    with pytest.raises(ValueError, match="needs quantization='fp8'"):
        family.serving_specs(cfg, quantize_lm_head=True)


def test_fp8_kv_values_clip_to_e4m3_range():
    """An FP8 KV cache's writes saturate at +-448 (e4m3fn has no infinity: a plain cast would give NaN)."""
    from jaxserve.models.attention import to_cache

    x = jnp.asarray([1000.0, -1e4, 3.0, 0.1], jnp.bfloat16)
    assert np.isnan(np.asarray(x.astype(quant.FP8_DTYPE), np.float32)[0])  # what the clip prevents
    np.testing.assert_array_equal(np.asarray(to_cache(x, quant.FP8_DTYPE), np.float32), [448.0, -448.0, 3.0, 0.1015625])
    np.testing.assert_array_equal(to_cache(x, jnp.bfloat16), x)  # other caches: a plain cast

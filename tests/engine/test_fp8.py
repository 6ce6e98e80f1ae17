"""An engine with FP8 linear weights (`LLM(quantization="fp8")`) and an FP8 KV cache (`kv_cache_dtype="fp8"`), alone
and together: greedy tokens equal the dense reference's with the same FP8 products and the same FP8 cache under
preemption, chunked prefill, prefix hits and sliding-window block release; the weights take FP8 bytes on the
device and the pool a byte a value; `update_weights` quantizes the new values again and compiles nothing; bad
values are clear errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.config import CapacityPolicy, CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.models import quant
from jaxserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BUCKETS = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False)


@pytest.fixture(scope="module")
def fp8_engines(tiny_model, make_llm):
    built = {}

    def get(model_type: str, quantization: str | None = "fp8", kv_cache_dtype: str = "auto"):
        key = model_type, quantization, kv_cache_dtype
        if key not in built:
            model = tiny_model(model_type)
            llm = make_llm(
                model,
                policy=CapacityPolicy.MAX_UTILIZATION,
                kv_tokens=96,
                max_seq_len=80,
                compile_config=BUCKETS,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
            )
            built[key] = model, llm
        return built[key]

    return get


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 160, 40).tolist()
    prompts = [prefix + rng.integers(0, 160, int(rng.integers(1, 20))).tolist() for _ in range(4)]
    return prompts + [rng.integers(0, 160, int(rng.integers(1, 60))).tolist() for _ in range(6)]


@pytest.mark.parametrize("model_type", ["llama", "gemma3", "qwen3_moe"])
def test_fp8_greedy_equals_the_dense_reference_with_the_same_products(fp8_engines, model_type, assert_engine_idle):
    model, llm = fp8_engines(model_type)
    prompts = _prompts(seed=3)
    steps_before, hits_before = len(llm.step_stats), llm.engine.block_manager.stats.hit_tokens
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS, quantization="fp8")
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.step_stats[steps_before:]
    assert sum(s.num_preempted for s in stats) > 0, "the KV pool was meant to force preemption"
    assert llm.engine.block_manager.stats.hit_tokens > hits_before, "the shared prefix was meant to hit the cache"
    # Not the unquantized model's tokens everywhere: the FP8 products are what ran.
    plain = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS)
    assert plain != reference
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    "model_type, quantization",
    [("llama", None), ("llama", "fp8"), ("gemma3", None), ("qwen3_moe", "fp8")],
    ids=["llama-kv", "llama-weights-kv", "gemma3-kv", "qwen3_moe-weights-kv"],
)
def test_fp8_kv_greedy_equals_the_dense_reference_with_an_fp8_cache(
    fp8_engines, model_type, quantization, assert_engine_idle
):
    model, llm = fp8_engines(model_type, quantization, "fp8")
    assert llm.engine.runner.kv_cache.k.dtype == jax.numpy.float8_e4m3fn
    prompts = _prompts(seed=5)
    steps_before, hits_before = len(llm.step_stats), llm.engine.block_manager.stats.hit_tokens
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    reference = generate_dense(
        model.family, model.config, model.weights, prompts, NEW_TOKENS, quantization=quantization, kv_cache_dtype="fp8"
    )
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.step_stats[steps_before:]
    assert sum(s.num_preempted for s in stats) > 0 and llm.engine.block_manager.stats.hit_tokens > hits_before
    assert_engine_idle(llm)


def test_fp8_kv_pool_takes_a_byte_a_value(fp8_engines):
    _, plain = fp8_engines("llama", None, "auto")
    _, fp8 = fp8_engines("llama", None, "fp8")
    per_token = [llm.engine.kv_budget.bytes_per_block for llm in (plain, fp8)]
    assert per_token[0] == 4 * per_token[1]  # float32 on the CPU against e4m3


def test_fp8_weights_take_fp8_bytes_on_the_device(fp8_engines):
    _, llm = fp8_engines("llama")
    arrays = llm.engine.runner.weights.arrays
    layer = arrays.layers[0]
    for name in ("wqkv", "wo", "w_gate_up", "w_down"):
        weight = getattr(layer, name)
        assert isinstance(weight, quant.Fp8Weight) and weight.values.dtype == jax.numpy.float8_e4m3fn, name
    linear = sum(w.values.nbytes + w.scale.nbytes for layer in arrays.layers for w in _linears(layer))
    plain = sum(w.values.size * 4 for layer in arrays.layers for w in _linears(layer))
    assert linear < 0.3 * plain  # a byte a weight (and a float32 scale per channel) against float32's four


def _linears(layer):
    return [getattr(layer, name) for name in type(layer).LINEARS]


def test_update_weights_quantizes_the_new_values_and_compiles_nothing(tiny_model, make_llm, record_compiles):
    model = tiny_model("llama")
    llm = make_llm(model, compile_config=BUCKETS, quantization="fp8")
    prompts = _prompts(seed=4)[:4]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    new = tiny_model("llama", seed=7)
    with record_compiles() as compiled:
        llm.update_weights(new.weights)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert compiled == []
    want = generate_dense(new.family, new.config, new.weights, prompts, NEW_TOKENS, quantization="fp8")
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert isinstance(llm.engine.runner.weights.arrays.layers[0].wqkv, quant.Fp8Weight)


def test_unknown_quantization_is_named(tiny_model, make_llm):
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('fp8',\), got 'int4'"):
        make_llm(tiny_model("llama"), compile_config=BUCKETS, quantization="int4")
    with pytest.raises(ValueError, match=r"kv cache dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        make_llm(tiny_model("llama"), compile_config=BUCKETS, kv_cache_dtype="int8")


def test_from_params_serves_in_fp8(tiny_model, char_tokenizer):
    """A trainer's parameters in memory, quantized on their way in (`from_params` takes the LLM keywords)."""
    from jaxserve import LLM

    model = tiny_model("llama")
    llm = LLM.from_params(
        model.weights,
        model.hf_config,
        char_tokenizer(),
        max_batch_size=4,
        max_seq_len=80,
        max_num_tokens=32,
        compile_config=BUCKETS,
        attention_backend="xla",
        quantization="fp8",
        show_progress=False,
    )
    assert isinstance(llm.engine.runner.weights.arrays.layers[0].w_down, quant.Fp8Weight)
    prompts = _prompts(seed=6)[:3]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS, quantization="fp8")
    assert [o.outputs[0].token_ids for o in outputs] == want
    llm.close()


def test_an_fp8_lm_head_serves_the_dense_references_tokens_and_updates_in_place(tiny_model, make_llm, record_compiles):
    """quantize_lm_head=True: the untied lm_head in FP8 (values [V, D], a scale per vocabulary entry), the logits'
    product the same FP8 one as the linears'; the engine gives the dense reference's tokens with the same option,
    and update_weights quantizes the new lm_head in place without compiling."""
    model = tiny_model("llama")
    assert not model.config.tie_word_embeddings
    llm = make_llm(model, compile_config=BUCKETS, quantization="fp8", quantize_lm_head=True)
    lm_head = llm.engine.runner.weights.arrays.lm_head
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert isinstance(lm_head, quant.Fp8Weight) and lm_head.values.shape == (vocab, hidden)
    assert lm_head.values.dtype == jax.numpy.float8_e4m3fn and lm_head.scale.shape == (vocab,)
    prompts = _prompts(seed=8)[:4]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    options = dict(quantization="fp8", quantize_lm_head=True)
    want = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS, **options)
    assert [o.outputs[0].token_ids for o in outputs] == want
    new = tiny_model("llama", seed=9)
    with record_compiles() as compiled:
        llm.update_weights(new.weights)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert compiled == []
    assert lm_head.values.is_deleted()  # replaced, not kept beside the new one
    want = generate_dense(new.family, new.config, new.weights, prompts, NEW_TOKENS, **options)
    assert [o.outputs[0].token_ids for o in outputs] == want
    llm.close()


def test_a_quantized_lm_head_needs_fp8_and_an_untied_head(tiny_model, make_llm):
    with pytest.raises(ValueError, match=r"quantize_lm_head=True needs quantization='fp8'"):
        make_llm(tiny_model("llama"), compile_config=BUCKETS, quantize_lm_head=True)
    with pytest.raises(ValueError, match="ties its lm_head to the embedding"):
        make_llm(tiny_model("gemma3"), compile_config=BUCKETS, quantization="fp8", quantize_lm_head=True)
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantize_lm_head must be a bool"):
        EngineConfig(max_batch_size=1, max_num_tokens=8, max_seq_len=8, quantization="fp8", quantize_lm_head=1)

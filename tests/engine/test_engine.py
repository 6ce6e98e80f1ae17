"""The paged engine against the dense reference, on tiny random models (Llama, Qwen3, Mistral for the
sliding window, Gemma 2 and 3 for mixed layers, Qwen3-MoE and Mixtral for mixtures of experts) and on
the default model.

Covers the issue's acceptance: token-identical greedy outputs under preemption (MAX_UTILIZATION on a
KV pool too small for the batch), chunked prefill and prefix-cache hits, and the same tokens under
GUARANTEED_NO_EVICT; prefix reuse visible in the statistics; host invariants over random workloads
(every request finishes, no block leaks, ref counts back to zero, step limits respected); and a warm
engine that compiles nothing however its batches vary.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.config import CapacityPolicy, CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

VOCAB = 160
MAX_BATCH_SIZE = 4
MAX_NUM_TOKENS = 32
BLOCK_SIZE = 16
NEW_TOKENS = 12
# 10 usable blocks: four running requests of up to 82 tokens need up to 24, so MAX_UTILIZATION preempts.
# (With sliding-window layers, 10 blocks in each layer group; Mistral's layers, all sliding with a window of
# 8, keep 3 or 4 blocks a request, so its pool is smaller for the same pressure.)
KV_TOKENS = 160
KV_TOKENS_BY_MODEL = {"mistral": 64, "gemma2": 96, "gemma3": 96, "mixtral": 64}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
POLICIES = {"max_utilization": CapacityPolicy.MAX_UTILIZATION, "no_evict": CapacityPolicy.GUARANTEED_NO_EVICT}


def mixed_prompts(seed: int, count: int = 16) -> list[list[int]]:
    """Prompts of 1..70 tokens; half start with one of two long shared prefixes (40 and 33 tokens)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, 40).tolist(), rng.integers(0, VOCAB, 33).tolist()]
    prompts = []
    for i in range(count):
        prefix = prefixes[i % 4] if i % 4 < 2 else []
        tail = rng.integers(0, VOCAB, int(rng.integers(1, 31))).tolist()
        prompts.append(prefix + tail)
    prompts[5] = rng.integers(0, VOCAB, 70).tolist()  # longer than two steps' token budget
    return prompts


# Each bucket costs about two seconds of warmup: the Llama engines get two decode and two mixed buckets,
# MAX_UTILIZATION also the penalty variants (the compile test runs every variant), Qwen3 one of each.
# The engine the compile test warms compiles ahead of time (lazy=False; CPU engines are lazy by default).
BUCKETS = {
    ("llama", "max_utilization"): CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), lazy=False),
    ("llama", "no_evict"): CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False),
    ("qwen3", "max_utilization"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    ("qwen3", "no_evict"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    ("mistral", "max_utilization"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    ("mistral_full_kv", "max_utilization"): CompileConfig(
        decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False
    ),
    ("gemma2_full_kv", "max_utilization"): CompileConfig(
        decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False
    ),
    ("gemma2", "max_utilization"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    ("gemma3", "max_utilization"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    **{
        (moe, "max_utilization"): CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False)
        for moe in ("qwen3_moe", "mixtral")
    },
}


@pytest.fixture(scope="module")
def engines(tiny_model, make_llm):
    """(model, LLM) per (model type, policy), built on first use."""
    built = {}

    def get(model_type: str, policy: str):
        key = model_type, policy
        if key not in built:
            # "<model>_full_kv": the same model with sliding_window_kv off (sliding layers keep every token).
            name = model_type.removesuffix("_full_kv")
            model = tiny_model(name)
            llm = make_llm(
                model,
                policy=POLICIES[policy],
                kv_tokens=KV_TOKENS if name != model_type else KV_TOKENS_BY_MODEL.get(name, KV_TOKENS),
                compile_config=BUCKETS[key],
                sliding_window_kv=name == model_type,
            )
            built[key] = model, llm
        return built[key]

    return get


def new_stats(llm, before: int):
    return llm.step_stats[before:]


@pytest.mark.parametrize(
    "model_type",
    [
        "llama",
        "qwen3",
        "mistral",
        "mistral_full_kv",
        "gemma2",
        "gemma2_full_kv",
        "gemma3",
        "qwen3_moe",
        "mixtral",
    ],
)
def test_greedy_matches_dense_with_preemption_chunking_and_prefix_hits(engines, model_type, assert_engine_idle):
    model, llm = engines(model_type, "max_utilization")
    prompts = mixed_prompts(seed=1)
    hits_before, steps_before = llm.engine.block_manager.stats.hit_tokens, len(llm.step_stats)

    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)

    reference = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS)
    for i, (output, expected) in enumerate(zip(outputs, reference, strict=True)):
        assert output.prompt_token_ids == prompts[i]
        assert output.outputs[0].token_ids == expected, f"prompt {i} ({len(prompts[i])} tokens)"
        assert output.outputs[0].finish_reason == "length"
    stats = new_stats(llm, steps_before)
    assert sum(s.num_preempted for s in stats) > 0, "the KV pool was meant to force preemption"
    assert llm.engine.block_manager.stats.hit_tokens > hits_before, "shared prefixes were meant to hit the cache"
    assert any(s.num_prefill_rows and s.num_tokens == MAX_NUM_TOKENS for s in stats), "no chunk filled a step"
    assert max(s.num_tokens for s in stats) <= MAX_NUM_TOKENS
    assert max(s.num_seqs for s in stats) <= MAX_BATCH_SIZE
    assert_engine_idle(llm)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_guaranteed_no_evict_gives_the_same_tokens_without_preemption(engines, model_type, assert_engine_idle):
    model, llm = engines(model_type, "no_evict")
    prompts = mixed_prompts(seed=1)
    steps_before = len(llm.step_stats)

    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)

    reference = generate_dense(model.family, model.config, model.weights, prompts, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(s.num_preempted for s in new_stats(llm, steps_before)) == 0
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    "prompt_len, computed",
    [(4 * BLOCK_SIZE + 5, 5), (4 * BLOCK_SIZE, BLOCK_SIZE)],
    ids=["partial-last-block", "full-last-block"],
)
def test_second_identical_prompt_computes_only_its_last_block(engines, prompt_len, computed, assert_engine_idle):
    """The last block is never reused (its last token's logits are needed), every earlier one is."""
    _, llm = engines("llama", "max_utilization")
    prompt = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.engine.block_manager.stats
    queried, hits, steps = stats.queried_tokens, stats.hit_tokens, len(llm.step_stats)

    second = llm.generate([prompt], params, use_tqdm=False)[0]

    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert stats.queried_tokens - queried == prompt_len
    assert stats.hit_tokens - hits == prompt_len - computed
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, prompt_len - computed)
    prefill = new_stats(llm, steps)[0]
    assert (prefill.num_tokens, prefill.num_prefill_rows, prefill.num_seqs) == (computed, 1, 1)
    assert_engine_idle(llm)


def test_seeded_samples_and_logprobs_survive_batching_and_preemption(engines):
    """A seeded request samples the same tokens alone and in a batch that preempts and recomputes it."""
    _, llm = engines("llama", "max_utilization")
    prompts = mixed_prompts(seed=2, count=8)
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NEW_TOKENS, logprobs=2) for i in range(8)]
    steps = len(llm.step_stats)

    together = llm.generate(prompts, params, use_tqdm=False)

    assert sum(s.num_preempted for s in new_stats(llm, steps)) > 0
    for prompt, sp, batched in zip(prompts, params, together, strict=True):
        alone = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert batched.outputs[0].token_ids == alone.token_ids
        assert len(batched.outputs[0].logprobs) == len(alone.logprobs) == NEW_TOKENS
        for position, (ours, theirs) in enumerate(zip(batched.outputs[0].logprobs, alone.logprobs, strict=True)):
            assert ours.keys() == theirs.keys(), f"position {position}"
            for token, logprob in ours.items():
                assert logprob.logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_penalties_need_their_compiled_variants(engines, assert_engine_idle):
    _, llm = engines("llama", "no_evict")
    with pytest.raises(ValueError, match="penalty_variants=True"):
        llm.generate([[1, 2, 3], [4, 5]], [GREEDY, SamplingParams(repetition_penalty=1.2)], use_tqdm=False)
    assert_engine_idle(llm)


# ---- host invariants over random workloads ----------------------------------------------------


@st.composite
def workloads(draw) -> tuple[list[list[int]], list[SamplingParams]]:
    """1..10 requests: lengths 1..60 (some sharing a prefix), 1..12 new tokens, n 1..2, greedy or sampled."""
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=40))
    prompts, params = [], []
    for _ in range(draw(st.integers(1, 10))):
        own = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        prompts.append((shared if draw(st.booleans()) else []) + own)
        params.append(
            SamplingParams(
                n=draw(st.integers(1, 2)),
                temperature=draw(st.sampled_from([0.0, 0.9])),
                seed=draw(st.none() | st.integers(0, 2**31)),
                max_tokens=draw(st.integers(1, NEW_TOKENS)),
                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
            )
        )
    return prompts, params


@pytest.mark.parametrize("policy", list(POLICIES))
@settings(max_examples=12, deadline=None)
@given(workload=workloads())
def test_random_workloads_finish_without_leaks_within_step_limits(engines, policy, workload, assert_engine_idle):
    prompts, params = workload
    _, llm = engines("llama", policy)
    steps = len(llm.step_stats)

    outputs = llm.generate(prompts, params, use_tqdm=False)

    for output, sp in zip(outputs, params, strict=True):
        assert output.finished and output.error is None
        assert [c.index for c in output.outputs] == list(range(sp.n))
        if sp.temperature == 0.0:  # greedy samples of one prompt, forked or recomputed, agree
            assert len({tuple(c.token_ids) for c in output.outputs}) == 1
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length")
            assert 1 <= len(completion.token_ids) <= sp.max_tokens
            if completion.finish_reason == "length":
                assert len(completion.token_ids) == sp.max_tokens
            else:
                assert completion.token_ids[-1] == completion.stop_reason in sp.stop_token_ids
    for stat in new_stats(llm, steps):
        assert 0.0 < stat.kv_usage <= 1.0 and 0.0 <= stat.prefix_hit_rate <= 1.0
        assert 1 <= stat.num_seqs <= min(stat.bucket_seqs, MAX_BATCH_SIZE)
        assert stat.num_seqs <= stat.num_tokens <= min(stat.bucket_tokens, MAX_NUM_TOKENS)
    assert_engine_idle(llm)


# ---- nothing compiles after warmup -----------------------------------------------------------


def varied_params(rng: np.random.Generator) -> SamplingParams:
    """Every sampling feature the compiled step handles, penalties and logprobs included."""
    kind = int(rng.integers(0, 7))
    options = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_k": 5, "seed": int(rng.integers(0, 1000))},
        {"temperature": 1.2, "top_p": 0.7, "min_p": 0.05},
        {"temperature": 0.0, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4},
        {"temperature": 0.7, "logprobs": 3, "n": 2},
        {"temperature": 0.0, "min_tokens": 3, "stop_token_ids": [7, 9]},
        {"temperature": 0.0, "stop": [chr(2 * VOCAB + 5)], "logprobs": 0},
    ]
    return SamplingParams(max_tokens=int(rng.integers(3, 20)), **options[kind])


def test_warm_engine_compiles_nothing_over_100_varied_steps(engines, record_compiles):
    _, llm = engines("llama", "max_utilization")
    assert llm.config.compile.penalty_variants
    engine = llm.engine
    steps_before = len(llm.step_stats)
    rng = np.random.default_rng(0)

    # The listener is live: a function never seen before is reported.
    with record_compiles() as compiled:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7))
    assert compiled, "the compile listener heard nothing from a fresh jit"

    with record_compiles() as compiled:
        for _ in range(100):
            while engine.scheduler.num_waiting + engine.scheduler.num_running < 6:
                prompt = rng.integers(0, VOCAB, int(rng.integers(1, 60))).tolist()
                engine.add_request(prompt, varied_params(rng))
            engine.step()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # drains the rest
    assert compiled == [], f"compiled after warmup: {compiled}"
    stats = new_stats(llm, steps_before)
    used = {(s.bucket_tokens, s.bucket_seqs) for s in stats}
    warmed = {(b.num_tokens, b.num_seqs) for b in engine.buckets.buckets}
    assert used == warmed, f"the workload used buckets {used}, not every warmed one {warmed}"
    assert len(stats) > 100 and sum(s.num_preempted for s in stats) > 0


# ---- the default model -----------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_greedy_matches_dense_with_preemption(smollm2, make_llm, assert_engine_idle):
    model, tokenizer = smollm2
    questions = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?", "What is 2+2?"]
    system = {"role": "system", "content": "You are a geography teacher. Answer in one short sentence."}
    conversations = [[system, {"role": "user", "content": q}] for q in questions]
    conversations += [[{"role": "user", "content": q}] for q in questions]  # the template's default system prompt
    llm = make_llm(model, tokenizer, kv_tokens=KV_TOKENS)

    outputs = llm.chat(conversations, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)

    prompts = [o.prompt_token_ids for o in outputs]
    reference = generate_dense(model.family, model.config, model.weights, prompts, 16)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(s.num_preempted for s in llm.step_stats) > 0
    assert llm.engine.block_manager.stats.hit_tokens > 0
    assert "Paris" in outputs[0].outputs[0].text
    assert_engine_idle(llm)


def test_decode_buckets_tell_the_attention_the_batch_is_decode_only(monkeypatch, tmp_path, tiny_model, make_llm):
    """Compiled decode buckets pass max_q_len=1 (the Pallas kernel then skips its mixed launch); token
    buckets, which also carry prefill chunks, pass None. The xla reference ignores the hint, so the
    calls are recorded at trace time, and the steps are only lowered, not compiled (the engine is never run; the
    step store cannot keep a lowered step): an empty step store (cache_dir) makes sure every step is traced rather
    than loaded from an earlier test's or an earlier run's store, and jax's caches are cleared before and after,
    so that no decoder layer an earlier test traced (`jaxserve.models.llama.decoder_layer` is one jit) stands in
    for this test's and none traced with the recording reaches a later test. (Without a step store the engine
    turns on jax's persistent cache for the whole process, and a later test's step store then stores nothing.)"""
    from jaxserve import kernels, step_table

    seen = []
    reference = kernels.ragged_paged_attention_reference

    def recording(*args, **kwargs):
        seen.append((args[0].shape[0], kwargs.get("max_q_len")))
        return reference(*args, **kwargs)

    monkeypatch.setattr(kernels, "ragged_paged_attention_reference", recording)
    monkeypatch.setattr(step_table, "_lower_and_compile", lambda jitted, args, *_: jitted.lower(*args))
    config = CompileConfig(
        decode_batch_sizes=(2, 4), token_buckets=(4, 16), penalty_variants=False, lazy=False, cache_dir=str(tmp_path)
    )
    jax.clear_caches()
    try:
        make_llm(tiny_model("llama"), compile_config=config, max_num_tokens=16)
    finally:
        jax.clear_caches()
    # Each compiled forward traces the attention once per layer. (4, 4) is both a decode bucket and a
    # token bucket: compiled once as each.
    assert sorted(set(seen), key=str) == sorted({(2, 1), (4, 1), (4, None), (16, None)}, key=str)


def test_no_compiled_forward_copies_the_kv_pool(tiny_model, make_llm):
    """The pool is donated to every forward and updated in place: no compiled forward copies a buffer of
    the pool's size, the one-row buckets included (XLA:CPU once copied the K and V caches twice each
    per batch-1 decode step: seconds per token with a pool of a few GiB)."""
    config = CompileConfig(decode_batch_sizes=(1, 2), token_buckets=(1, 16), penalty_variants=False, lazy=False)
    llm = make_llm(tiny_model("llama"), compile_config=config, max_num_tokens=16)
    runner = llm.engine.runner
    pool = runner.kv_cache.k
    flat_rows = pool.shape[0] * pool.shape[1] * pool.shape[2]  # the [L*N*Bs, K, Dh] view the write indexes
    shapes = {",".join(map(str, pool.shape)), ",".join(map(str, (flat_rows, *pool.shape[3:])))}
    copy = re.compile(r"= \w+\[([0-9,]+)\]\S* copy\(")
    assert len(runner.table.forwards) >= 4
    for (bucket, _), forward in runner.table.forwards.items():
        copied = [m.group(1) for m in map(copy.search, forward.as_text().splitlines()) if m]
        assert not shapes & set(copied), f"T={bucket.num_tokens} B={bucket.num_seqs} copies the pool: {copied}"


# ---- the compiled table -------------------------------------------------------------------------

EVERY_VARIANT = CompileConfig(
    decode_batch_sizes=(4,), token_buckets=(16,), penalty_variants=True, prompt_logprobs=True, lazy=False
)


def test_every_step_runs_a_step_compiled_at_start_from_one_enumeration(
    tiny_model, make_llm, assert_engine_idle, record_runs
):
    """Warmup compiles exactly StepConfig.forwards() and samplers(); every step the engine runs, whatever
    its requests ask for, is one of the steps they serve (Runner.run refuses anything else, naming it)."""
    from jaxserve.buckets import Bucket
    from jaxserve.runner import Runner
    from jaxserve.step_inputs import padding_inputs
    from jaxserve.variants import SamplerMode, StepVariant

    llm = make_llm(tiny_model("llama"), kv_tokens=256, compile_config=EVERY_VARIANT)
    runner, steps = llm.engine.runner, llm.engine.steps
    assert runner.table.compiled_steps == steps.compiled_steps()
    assert (
        runner.table.num_executables == len(steps.forwards()) + len(steps.samplers()) == 5 + 1 * 3 * 2 - 1
    )  # (decode 4, tokens 16, 32, 16 and 32 scoring); 4 rows x 3 modes x 2, but greedy without penalties
    original = Runner.run
    ran = record_runs()
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(2, 30))).tolist() for _ in range(8)]
    kinds = [
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(max_tokens=6, temperature=0.9, seed=1, top_p=0.8),
        SamplingParams(max_tokens=6, temperature=0.9, seed=2, top_k=20, top_p=0.8),
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1),
    ]
    for chosen in ([kinds[0]] * 8, kinds[:2] * 4, kinds[1:3] * 4, [kinds[3]] * 8, kinds[4:] * 4, [*kinds, *kinds[:2]]):
        outputs = llm.generate(prompts, chosen, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    # Every logprob entry carries its token's text (vLLM's decoded_token), sampled and prompt positions.
    text = {t: llm.tokenizer.decode([t], skip_special_tokens=False) for t in range(VOCAB)}
    for entries in (outputs[3].outputs[0].logprobs, outputs[5].prompt_logprobs[1:]):
        assert entries and all(lp.decoded_token == text[t] for entry in entries for t, lp in entry.items())
    assert set(ran) <= set(steps.compiled_steps())
    # The workload was meant to use every sampler mode, with and without penalties and prompt logprobs.
    assert {v.sampler for _, v in ran} == set(SamplerMode)
    assert {v.penalties for _, v in ran} == {v.prompt_logprobs for _, v in ran} == {False, True}
    assert_engine_idle(llm)
    decode, scoring = Bucket(4, 4, decode_only=True), StepVariant(prompt_logprobs=True)  # never compiled together
    inputs = padding_inputs(decode, scoring, steps)
    with pytest.raises(RuntimeError, match=r"no compiled step for T=4 B=4 decode_only=True variant=candidates\+prompt"):
        original(runner, inputs, decode, scoring)


def test_the_engine_dtype_casts_weights_given_in_another(tiny_model, char_tokenizer):
    """EngineConfig.dtype: parameters passed in float32 are served in bfloat16, KV cache included; "auto" keeps
    the weights' dtype."""
    from jaxserve.llm import LLM

    model = tiny_model("llama")
    small = dict(max_batch_size=2, max_num_tokens=16, max_seq_len=64, attention_backend="xla", show_progress=False)
    buckets = CompileConfig(decode_batch_sizes=(2,), token_buckets=(16,), penalty_variants=False)
    cast = LLM(model, tokenizer=char_tokenizer(), dtype="bfloat16", compile_config=buckets, **small)
    kept = LLM(model, tokenizer=char_tokenizer(), dtype="auto", compile_config=buckets, **small)

    for llm, dtype in ((cast, jax.numpy.bfloat16), (kept, jax.numpy.float32)):
        runner = llm.engine.runner
        assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(runner.weights.arrays)} == {np.dtype(dtype)}
        assert runner.kv_cache.k.dtype == dtype and runner.kv_cache.v.dtype == dtype
        [out] = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4

"""Lazy compilation (CompileConfig.lazy, the default on CPU) and attention widths that follow the batch
(CompileConfig.kv_len_buckets): a lazy engine compiles nothing at start and each step of its table the
first time one needs it (logged), penalty samplers only when a request asks; the step store keeps and
loads lazily compiled steps; eager engines still compile the whole table at start; steps run at the
narrowest width that holds their longest sequence and give the dense reference's greedy tokens."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jaxserve.buckets import Bucket
from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.sampling import SamplingParams
from jaxserve.step_inputs import padding_inputs
from jaxserve.step_table import resolve_lazy
from jaxserve.variants import SamplerMode, StepVariant

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

VOCAB = 160
NEW_TOKENS = 12
# max_seq_len 128 = 8 blocks of 16: widths of 1, 2 and 3 blocks below the full table.
NARROW = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), kv_len_buckets=(16, 32, 48))


def prompts(seed: int, count: int = 10) -> list[list[int]]:
    """Prompts of 1..70 tokens: a decode at 82 tokens needs the full table, short ones the narrowest."""
    rng = np.random.default_rng(seed)
    lengths = [1, 3, 9, 14, 20, 30, 41, 55, 64, 70][:count]
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


def test_lazy_is_on_by_default_on_cpu_only_and_validated(monkeypatch):
    assert resolve_lazy(None) is True  # these tests run on CPU
    assert resolve_lazy(False) is False and resolve_lazy(True) is True
    # A multi-process run compiles every step at start (a step compiled while another ran deadlocked the
    # processes: tests/distributed/test_multiprocess.py with an empty step store).
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert resolve_lazy(None) is False and resolve_lazy(False) is False
    with pytest.raises(ValueError, match="lazy=True in a multi-process run"):
        resolve_lazy(True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="lazy must be None or a bool, got 'yes'"):
        CompileConfig(lazy="yes")
    with pytest.raises(ValueError, match="kv_len_buckets entries must be >= 1, got 0"):
        CompileConfig(kv_len_buckets=(0, 16))
    assert CompileConfig(kv_len_buckets=[64, 16, 64]).kv_len_buckets == (16, 64)


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_a_lazy_engine_compiles_steps_on_first_use_and_narrow_steps_match_dense(
    model_type, caplog, tiny_model, make_llm, assert_engine_idle, record_runs
):
    model = tiny_model(model_type)  # mistral: a sliding window of 8 below every width
    # A pool small enough to preempt: every layer keeps every token's KV (mistral's window would let 160 tokens
    # hold every sequence at once).
    llm = make_llm(model, kv_tokens=160, compile_config=NARROW, sliding_window_kv=False)
    runner, steps = llm.engine.runner, llm.engine.steps
    assert steps.buckets.kv_block_buckets == (1, 2, 3)
    assert runner.table.lazy and runner.table.num_executables == 0
    ran = record_runs()
    batch = prompts(seed=1)

    with caplog.at_level(logging.INFO, logger="jaxserve.runner"):
        outputs = llm.generate(batch, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0), use_tqdm=False)

    reference = generate_dense(model.family, model.config, model.weights, batch, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert sum(s.num_preempted for s in llm.step_stats) > 0, "the KV pool was meant to force preemption"
    widths = {bucket.kv_blocks for bucket, _ in ran}
    assert widths == {1, 2, 3, None}, f"the workload was meant to run at every width, ran {widths}"
    assert set(ran) <= set(steps.compiled_steps())
    compiled = set(runner.table.compiled_steps)
    assert {(b, v) for b, v in ran} <= compiled and len(compiled) < len(steps.compiled_steps())
    first_uses = caplog.text.count("compiled on first use: forward")
    assert first_uses == len(runner.table.forwards) == len({(b, v.prompt_logprobs) for b, v in ran})
    assert not any(penalties for _, _, penalties in runner.table.samplers), "no request asked for a penalty"

    llm.generate([batch[2]], SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3), use_tqdm=False)
    assert any(penalties for _, _, penalties in runner.table.samplers)
    assert_engine_idle(llm)


def test_a_lazy_engine_refuses_a_step_outside_its_table(tiny_model, make_llm):
    llm = make_llm(tiny_model("llama"), compile_config=NARROW)
    runner, steps = llm.engine.runner, llm.engine.steps
    outside = Bucket(8, 4)  # no token bucket of 8
    inputs = padding_inputs(outside, StepVariant(), steps)
    with pytest.raises(RuntimeError, match=r"no compiled step for T=8 B=4 .* steps are in the step table"):
        runner.run(inputs, outside, StepVariant())
    scoring = StepVariant(SamplerMode.GREEDY, prompt_logprobs=True)  # not compiled: prompt_logprobs=False
    with pytest.raises(RuntimeError, match="no compiled step"):
        runner.run(padding_inputs(Bucket(16, 4), scoring, steps), Bucket(16, 4), scoring)
    assert runner.table.num_executables == 0


def test_an_eager_engine_compiles_every_width_of_its_table_at_start(tiny_model, make_llm):
    config = CompileConfig(
        decode_batch_sizes=(4,), token_buckets=(16,), kv_len_buckets=(32,), penalty_variants=False, lazy=False
    )
    llm = make_llm(tiny_model("llama"), compile_config=config, max_num_tokens=16)
    runner, steps = llm.engine.runner, llm.engine.steps
    assert not runner.table.lazy and len(steps.forwards()) == 4  # (decode 4, tokens 16) x (2 blocks, the full 8)
    assert runner.table.num_executables == len(steps.forwards()) + len(steps.samplers())
    assert runner.table.compiled_steps == steps.compiled_steps()


def test_lazily_compiled_steps_are_stored_and_loaded_by_the_next_engine(tmp_path, tiny_model, make_llm):
    model = tiny_model("llama")
    config = CompileConfig(
        decode_batch_sizes=(2, 4), token_buckets=(16, 32), kv_len_buckets=(32,), cache_dir=str(tmp_path)
    )
    batch = prompts(seed=2, count=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokens, counts = [], []
    for _ in range(2):
        llm = make_llm(model, compile_config=config)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)])
        store = llm.engine.runner.store
        counts.append((store.hits, store.misses, llm.engine.runner.table.num_executables))
        llm.close()
    (hits0, misses0, compiled0), (hits1, misses1, compiled1) = counts
    assert tokens[0] == tokens[1]
    assert (hits0, misses0) == (0, compiled0) and compiled0 > 0
    assert (hits1, misses1) == (compiled1, 0) and compiled1 == compiled0

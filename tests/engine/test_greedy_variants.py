"""Greedy step variants (`CompileConfig(greedy_variants=True)`): a step whose rows are all greedy, with no
penalties and no logprobs, runs a step compiled without conditionals (on a GPU a conditional with real
work makes the step's call wait for the device). Its tokens are the general step's."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.inputs import StepVariant
from jaxserve.runner import Runner
from jaxserve.sampling import SamplingParams

VOCAB = 160
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
BUCKETS = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False, greedy_variants=True)


@pytest.fixture(scope="module")
def model_and_llm(tiny_model, make_llm):
    model = tiny_model("llama")
    return model, make_llm(model, kv_tokens=160, compile_config=BUCKETS)


@pytest.fixture
def greedy_calls(monkeypatch) -> list[bool]:
    """Whether each Runner.run call ran a greedy variant."""
    calls: list[bool] = []
    original = Runner.run

    def run(self, inputs, bucket, variant):
        calls.append(variant.greedy)
        return original(self, inputs, bucket, variant)

    monkeypatch.setattr(Runner, "run", run)
    return calls


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(1, 50))).tolist() for _ in range(count)]


def test_all_greedy_steps_take_the_greedy_variant_and_match_dense(model_and_llm, greedy_calls, assert_engine_idle):
    model, llm = model_and_llm
    batch = prompts(seed=3, count=10)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, batch, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert greedy_calls and all(greedy_calls), greedy_calls
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    "other",
    [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=5), SamplingParams(max_tokens=NEW_TOKENS, logprobs=2)],
    ids=["sampling", "logprobs"],
)
def test_a_sampling_or_logprobs_row_takes_the_general_step(model_and_llm, greedy_calls, other, assert_engine_idle):
    model, llm = model_and_llm
    batch = prompts(seed=4, count=4)
    outputs = llm.generate(batch, [GREEDY, GREEDY, GREEDY, other], use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, batch[:3], NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == reference
    assert len(outputs[3].outputs[0].token_ids) == NEW_TOKENS
    assert not all(greedy_calls), "steps with the non-greedy row must take the general variant"
    if other.logprobs is not None:
        assert len(outputs[3].outputs[0].logprobs) == NEW_TOKENS
    assert_engine_idle(llm)


def test_the_greedy_variant_has_no_conditional(model_and_llm):
    """The mechanism: the general step branches on the device (conditionals); the greedy step does not."""
    _, llm = model_and_llm
    runner = llm.engine.runner
    for bucket in runner.spec.steps.buckets.buckets:
        general = runner._compiled[bucket, StepVariant()].as_text()
        greedy = runner._compiled[bucket, StepVariant(greedy=True)].as_text()
        assert " conditional(" in general, "the general step was expected to branch on the device"
        assert " conditional(" not in greedy

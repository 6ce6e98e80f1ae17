"""Sampler modes chosen on the host (`StepConfig.sampler_mode`): all-greedy steps run the GREEDY sampler,
sampling steps whose filters fit NUM_CANDIDATES logits the CANDIDATES one, the rest the SORTED one. No
compiled forward or sampler has a device-side conditional (on a GPU a conditional makes the call wait for
the device), and greedy rows get the dense reference's tokens whichever mode their step runs."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.sampling import SamplingParams
from jaxserve.variants import NUM_CANDIDATES, SamplerMode

VOCAB = 160
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
# lazy=False: the whole table compiled at start, so every executable of it is inspected.
BUCKETS = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=True, lazy=False)


@pytest.fixture(scope="module")
def model_and_llm(tiny_model, make_llm):
    model = tiny_model("llama")
    return model, make_llm(model, kv_tokens=160, compile_config=BUCKETS)


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(1, 50))).tolist() for _ in range(count)]


def test_all_greedy_steps_take_the_greedy_sampler_and_match_dense(model_and_llm, modes, assert_engine_idle):
    model, llm = model_and_llm
    batch = prompts(seed=3, count=10)
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, batch, NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert modes and set(modes) == {SamplerMode.GREEDY}, modes
    assert_engine_idle(llm)


@pytest.mark.parametrize(
    ("other", "mode"),
    [
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=5), SamplerMode.CANDIDATES),
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=50, top_p=0.9, seed=5), SamplerMode.CANDIDATES),
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, min_p=0.1, seed=5), SamplerMode.CANDIDATES),
        (SamplingParams(max_tokens=NEW_TOKENS, logprobs=2), SamplerMode.CANDIDATES),
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, seed=5), SamplerMode.SORTED),
        (SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=NUM_CANDIDATES + 1), SamplerMode.SORTED),
    ],
    ids=["temperature", "top_k_top_p", "min_p", "logprobs", "top_p_alone", "large_top_k"],
)
def test_a_sampling_or_logprobs_row_picks_the_cheapest_exact_mode(
    model_and_llm, modes, other, mode, assert_engine_idle
):
    model, llm = model_and_llm
    batch = prompts(seed=4, count=4)
    outputs = llm.generate(batch, [GREEDY, GREEDY, GREEDY, other], use_tqdm=False)
    reference = generate_dense(model.family, model.config, model.weights, batch[:3], NEW_TOKENS)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == reference
    assert len(outputs[3].outputs[0].token_ids) == NEW_TOKENS
    assert mode in modes and set(modes) <= {mode, SamplerMode.GREEDY}, modes
    if other.logprobs is not None:
        assert len(outputs[3].outputs[0].logprobs) == NEW_TOKENS
    assert_engine_idle(llm)


def test_a_top_k_at_or_above_the_vocabulary_is_no_top_k(model_and_llm):
    steps = model_and_llm[1].engine.steps
    assert steps.sampler_mode([SamplingParams(temperature=1.0, top_k=VOCAB)]) is SamplerMode.CANDIDATES
    assert steps.sampler_mode([SamplingParams(temperature=1.0, top_k=VOCAB, top_p=0.5)]) is SamplerMode.SORTED
    assert steps.sampler_mode([SamplingParams(temperature=1.0, top_k=NUM_CANDIDATES)]) is SamplerMode.CANDIDATES
    assert steps.sampler_mode([GREEDY, SamplingParams(top_k=1, top_p=0.3)]) is SamplerMode.GREEDY


def test_no_executable_branches_on_the_device(model_and_llm):
    """The mechanism: no compiled forward or sampler holds a conditional, so no call waits for the device."""
    runner = model_and_llm[1].engine.runner
    executables = [*runner.table.forwards.values(), *runner.table.samplers.values()]
    assert len(executables) == len(runner.spec.steps.forwards()) + len(runner.spec.steps.samplers())
    for compiled in executables:
        assert " conditional(" not in compiled.as_text()

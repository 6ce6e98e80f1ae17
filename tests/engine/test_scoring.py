"""Scoring from a position (`SamplingParams.prompt_logprobs_start`): the continuation after a context is
scored as full prompt scoring scores it, the context's full blocks come from the prefix cache, and a
multiple-choice question's shared context is computed once."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.sampling import SamplingParams

BLOCK_SIZE = 16  # KvCacheConfig's default


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def scoring_llm(model, make_llm):
    """Prompt-logprobs variants compiled; 16 tokens per step, so contexts are prefilled in chunks."""
    buckets = CompileConfig(decode_batch_sizes=(4,), token_buckets=(16,), penalty_variants=False, prompt_logprobs=True)
    return make_llm(model, compile_config=buckets, max_num_tokens=16)


def random_tokens(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 64, length).tolist()


def test_a_four_choice_question_computes_its_context_once_and_scores_as_full_scoring(scoring_llm, assert_engine_idle):
    context = random_tokens(1, 2 * BLOCK_SIZE + 7)  # two full blocks the choices can share
    choices = [random_tokens(10 + i, n) for i, n in enumerate((3, 1, 6, 12))]
    prompts = [context + choice for choice in choices]
    top = 2
    from_context = SamplingParams(max_tokens=1, prompt_logprobs=top, prompt_logprobs_start=len(context))
    stats = scoring_llm.engine.block_manager.stats
    queried, hits = stats.queried_tokens, stats.hit_tokens

    outputs = scoring_llm.generate(prompts, from_context, use_tqdm=False)

    assert stats.queried_tokens - queried == sum(len(p) for p in prompts)
    assert stats.hit_tokens - hits == 3 * 2 * BLOCK_SIZE  # the context's full blocks: computed by one choice
    full = scoring_llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=top), use_tqdm=False)
    for scored, reference in zip(outputs, full, strict=True):
        entries, expected = scored.prompt_logprobs, reference.prompt_logprobs
        assert entries is not None and expected is not None and len(entries) == len(expected)
        assert entries[: len(context)] == [None] * len(context)
        for position in range(len(context), len(entries)):
            assert entries[position].keys() == expected[position].keys(), f"position {position}"
            for token_id, logprob in entries[position].items():
                np.testing.assert_allclose(logprob.logprob, expected[position][token_id].logprob, atol=1e-5)
                assert logprob.rank == expected[position][token_id].rank
    assert_engine_idle(scoring_llm)


def test_scoring_from_inside_the_first_block_and_after_the_whole_context(scoring_llm, assert_engine_idle):
    """Starts that leave no full block to reuse (1, within block 0) and the prompt's last position."""
    prompt = random_tokens(2, 40)
    full = scoring_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for start in (1, 5, BLOCK_SIZE, BLOCK_SIZE + 1, len(prompt) - 1):
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=start)
        [output] = scoring_llm.generate([prompt], params, use_tqdm=False)
        entries = output.prompt_logprobs
        assert entries is not None and entries[:start] == [None] * start
        for position in range(start, len(prompt)):
            [(token_id, logprob)] = entries[position].items()
            assert token_id == prompt[position]
            np.testing.assert_allclose(logprob.logprob, full.prompt_logprobs[position][token_id].logprob, atol=1e-5)
    assert_engine_idle(scoring_llm)


def test_bad_starts_are_value_errors(scoring_llm, make_llm, model):
    with pytest.raises(ValueError, match="prompt_logprobs_start=3 needs prompt_logprobs"):
        SamplingParams(prompt_logprobs_start=3)
    with pytest.raises(ValueError, match="prompt_logprobs_start must be an int in"):
        SamplingParams(prompt_logprobs=1, prompt_logprobs_start=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_start=4 scores no position of a prompt of 4 tokens"):
        scoring_llm.generate([[1, 2, 3, 4]], SamplingParams(prompt_logprobs=1, prompt_logprobs_start=4), use_tqdm=False)
    plain = make_llm(model, compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(16,)))
    with pytest.raises(ValueError, match=r"prompt_logprobs needs CompileConfig\(prompt_logprobs=True\)"):
        plain.generate([[1, 2, 3, 4]], SamplingParams(prompt_logprobs=1, prompt_logprobs_start=2), use_tqdm=False)

"""SamplingParams(token_logprobs=True): the logprob of every sampled token as one float32 array per
completion, in every sampler mode (greedy included), raw by default and processed with
`logprobs_mode="processed_logprobs"`, read back from the device only in steps where a row asks.

The expected values come from a dense forward over prompt + output (the reference path) and numpy.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.sampling import SamplingParams
from jaxserve.variants import SamplerMode

VOCAB = 160
NEW_TOKENS = 8
BUCKETS = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=True)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def processed_log_softmax(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """log_softmax of what each position [L, V] samples from, in float64: a greedy row's logits; else
    logits / T with -inf outside the top-k and the top-p nucleus (no penalties, no min-p here)."""
    if params.is_greedy:
        return log_softmax64(logits)
    scaled = np.asarray(logits, np.float64) / params.temperature
    keep = np.ones_like(scaled, dtype=bool)
    if params.top_k is not None:
        keep &= scaled >= -np.sort(-scaled, axis=-1)[:, params.top_k - 1 : params.top_k]
    if params.top_p < 1.0:
        probs = np.exp(log_softmax64(np.where(keep, scaled, -np.inf)))
        order = np.argsort(-probs, axis=-1)
        ordered = np.take_along_axis(probs, order, axis=-1)
        nucleus = np.zeros_like(keep)
        np.put_along_axis(nucleus, order, np.cumsum(ordered, axis=-1) - ordered < params.top_p, axis=-1)
        keep &= nucleus
    return log_softmax64(np.where(keep, scaled, -np.inf))


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(3, 40))).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model, make_llm):
    return make_llm(model, compile_config=BUCKETS)


@pytest.fixture(scope="module")
def processed_llm(model, make_llm):
    return make_llm(model, compile_config=BUCKETS, logprobs_mode="processed_logprobs")


def check_against_reference(model, dense_logits, prompt, completion, expected_of) -> None:
    tokens = completion.token_ids
    array = completion.token_logprobs
    assert isinstance(array, np.ndarray) and array.dtype == np.float32 and array.shape == (len(tokens),)
    reference = expected_of(dense_logits(model, prompt + tokens))
    expected = [reference[len(prompt) + i - 1, token] for i, token in enumerate(tokens)]
    np.testing.assert_allclose(array, expected, atol=1e-4, rtol=0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, token_logprobs=True)


@pytest.mark.parametrize(
    ("params", "mode"),
    [
        (GREEDY, SamplerMode.GREEDY),
        (SamplingParams(top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True, token_logprobs=True), SamplerMode.GREEDY),
        (SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, repetition_penalty=1.5, token_logprobs=True), None),
        (SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=NEW_TOKENS, token_logprobs=True), None),
        (SamplingParams(temperature=0.9, top_k=7, seed=4, max_tokens=NEW_TOKENS, token_logprobs=True), None),
        (SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=NEW_TOKENS, token_logprobs=True), None),
    ],
    ids=["greedy", "top_k_1", "greedy_penalised", "temperature_n2", "top_k", "top_p_sorted"],
)
def test_raw_token_logprobs_are_the_reference_log_softmax_in_every_mode(
    llm, model, dense_logits, modes, params, mode, assert_engine_idle
):
    """Raw (the default, vLLM's): the model's distribution, before penalties, temperature and filters."""
    batch = prompts(seed=11, count=3)
    outputs = llm.generate(batch, params, use_tqdm=False)
    for prompt, output in zip(batch, outputs, strict=True):
        assert len(output.outputs) == params.n
        for completion in output.outputs:
            assert len(completion.token_ids) == NEW_TOKENS
            assert completion.logprobs is None, "token_logprobs alone builds no dicts"
            check_against_reference(model, dense_logits, prompt, completion, log_softmax64)
    expected_mode = mode or llm.engine.steps.sampler_mode([params])
    assert set(modes) == {expected_mode}, modes
    assert_engine_idle(llm)


def test_every_mode_ran_in_the_parametrized_test(llm):
    """The parametrisation above covers the three sampler modes (with and without penalties)."""
    steps = llm.engine.steps
    chosen = {
        steps.sampler_mode([SamplingParams(temperature=0.8)]),
        steps.sampler_mode([SamplingParams(temperature=0.9, top_p=0.8)]),
        steps.sampler_mode([SamplingParams(temperature=0.0, token_logprobs=True)]),
    }
    assert chosen == set(SamplerMode)


def test_greedy_rows_that_want_their_own_logprob_keep_the_greedy_sampler(llm, model, dense_logits, modes):
    """logprobs=0 and token_logprobs need no top-N, so an all-greedy batch stays on the argmax sampler;
    the dict and the array agree."""
    batch = prompts(seed=12, count=4)
    both = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, token_logprobs=True)
    outputs = llm.generate(batch, [GREEDY, both, GREEDY, SamplingParams(temperature=0.0)], use_tqdm=False)
    assert set(modes) == {SamplerMode.GREEDY}, modes
    check_against_reference(model, dense_logits, batch[0], outputs[0].outputs[0], log_softmax64)
    completion = outputs[1].outputs[0]
    entries = [entry[token] for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)]
    np.testing.assert_array_equal(completion.token_logprobs, np.float32([e.logprob for e in entries]))
    assert all(e.rank == 1 for e in entries), "a greedy token is the most likely one"
    assert outputs[3].outputs[0].token_logprobs is None


def test_processed_token_logprobs_follow_temperature_and_filters(processed_llm, model, dense_logits, modes):
    """processed_logprobs: over what the token is drawn from (a greedy row: the model's logits); the
    dicts follow the same mode."""
    batch = prompts(seed=13, count=4)
    rows = [
        SamplingParams(temperature=0.7, top_k=5, seed=1, max_tokens=NEW_TOKENS, token_logprobs=True),
        SamplingParams(temperature=0.9, top_p=0.7, seed=2, max_tokens=NEW_TOKENS, token_logprobs=True, logprobs=1),
        GREEDY,
        SamplingParams(temperature=1.3, seed=3, max_tokens=NEW_TOKENS, token_logprobs=True),
    ]
    outputs = processed_llm.generate(batch, rows, use_tqdm=False)
    assert SamplerMode.SORTED in modes
    for prompt, output, params in zip(batch, outputs, rows, strict=True):
        completion = output.outputs[0]
        if params.logprobs is not None:
            chosen = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids, strict=True)]
            np.testing.assert_array_equal(completion.token_logprobs, np.float32(chosen))
        check_against_reference(
            model, dense_logits, prompt, completion, lambda logits, p=params: processed_log_softmax(logits, p)
        )
    runner = processed_llm.engine.runner
    for compiled in runner.table.samplers.values():
        assert " conditional(" not in compiled.as_text()


def test_no_logprob_transfer_unless_a_row_asks(llm, monkeypatch):
    """Steps where no row asks read back only the tokens; token_logprobs reads the [B] array alone."""
    fetched: list[object] = []
    original = jax.device_get

    def device_get(tree):
        fetched.append(tree)
        return original(tree)

    monkeypatch.setattr(jax, "device_get", device_get)
    batch = prompts(seed=14, count=4)
    llm.generate(batch, SamplingParams(temperature=0.8, seed=1, max_tokens=NEW_TOKENS), use_tqdm=False)
    llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert fetched == []
    llm.generate(batch, [GREEDY, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)] * 2, use_tqdm=False)
    assert fetched and all(isinstance(x, jax.Array) and x.ndim == 1 for x in fetched), fetched


def test_bad_token_logprobs_and_logprobs_mode_are_refused(model, make_llm):
    with pytest.raises(ValueError, match=r"token_logprobs must be a bool, got 1 \(int\)"):
        SamplingParams(token_logprobs=1)
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \('raw_logprobs', 'processed_logprobs'\)"):
        make_llm(model, logprobs_mode="raw_logits")

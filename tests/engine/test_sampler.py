"""The on-device sampler against exact numpy references: greedy, seeds, filtered distributions, penalties."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from jaxserve.sampler import apply_penalties, sample, two_stage_top_k
from jaxserve.step_inputs import SamplingInputs, TokenHistory
from jaxserve.variants import SamplerMode

_jit_sample = jax.jit(sample, static_argnames=("mode",))
_apply_penalties = jax.jit(apply_penalties)


def _sample(logits, params, key, mode: SamplerMode = SamplerMode.CANDIDATES, **history):
    return _jit_sample(logits, params, key, mode=mode, **history)


def history_of(token_ids, num_prompt_tokens) -> TokenHistory:
    """A TokenHistory without carried tokens (the sampler itself never reads carried_column)."""
    return TokenHistory(token_ids, num_prompt_tokens, jnp.full(token_ids.shape[0], token_ids.shape[1], jnp.int32))


NUM_DRAWS = 20_000
REJECT_BELOW = 1e-4


def make_params(batch_size: int, **fields: object) -> SamplingInputs:
    """Neutral rows, with the given fields overridden (a scalar applies to every row)."""
    neutral = {
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": 0,
        "has_seed": False,
        "generation_index": 0,
    }
    unknown = set(fields) - set(neutral)
    assert not unknown, unknown
    arrays = {
        name: np.broadcast_to(np.asarray(fields.get(name, value)), (batch_size,)) for name, value in neutral.items()
    }
    return SamplingInputs.from_columns(**arrays)


def softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The exact filtered distribution in float64, written the direct way (rank by rank), for one row."""
    z = np.asarray(logits, np.float64) / temperature
    vocab = z.shape[0]
    order = np.argsort(-z, kind="stable")
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        ranked = softmax64(np.where(keep, z, -np.inf))[order]
        mass_before = np.cumsum(ranked) - ranked
        assert np.abs(mass_before - top_p).min() > 1e-3, "top_p too close to a cumulative mass: ill-posed case"
        keep[order[mass_before >= top_p]] = False
    if min_p > 0.0:
        ratio = softmax64(z) / softmax64(z).max()
        assert np.abs(ratio - min_p).min() > 1e-3, "min_p too close to a probability ratio: ill-posed case"
        keep &= ratio >= min_p
    return softmax64(np.where(keep, z, -np.inf))


def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of samples to probs; a sample outside the support rejects outright."""
    counts = np.bincount(samples, minlength=probs.shape[0])
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs[probs > 0] * samples.shape[0]
    observed = counts[probs > 0]
    # Pool bins expected to hold fewer than 5 draws, where the chi-square approximation breaks down.
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


def tied_logits(batch_size: int, vocab: int, seed: int) -> np.ndarray:
    """Logits rounded to bf16 over a narrow range, so that the maximum is often tied."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 6, size=(batch_size, vocab)).astype(np.float32) * 0.25
    return np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))


def test_greedy_rows_take_the_first_argmax_in_a_mixed_batch():
    batch, vocab = 64, 32
    logits = tied_logits(batch, vocab, seed=0)
    assert any(np.sum(row == row.max()) > 1 for row in logits), "the test needs tied maxima"
    rng = np.random.default_rng(1)
    greedy = rng.random(batch) < 0.5
    params = make_params(
        batch,
        temperature=np.where(greedy, 0.0, 1.5),
        top_p=rng.uniform(0.3, 1.0, batch),
        min_p=rng.uniform(0.0, 0.2, batch),
    )
    out = _sample(jnp.asarray(logits), params, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out)[greedy], np.argmax(logits, axis=-1)[greedy])
    # The random rows really sample (else the greedy check above would pass for the wrong reason).
    assert (np.asarray(out)[~greedy] != np.argmax(logits, axis=-1)[~greedy]).any()


@pytest.mark.parametrize("with_history", [False, True])
def test_top_k_1_equals_greedy_exactly(with_history: bool):
    batch, vocab = 64, 32
    logits = jnp.asarray(tied_logits(batch, vocab, seed=2))
    rng = np.random.default_rng(3)
    shared = {
        "repetition_penalty": rng.uniform(0.8, 1.5, batch),
        "frequency_penalty": rng.uniform(-0.5, 0.5, batch),
        "presence_penalty": rng.uniform(-0.5, 0.5, batch),
    }
    history = {}
    if with_history:
        history = {
            "history": history_of(
                jnp.asarray(rng.integers(0, vocab + 1, size=(batch, 10)), jnp.int32),
                jnp.asarray(rng.integers(0, 11, size=batch), jnp.int32),
            )
        }
    top_k_1 = make_params(
        batch,
        temperature=rng.uniform(0.1, 3.0, batch),
        top_k=1,
        top_p=rng.uniform(0.1, 1.0, batch),
        min_p=rng.uniform(0.0, 0.5, batch),
        **shared,
    )
    greedy = make_params(batch, temperature=0.0, **shared)
    sampled = _sample(logits, top_k_1, jax.random.key(4), **history)
    expected = _sample(logits, greedy, jax.random.key(5), **history)
    np.testing.assert_array_equal(np.asarray(sampled), np.asarray(expected))
    if not with_history:
        np.testing.assert_array_equal(np.asarray(sampled), np.argmax(np.asarray(logits), axis=-1))


# ---------------------------------------------------------------------------------------------
# Per-request seeds
# ---------------------------------------------------------------------------------------------


def seeded_requests(num: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(6)
    logits = rng.normal(0.0, 0.3, size=(num, 64)).astype(np.float32)  # near uniform: samples vary a lot
    fields = {
        "temperature": rng.uniform(0.5, 1.5, num),
        "top_k": rng.choice([0, 20], num),
        "top_p": rng.choice([1.0, 0.9], num),
        "seed": rng.integers(0, 2**32, num),
        "has_seed": np.ones(num, bool),
        "generation_index": rng.integers(0, 100, num),
    }
    return logits, fields


def sample_seeded_within(batch_size: int, rows: np.ndarray, step_seed: int, requests_logits, requests_fields):
    """Places the seeded requests at `rows` of a batch whose other rows are random unseeded neighbours."""
    rng = np.random.default_rng(step_seed)
    logits = rng.normal(0.0, 2.0, size=(batch_size, requests_logits.shape[1])).astype(np.float32)
    fields = {
        "temperature": rng.uniform(0.0, 2.0, batch_size),
        "top_k": rng.integers(0, 10, batch_size),
        "top_p": np.ones(batch_size),
        "seed": rng.integers(0, 2**32, batch_size),
        "has_seed": rng.random(batch_size) < 0.3,
        "generation_index": rng.integers(0, 100, batch_size),
    }
    logits[rows] = requests_logits
    for name, values in requests_fields.items():
        fields[name] = np.asarray(fields.get(name, np.zeros(batch_size)), dtype=np.asarray(values).dtype)
        fields[name][rows] = values
    out = _sample(jnp.asarray(logits), make_params(batch_size, **fields), jax.random.key(step_seed))
    return np.asarray(out)[rows]


def test_a_seeded_request_samples_the_same_tokens_whatever_the_batch():
    num = 32
    logits, fields = seeded_requests(num)
    alone = np.array(
        [
            sample_seeded_within(
                1, np.array([0]), 100 + i, logits[i : i + 1], {k: v[i : i + 1] for k, v in fields.items()}
            )[0]
            for i in range(num)
        ]
    )
    together = sample_seeded_within(num, np.arange(num), 200, logits, fields)
    rows = np.random.default_rng(7).permutation(96)[:num]
    shuffled_in_larger = sample_seeded_within(96, rows, 300, logits, fields)
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(shuffled_in_larger, alone)


def test_seeded_tokens_change_with_the_seed_and_the_generation_index():
    logits, fields = seeded_requests(1)
    steps = 32  # the batch size of the test above: no new compile
    rows = {name: np.repeat(values, steps) for name, values in fields.items()}
    by_index = sample_seeded_within(
        steps, np.arange(steps), 0, np.repeat(logits, steps, 0), {**rows, "generation_index": np.arange(steps)}
    )
    by_seed = sample_seeded_within(
        steps, np.arange(steps), 0, np.repeat(logits, steps, 0), {**rows, "seed": np.arange(steps)}
    )
    assert len(set(by_index.tolist())) > steps // 4
    assert len(set(by_seed.tolist())) > steps // 4


def test_unseeded_rows_follow_the_step_key():
    batch = 32
    logits = jnp.zeros((batch, 64))
    params = make_params(batch, temperature=1.0)
    first = np.asarray(_sample(logits, params, jax.random.key(0)))
    again = np.asarray(_sample(logits, params, jax.random.key(0)))
    other = np.asarray(_sample(logits, params, jax.random.key(1)))
    np.testing.assert_array_equal(first, again)
    assert (first != other).mean() > 0.5
    assert len(set(first.tolist())) > 16, "rows of one step must not share a key"


def test_raw_and_typed_step_keys_give_the_same_tokens():
    logits = jax.random.normal(jax.random.key(0), (64, 32))
    params = make_params(64, temperature=1.0)
    typed = _sample(logits, params, jax.random.key(9))
    raw = _sample(logits, params, jax.random.PRNGKey(9))
    np.testing.assert_array_equal(np.asarray(typed), np.asarray(raw))


# ---------------------------------------------------------------------------------------------
# Distribution: chi-square goodness of fit against the exact distribution
# ---------------------------------------------------------------------------------------------

LOGITS_16 = np.random.default_rng(8).normal(0.0, 1.5, size=16).astype(np.float32)

# (filters, a nearby wrong setting whose distribution the samples must reject)
CASES = {
    "temperature": ({"temperature": 0.7}, {"temperature": 0.8}),
    "top_k": ({"temperature": 1.0, "top_k": 5}, {"temperature": 1.0, "top_k": 6}),
    "top_p": ({"temperature": 1.0, "top_p": 0.8}, {"temperature": 1.0, "top_p": 0.9}),
    "min_p": ({"temperature": 1.0, "min_p": 0.1}, {"temperature": 1.0, "min_p": 0.05}),
    # top-p renormalises over the top-k survivors: without top-k it would keep a different set.
    "top_k_then_top_p": (
        {"temperature": 1.3, "top_k": 7, "top_p": 0.8, "min_p": 0.02},
        {"temperature": 1.3, "top_k": 0, "top_p": 0.8, "min_p": 0.02},
    ),
    "all_with_min_p_tightest": (
        {"temperature": 1.3, "top_k": 8, "top_p": 0.9, "min_p": 0.4},
        {"temperature": 1.3, "top_k": 8, "top_p": 0.9, "min_p": 0.0},
    ),
}
KEY_MODES = ("step_key", "one_seed_per_row", "one_seed_many_indices")


def draw(filters: dict[str, float], key_mode: str, mode: SamplerMode = SamplerMode.CANDIDATES) -> np.ndarray:
    """NUM_DRAWS samples of one logits row: one per batch row, the rows differing only in their key."""
    keys = {
        "step_key": {},
        "one_seed_per_row": {"seed": np.arange(NUM_DRAWS), "has_seed": True, "generation_index": 17},
        "one_seed_many_indices": {"seed": 1234, "has_seed": True, "generation_index": np.arange(NUM_DRAWS)},
    }[key_mode]
    logits = jnp.broadcast_to(jnp.asarray(LOGITS_16), (NUM_DRAWS, LOGITS_16.shape[0]))
    out = _sample(logits, make_params(NUM_DRAWS, **filters, **keys), jax.random.key(10), mode)
    return np.asarray(out)


# With 16 logits every token is a candidate: both modes are exact for every case.
@pytest.mark.parametrize("mode", [SamplerMode.CANDIDATES, SamplerMode.SORTED])
@pytest.mark.parametrize("key_mode", KEY_MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_samples_follow_the_exact_filtered_distribution(case: str, key_mode: str, mode: SamplerMode):
    filters, wrong_filters = CASES[case]
    exact = reference_distribution(LOGITS_16, **filters)
    wrong = reference_distribution(LOGITS_16, **wrong_filters)
    assert np.abs(exact - wrong).sum() > 0.02, "the wrong distribution must differ for the control to mean anything"
    samples = draw(filters, key_mode, mode)
    assert chi_square_pvalue(samples, exact) > REJECT_BELOW
    assert chi_square_pvalue(samples, wrong) < REJECT_BELOW


def test_greedy_rows_filters_do_not_reach_the_random_rows():
    """Greedy rows with filters next to unfiltered random rows: the random rows keep the full distribution."""
    greedy = np.arange(NUM_DRAWS) % 2 == 0
    params = make_params(
        NUM_DRAWS,
        temperature=np.where(greedy, 0.0, 1.0),
        top_k=np.where(greedy, 2, 0),
        top_p=np.where(greedy, 0.5, 1.0),
        min_p=np.where(greedy, 0.3, 0.0),
    )
    logits = jnp.broadcast_to(jnp.asarray(LOGITS_16), (NUM_DRAWS, LOGITS_16.shape[0]))
    tokens = np.asarray(_sample(logits, params, jax.random.key(12)))
    assert (tokens[greedy] == np.argmax(LOGITS_16)).all()
    assert chi_square_pvalue(tokens[~greedy], reference_distribution(LOGITS_16, 1.0)) > REJECT_BELOW
    assert chi_square_pvalue(tokens[~greedy], reference_distribution(LOGITS_16, 1.0, top_k=2)) < REJECT_BELOW


def test_top_k_keeps_every_token_tied_with_the_kth():
    row = np.full(16, -1.0, np.float32)
    row[:5] = [4.0, 2.0, 2.0, 0.0, 2.5]
    logits = jnp.broadcast_to(jnp.asarray(row), (NUM_DRAWS, 16))
    samples = np.asarray(_sample(logits, make_params(NUM_DRAWS, temperature=1.0, top_k=3), jax.random.key(11)))
    expected = softmax64(np.where(row >= 2.0, row, -np.inf))
    assert chi_square_pvalue(samples, expected) > REJECT_BELOW


# ---------------------------------------------------------------------------------------------
# Penalties
# ---------------------------------------------------------------------------------------------


def reference_penalties(logits, history, num_prompt, repetition, presence, frequency) -> np.ndarray:
    """vLLM semantics, token by token: repetition over prompt + output, presence / frequency over output."""
    out = np.array(logits, np.float64)
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        prompt = [t for t in history[b, : num_prompt[b]] if t < vocab]
        output = [t for t in history[b, num_prompt[b] :] if t < vocab]
        for token in set(prompt) | set(output):
            out[b, token] = out[b, token] / repetition[b] if out[b, token] > 0 else out[b, token] * repetition[b]
        counts = np.bincount(np.asarray(output, np.int64), minlength=vocab)
        out[b] -= frequency[b] * counts + presence[b] * (counts > 0)
    return out


BATCH, HISTORY, VOCAB = 32, 12, 16  # one shape for every penalty test: one compile each


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_prompt=st.lists(st.integers(0, HISTORY), min_size=BATCH, max_size=BATCH),
    padding=st.lists(st.integers(0, HISTORY), min_size=BATCH, max_size=BATCH),
)
def test_penalties_match_the_numpy_reference(seed: int, num_prompt: list[int], padding: list[int]):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, size=(BATCH, VOCAB)).astype(np.float32)
    history = rng.integers(0, VOCAB // 2, size=(BATCH, HISTORY))  # half the vocab: repeats are common
    for b, pad in enumerate(padding):
        history[b, HISTORY - pad :] = VOCAB  # the sentinel pads the tail
    repetition, presence, frequency = rng.uniform(0.5, 2.0, BATCH), rng.uniform(-1, 1, BATCH), rng.uniform(-1, 1, BATCH)
    params = make_params(BATCH, repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency)
    got = _apply_penalties(
        jnp.asarray(logits), params, history_of(jnp.asarray(history, jnp.int32), jnp.asarray(num_prompt, jnp.int32))
    )
    expected = reference_penalties(logits, history, num_prompt, repetition, presence, frequency)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("active", ["repetition", "presence", "frequency", "all"])
def test_penalised_greedy_token_matches_the_reference(active: str):
    """Through `sample`, with one penalty kind alone in the batch (the others neutral) or all of them."""
    rng = np.random.default_rng(12)
    logits = rng.normal(0.0, 1.0, size=(BATCH, VOCAB)).astype(np.float32)
    history = rng.integers(0, VOCAB + 1, size=(BATCH, HISTORY))
    num_prompt = rng.integers(0, HISTORY + 1, BATCH)
    on = {kind: active in (kind, "all") for kind in ("repetition", "presence", "frequency")}
    repetition = rng.uniform(1.0, 3.0, BATCH) if on["repetition"] else np.ones(BATCH)
    presence = rng.uniform(0.5, 2.0, BATCH) if on["presence"] else np.zeros(BATCH)
    frequency = rng.uniform(0.5, 2.0, BATCH) if on["frequency"] else np.zeros(BATCH)
    params = make_params(BATCH, repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency)
    out = _sample(
        jnp.asarray(logits),
        params,
        jax.random.key(0),
        history=history_of(jnp.asarray(history, jnp.int32), jnp.asarray(num_prompt, jnp.int32)),
    )
    expected = np.argmax(reference_penalties(logits, history, num_prompt, repetition, presence, frequency), axis=-1)
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert (expected != np.argmax(logits, axis=-1)).any(), "the penalties must change some greedy tokens"


def test_neutral_penalties_change_nothing():
    rng = np.random.default_rng(13)
    logits = jnp.asarray(rng.normal(0.0, 3.0, size=(BATCH, VOCAB)).astype(np.float32))
    history = jnp.asarray(rng.integers(0, VOCAB + 1, size=(BATCH, HISTORY)), jnp.int32)
    num_prompt = jnp.asarray(rng.integers(0, HISTORY + 1, BATCH), jnp.int32)
    params = make_params(BATCH, temperature=rng.uniform(0.0, 2.0, BATCH), top_p=0.9)
    penalised = _apply_penalties(logits, params, history_of(history, num_prompt))
    np.testing.assert_array_equal(np.asarray(penalised), np.asarray(logits))
    with_history = _sample(logits, params, jax.random.key(1), history=history_of(history, num_prompt))
    without = _sample(logits, params, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(with_history), np.asarray(without))


@pytest.mark.parametrize("penalties", [False, True])
def test_greedy_mode_matches_the_sampling_modes_on_greedy_rows(penalties):
    """The GREEDY mode (an argmax) gives the sampling modes' tokens on greedy rows."""
    rng = np.random.default_rng(15)
    logits = jnp.asarray(rng.normal(0.0, 3.0, size=(BATCH, VOCAB)).astype(np.float32))
    history = jnp.asarray(rng.integers(0, VOCAB + 1, size=(BATCH, HISTORY)), jnp.int32)
    num_prompt = jnp.asarray(rng.integers(0, HISTORY + 1, BATCH), jnp.int32)
    fields = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3) if penalties else {}
    params = make_params(BATCH, top_k=np.where(np.arange(BATCH) % 2, 1, 0), **fields)  # temperature 0 or top_k 1
    extra = dict(history=history_of(history, num_prompt)) if penalties else {}
    general = _sample(logits, params, jax.random.key(2), **extra)
    greedy = _sample(logits, params, jax.random.key(2), SamplerMode.GREEDY, **extra)
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(general))
    if penalties:
        assert (np.asarray(greedy) != np.argmax(np.asarray(logits), axis=-1)).any(), "penalties unused"


# ---------------------------------------------------------------------------------------------
# The CANDIDATES mode's two-stage top-k, and its agreement with the sorting mode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1000, 20001, 49152])  # 8, 157 (the last one padded) and 384 chunks
@pytest.mark.parametrize("k", [1, 20, 64])
def test_two_stage_top_k_equals_lax_top_k(vocab: int, k: int):
    """Same values and ids as lax.top_k, ties (to the lower id) and -inf entries included."""
    rng = np.random.default_rng(vocab + k)
    x = rng.normal(0.0, 2.0, size=(6, vocab)).astype(np.float32)
    x[1] = np.round(x[1])  # many ties, across chunks
    x[2, :] = 0.0  # all tied
    x[3, rng.choice(vocab, vocab - 5, replace=False)] = -np.inf  # fewer finite entries than k
    x[4, vocab - 1] = 50.0  # the maximum in the (padded) last chunk
    expected_values, expected_ids = jax.lax.top_k(jnp.asarray(x), k)
    values, ids = jax.jit(two_stage_top_k, static_argnums=1)(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(expected_values))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(expected_ids))


@pytest.mark.parametrize(
    "filters",
    [
        {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
        {"temperature": 1.0, "top_k": 64, "top_p": 0.5, "min_p": 0.01},
        {"temperature": 1.2, "top_k": 7},
        {"temperature": 0.7, "min_p": 0.05},
        {"temperature": 1.0},
    ],
)
def test_candidates_mode_draws_the_sorting_modes_tokens(filters: dict):
    """On a large vocabulary, for filters the host sends to CANDIDATES, both modes cut the same threshold
    and so draw the same tokens from the same keys."""
    rng = np.random.default_rng(31)
    logits = jnp.asarray(rng.normal(0.0, 3.0, size=(64, 20000)).astype(np.float32))
    params = make_params(64, **filters, seed=np.arange(64), has_seed=True)
    candidates = _sample(logits, params, jax.random.key(3), SamplerMode.CANDIDATES)
    by_sort = _sample(logits, params, jax.random.key(3), SamplerMode.SORTED)
    np.testing.assert_array_equal(np.asarray(candidates), np.asarray(by_sort))


# ---------------------------------------------------------------------------------------------
# SamplingInputs as the sampler receives them
# ---------------------------------------------------------------------------------------------


def test_from_columns_fixes_dtypes_and_wraps_seeds():
    params = make_params(3, seed=np.array([-1, 2**32 + 5, 7]), top_k=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(np.asarray(params.seed), np.array([2**32 - 1, 5, 7], np.uint32))
    assert params.top_k.dtype == np.int32 and params.temperature.dtype == np.float32
    assert params.seed.dtype == np.uint32 and params.has_seed.dtype == np.bool_
    assert SamplingInputs.neutral(5).top_p.shape == (5,)


def test_from_columns_names_the_bad_field():
    arrays = {name: np.zeros(4) for name in SamplingInputs.__dataclass_fields__}
    with pytest.raises(ValueError, match="top_p has shape"):
        SamplingInputs.from_columns(**{**arrays, "top_p": np.ones(3)})
    with pytest.raises(ValueError, match="missing columns \\['min_p'\\]"):
        SamplingInputs.from_columns(**{k: v for k, v in arrays.items() if k != "min_p"})
    with pytest.raises(ValueError, match="num_rows must be >= 1"):
        SamplingInputs.neutral(0)

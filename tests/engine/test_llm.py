"""The LLM API end to end on a tiny random Llama: outputs and metrics, limits from the model config,
sampling inside the engine (greedy, top-k, seeds, n samples, logprobs, penalties), the stop rules,
bad input, streaming and chat.

Expected tokens and logprobs come from the dense reference path (a dense forward over prompt + output,
one compiled shape for every sequence) and from numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.sampling import SamplingParams

VOCAB = 160
MODEL_MAX_SEQ_LEN = 256  # the tiny model's max_position_embeddings
EOS_PROMPT = [11, 22, 33, 44, 55, 66, 77]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def first_new_token_index(tokens: list[int], start: int = 2) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def dense_greedy(model, dense_logits):
    """Greedy continuations on the dense path, each token the argmax of a forward over the sequence so far."""

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        continuations = []
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(max_tokens):
                tokens.append(int(np.argmax(dense_logits(model, tokens)[-1])))
            continuations.append(tokens[len(prompt) :])
        return continuations

    return greedy


@pytest.fixture(scope="module")
def eos_continuation(dense_greedy) -> list[int]:
    """The greedy continuation of EOS_PROMPT; the tokenizer's EOS is one of its tokens."""
    return dense_greedy([EOS_PROMPT], 16)[0]


@pytest.fixture(scope="module")
def eos_index(eos_continuation) -> int:
    return first_new_token_index(eos_continuation)


@pytest.fixture(scope="module")
def tokenizer(char_tokenizer, eos_continuation, eos_index):
    return char_tokenizer(eos_token_ids=[eos_continuation[eos_index]])


@pytest.fixture(scope="module")
def llm(model, tokenizer, make_llm):
    """A larger max_seq_len than the model supports (clamped to it), and the penalty variants compiled."""
    buckets = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=True)
    return make_llm(model, tokenizer, compile_config=buckets, max_seq_len=4 * MODEL_MAX_SEQ_LEN)


@pytest.fixture
def serves_after(llm, dense_greedy, assert_engine_idle):
    """After the test: the engine is idle, leaks nothing, and still serves a greedy request correctly."""
    yield
    assert_engine_idle(llm)
    prompt = random_prompt(99, 20)
    output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == dense_greedy([prompt], 10)[0]


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ---- limits and outputs ----------------------------------------------------------------------


def test_limits_follow_the_model_config(llm):
    assert llm.config.max_seq_len == MODEL_MAX_SEQ_LEN  # the larger requested value was clamped
    assert llm.config.max_num_tokens == 32 and llm.config.max_batch_size == 4


def test_text_prompt_gives_a_complete_request_output(llm, tokenizer, dense_greedy, serves_after):
    text = tokenizer.decode(random_prompt(1, 12))

    output = llm.generate(text, GREEDY, use_tqdm=False)[0]

    assert output.prompt == text and output.prompt_token_ids == tokenizer.encode(text)
    assert output.finished and output.error is None
    completion = output.outputs[0]
    assert completion.token_ids == dense_greedy([output.prompt_token_ids], 10)[0]
    assert completion.text == tokenizer.decode(completion.token_ids)
    assert (completion.finish_reason, completion.stop_reason, completion.logprobs) == ("length", None, None)
    metrics = output.metrics
    assert 0 < metrics.time_to_first_token <= metrics.latency


def test_one_prompt_of_token_ids_is_one_request(llm):
    prompt = random_prompt(2, 9)
    outputs = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].prompt is None and outputs[0].prompt_token_ids == prompt


# ---- sampling --------------------------------------------------------------------------------


def test_top_k_1_is_greedy(llm, dense_greedy):
    prompts = [random_prompt(3 + i, 5 + 7 * i) for i in range(5)]
    top_k_1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=10, ignore_eos=True)

    outputs = llm.generate(prompts, top_k_1, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outputs] == dense_greedy(prompts, 10)


def test_a_seed_reproduces_its_tokens_whatever_the_batch(llm):
    prompt = random_prompt(10, 23)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    others = [random_prompt(20 + i, 3 + 9 * i) for i in range(5)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)

    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = [*others[:3], prompt, *others[3:]]
    params = [unseeded] * 3 + [seeded] + [unseeded] * 2
    in_batch = llm.generate(batch, params, use_tqdm=False)[3].outputs[0].token_ids
    other_seed = dataclasses.replace(seeded, seed=4321)
    different = llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids

    assert len(alone) == 12 and in_batch == alone
    assert different != alone


def test_n_samples_share_the_prompt_and_differ(llm, dense_greedy, serves_after):
    prompt = random_prompt(30, 40)  # two full blocks shared by the forks

    sampled = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False
    )[0]
    greedy = llm.generate([prompt], dataclasses.replace(GREEDY, n=3), use_tqdm=False)[0]

    assert [c.index for c in sampled.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in sampled.outputs)
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1, "the samples are not independent"
    expected = dense_greedy([prompt], 10)[0]
    assert [c.token_ids for c in greedy.outputs] == [expected] * 3


@pytest.mark.parametrize(("num_logprobs", "penalty"), [(0, 1.0), (5, 1.0), (5, 1.4)])
def test_logprobs_are_the_log_softmax_of_the_reference_logits(llm, model, dense_logits, num_logprobs, penalty):
    """Raw logprobs (vLLM's default): before temperature and penalties, whichever variant samples."""
    prompt = random_prompt(40, 19)
    params = SamplingParams(
        temperature=0.8, seed=7, max_tokens=8, ignore_eos=True, logprobs=num_logprobs, repetition_penalty=penalty
    )

    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    tokens = completion.token_ids
    assert len(completion.logprobs) == len(tokens) == 8
    reference = log_softmax64(dense_logits(model, prompt + tokens))
    for i, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
        expected = reference[len(prompt) + i - 1]
        top = np.argsort(-expected, kind="stable")[:num_logprobs].tolist()
        assert token in entry and set(entry) == {token, *top}, f"position {i}"
        for token_id, logprob in entry.items():
            np.testing.assert_allclose(logprob.logprob, expected[token_id], atol=1e-4, rtol=0)
            assert logprob.rank == 1 + int(np.sum(expected > expected[token_id] + 1e-4))


def test_penalties_match_a_numpy_reference(llm, model, dense_logits, dense_greedy):
    """Greedy decoding with all three penalties, against argmax over penalised dense logits."""
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 50, 51, 52] + random_prompt(50, 9)
    repetition, presence, frequency = 1.6, 0.5, 0.7
    params = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        ignore_eos=True,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )

    outputs = llm.generate([prompt, prompt], [params, GREEDY], use_tqdm=False)

    expected: list[int] = []
    for _ in range(12):
        logits = dense_logits(model, prompt + expected)[-1].astype(np.float64)
        seen = np.zeros(VOCAB, bool)
        seen[prompt + expected] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = np.bincount(expected, minlength=VOCAB)
        logits -= frequency * counts + presence * (counts > 0)
        expected.append(int(np.argmax(logits)))
    assert outputs[0].outputs[0].token_ids == expected
    assert outputs[1].outputs[0].token_ids == dense_greedy([prompt], 10)[0]
    assert expected[:10] != outputs[1].outputs[0].token_ids, "the penalties changed nothing"


# ---- stop rules ------------------------------------------------------------------------------


def test_eos_stops_unless_min_tokens_or_ignore_eos(llm, model, dense_logits, eos_continuation, eos_index):
    eos = eos_continuation[eos_index]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    held_back = dataclasses.replace(greedy, min_tokens=eos_index + 2)
    ignoring = dataclasses.replace(greedy, ignore_eos=True)

    stopped, delayed, ignored = llm.generate([EOS_PROMPT] * 3, [greedy, held_back, ignoring], use_tqdm=False)

    assert stopped.outputs[0].token_ids == eos_continuation[: eos_index + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    tokens = delayed.outputs[0].token_ids
    assert tokens[:eos_index] == eos_continuation[:eos_index]
    assert eos not in tokens[: eos_index + 2]
    logits = dense_logits(model, EOS_PROMPT + tokens[:eos_index])[-1].copy()
    logits[eos] = -np.inf
    assert tokens[eos_index] == int(np.argmax(logits)), "min_tokens must fall back to the best other token"
    assert ignored.outputs[0].token_ids == eos_continuation
    assert ignored.outputs[0].finish_reason == "length"


def test_stop_token_ids_stop_strings_and_max_tokens(llm, tokenizer, dense_greedy):
    prompt = random_prompt(60, 14)
    reference = dense_greedy([prompt], 16)[0]
    text = tokenizer.decode(reference)
    j = first_new_token_index(reference)
    k = next(i for i in range(2, 14) if text.find(text[i : i + 2]) == i)  # first occurrence of a 2-token string
    stop_string = text[k : k + 2]
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = [
        dataclasses.replace(base, stop_token_ids=(reference[j],)),
        dataclasses.replace(base, stop=(stop_string, "never")),
        dataclasses.replace(base, stop=(stop_string,), max_tokens=k + 2),  # both stops on one token
        dataclasses.replace(base, max_tokens=5),
    ]

    by_id, by_string, both, by_length = (o.outputs[0] for o in llm.generate([prompt] * 4, params, use_tqdm=False))

    assert by_id.token_ids == reference[: j + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", reference[j])
    for completion in (by_string, both):
        assert completion.token_ids == reference[: k + 2]
        assert completion.text == text[:k], "the stop string is not part of the output"
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_string)
    assert by_length.token_ids == reference[:5] and by_length.finish_reason == "length"


# ---- bad input -------------------------------------------------------------------------------

INVALID_FIELDS = [
    ("n", 0),
    ("temperature", -1.0),
    ("top_k", -2),
    ("top_p", 1.5),
    ("min_p", -0.5),
    ("repetition_penalty", 0.0),
    ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0),
    ("seed", 0.5),
    ("max_tokens", 0),
    ("min_tokens", -1),
    ("stop", ("",)),
    ("stop_token_ids", (-3,)),
    ("ignore_eos", "yes"),
    ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize("field, value", INVALID_FIELDS, ids=[f for f, _ in INVALID_FIELDS])
def test_each_invalid_sampling_field_is_a_value_error_and_the_engine_serves_on(llm, field, value, serves_after):
    """Rejected when built, and again by generate() if an invalid value was forced into a built object."""
    with pytest.raises(ValueError, match=field):
        llm.generate([random_prompt(70, 5)], SamplingParams(**{field: value}), use_tqdm=False)
    forced = SamplingParams(max_tokens=4)
    object.__setattr__(forced, field, value)  # frozen dataclasses can still be mutated this way

    with pytest.raises(ValueError, match=f"prompt 1: .*{field}"):
        llm.generate([random_prompt(71, 5), random_prompt(72, 6)], [SamplingParams(), forced], use_tqdm=False)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([5, VOCAB], r"\[0, 159\]; got \[160\]"),
        ([-1, 3], r"\[0, 159\]; got \[-1\]"),
    ],
    ids=["empty-ids", "empty-text", "id-too-large", "negative-id"],
)
def test_malformed_prompts_are_value_errors(llm, prompt, message, serves_after):
    with pytest.raises(ValueError, match=f"prompt 1: .*{message}"):
        llm.generate([random_prompt(80, 4), prompt], GREEDY, use_tqdm=False)


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(prompt_logprobs=2), r"prompt_logprobs needs CompileConfig\(prompt_logprobs=True\)"),
        (SamplingParams(min_tokens=2, stop_token_ids=range(8)), "min_tokens can hold back at most 8"),
    ],
    ids=["prompt-logprobs", "too-many-banned-ids"],
)
def test_what_the_engine_cannot_serve_is_a_value_error(llm, params, message, serves_after):
    with pytest.raises(ValueError, match=message):
        llm.generate([random_prompt(81, 4)], params, use_tqdm=False)


@pytest.fixture(scope="module")
def scoring_llm(model, tokenizer, make_llm):
    """Prompt-logprobs variants compiled; 16 tokens per step, so longer prompts are prefilled in chunks."""
    buckets = CompileConfig(decode_batch_sizes=(4,), token_buckets=(16,), penalty_variants=False, prompt_logprobs=True)
    return make_llm(model, tokenizer, compile_config=buckets, max_num_tokens=16)


def _check_prompt_logprobs(output, prompt, k, reference) -> None:
    """vLLM's layout: None at position 0, then per position the prompt token and the top-k, with ranks."""
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        expected = reference[position - 1]
        top = np.argsort(-expected, kind="stable")[:k].tolist()
        entry = entries[position]
        assert set(entry) == {prompt[position], *top}, f"position {position}"
        for token_id, logprob in entry.items():
            np.testing.assert_allclose(logprob.logprob, expected[token_id], atol=1e-4, rtol=0)
            # Tokens within the tolerance of this one may fall on either side of it in float32.
            surely_above = int(np.sum(expected > expected[token_id] + 1e-4))
            maybe_above = int(np.sum(expected > expected[token_id] - 1e-4)) - 1
            assert 1 + surely_above <= logprob.rank <= 1 + maybe_above, f"position {position}"


def test_prompt_logprobs_match_the_reference_across_chunks_and_prefix_hits(
    scoring_llm, model, dense_logits, dense_greedy, assert_engine_idle
):
    long_prompt, short_prompt, other = random_prompt(60, 45), random_prompt(61, 9), random_prompt(62, 30)
    scored = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # The same long prompt twice (the second would hit the prefix cache: a scoring request reuses nothing),
    # an unscored request in the same steps, and a top-0 request (only the prompt token itself).
    prompts = [long_prompt, other, long_prompt, short_prompt]
    params = [scored, plain, scored, dataclasses.replace(scored, prompt_logprobs=0)]

    outputs = scoring_llm.generate(prompts, params, use_tqdm=False)

    for output, prompt, p in zip(outputs, prompts, params, strict=True):
        assert output.outputs[0].token_ids == dense_greedy([prompt], 4)[0]
        if p.prompt_logprobs is None:
            assert output.prompt_logprobs is None
        else:
            _check_prompt_logprobs(output, prompt, p.prompt_logprobs, log_softmax64(dense_logits(model, prompt)))
    assert_engine_idle(scoring_llm)


def test_prompt_logprobs_with_n_samples_and_a_one_token_prompt(scoring_llm, model, dense_logits, assert_engine_idle):
    prompt = random_prompt(63, 20)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    one_token = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2)

    sampled, single = scoring_llm.generate([prompt, [7]], [params, one_token], use_tqdm=False)

    assert len(sampled.outputs) == 2
    _check_prompt_logprobs(sampled, prompt, 2, log_softmax64(dense_logits(model, prompt)))
    assert single.prompt_logprobs == [None]
    assert_engine_idle(scoring_llm)


def test_prompt_logprobs_with_penalties_use_the_raw_logits(
    model, tokenizer, make_llm, dense_logits, assert_engine_idle
):
    """The (penalties, prompt logprobs) variant: penalties change the sampling, not the prompt's scores."""
    buckets = CompileConfig(decode_batch_sizes=(4,), token_buckets=(16,), penalty_variants=True, prompt_logprobs=True)
    llm = make_llm(model, tokenizer, compile_config=buckets, max_num_tokens=16)
    prompt = random_prompt(64, 21)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1, repetition_penalty=1.3)

    [output] = llm.generate([prompt], params, use_tqdm=False)

    _check_prompt_logprobs(output, prompt, 1, log_softmax64(dense_logits(model, prompt)))
    assert_engine_idle(llm)


def test_a_prompt_longer_than_max_seq_len_fails_alone(llm, dense_greedy, serves_after):
    prompts = [random_prompt(90, 10), random_prompt(91, MODEL_MAX_SEQ_LEN), random_prompt(92, 30)]

    short, too_long, other = llm.generate(prompts, GREEDY, use_tqdm=False)

    assert too_long.finished and "max_seq_len" in too_long.error
    assert too_long.outputs[0].finish_reason == "error" and too_long.outputs[0].token_ids == []
    expected = dense_greedy([prompts[0], prompts[2]], 10)
    assert [short.outputs[0].token_ids, other.outputs[0].token_ids] == expected
    assert short.error is None and other.error is None


def test_max_tokens_none_runs_to_max_seq_len(llm, dense_greedy):
    prompt = random_prompt(95, MODEL_MAX_SEQ_LEN - 6)

    output = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True), use_tqdm=False)

    assert output[0].outputs[0].token_ids == dense_greedy([prompt], 6)[0]
    assert output[0].outputs[0].finish_reason == "length"


def test_abort_mid_generation_frees_everything(llm, serves_after):
    engine = llm.engine
    request_id = engine.add_request(random_prompt(96, 50), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()

    engine.abort(request_id)
    outputs = [o for _ in range(3) for o in engine.step() if o.request_id == request_id]

    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].finish_reason == "abort"
    assert 0 < len(outputs[0].outputs[0].token_ids) < 50


def test_steps_report_a_request_once_when_it_finishes_unless_it_streams(llm, serves_after):
    engine = llm.engine
    short = engine.add_request(random_prompt(101, 20), SamplingParams(max_tokens=2, ignore_eos=True))
    long = engine.add_request(random_prompt(102, 20), SamplingParams(max_tokens=6, ignore_eos=True))
    streamed = engine.add_request(random_prompt(103, 20), SamplingParams(max_tokens=4, ignore_eos=True), stream=True)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()

    assert all(o.finished for o in outputs if o.request_id != streamed)
    seen = [o.request_id for o in outputs if o.request_id != streamed]
    assert sorted(seen) == sorted([short, long])
    assert seen.index(short) < seen.index(long)
    assert [len(o.outputs[0].token_ids) for o in outputs if o.request_id == streamed] == [1, 2, 3, 4]


def test_a_stream_interval_reports_the_first_token_then_every_n_tokens_and_the_end(llm, serves_after):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    every_third = engine.add_request(random_prompt(104, 20), params, stream=True, stream_interval=3)
    two_samples = engine.add_request(
        random_prompt(105, 20), SamplingParams(n=2, max_tokens=3, ignore_eos=True), stream=True, stream_interval=4
    )
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()

    counts = [len(o.outputs[0].token_ids) for o in outputs if o.request_id == every_third]
    assert counts == [1, 4, 7, 10]
    # The interval counts the tokens of all samples: a report after the first token, then none before four
    # more (or the end, 3 + 3 tokens).
    both = [sum(len(c.token_ids) for c in o.outputs) for o in outputs if o.request_id == two_samples]
    assert both[0] >= 1 and both[-1] == 6 and len(both) >= 2
    assert all(later - earlier >= 4 for earlier, later in zip(both, both[1:-1], strict=False))
    final = llm.generate([random_prompt(104, 20)], params, use_tqdm=False)[0].outputs[0]
    assert [o for o in outputs if o.request_id == every_third][-1].outputs[0].token_ids == final.token_ids
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1"):
        engine.add_request(random_prompt(106, 20), params, stream=True, stream_interval=0)


# ---- streaming and chat ----------------------------------------------------------------------


def test_stream_yields_growing_outputs_ending_like_generate(llm, serves_after):
    prompt = random_prompt(100, 37)
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=9, ignore_eos=True)

    partials = list(llm.stream(prompt, params))

    final = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert [p.finished for p in partials] == [False] * (len(partials) - 1) + [True]
    token_counts = [len(p.outputs[0].token_ids) for p in partials]
    assert token_counts == list(range(1, 10))
    for earlier, later in zip(partials[:-1], partials[1:], strict=True):
        assert later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    assert partials[-1].outputs[0].token_ids == final.token_ids and partials[-1].outputs[0].text == final.text
    assert partials[-1].outputs[0].finish_reason == "length"


def test_chat_applies_the_template(llm, tokenizer, dense_greedy):
    conversations = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}],
    ]

    single = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    both = llm.chat(conversations, GREEDY, use_tqdm=False)

    prompts = [tokenizer.apply_chat_template(c) for c in conversations]
    assert [o.prompt_token_ids for o in both] == prompts
    assert [o.outputs[0].token_ids for o in both] == dense_greedy(prompts, 10)
    assert single[0].outputs[0].token_ids == both[0].outputs[0].token_ids


def test_streamed_text_with_stop_strings_split_across_steps_only_grows(llm, tokenizer, dense_greedy, serves_after):
    """A stop string arriving over several steps is held back, never shown and then taken away; the stream
    ends exactly where generate() ends, at the stop string."""
    prompt = random_prompt(61, 12)
    reference = dense_greedy([prompt], 16)[0]
    text = tokenizer.decode(reference)
    k = next(i for i in range(3, 12) if text.find(text[i : i + 3]) == i)  # first occurrence of a 3-token string
    stop = text[k : k + 3]  # arrives one character (token) per step
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(stop, text[k] + "\x00never"))

    partials = [p.outputs[0] for p in llm.stream(prompt, params)]

    final = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    texts = [p.text for p in partials]
    for earlier, later in zip(texts[:-1], texts[1:], strict=True):
        assert later.startswith(earlier), texts
    assert texts[-1] == final.text == text[:k]
    assert all(not t.endswith(stop[:1]) for t in texts[:-1] if len(t) == k), "the stop string's start was shown"
    assert (partials[-1].finish_reason, partials[-1].stop_reason) == ("stop", stop)
    assert partials[-1].token_ids == final.token_ids == reference[: k + 3]

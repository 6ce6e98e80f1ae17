"""POST /v1/completions through the openai client against the offline API with the same engine settings:
greedy texts, seeded n=2 samples, logprobs in the completions format, echo, stop strings and usage."""

from __future__ import annotations

import itertools

import pytest

from jaxserve.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
GREEDY = dict(temperature=0.0, max_tokens=8)


def offline(reference, prompts, **params):
    return reference.generate(prompts, SamplingParams(**params), use_tqdm=False)


def by_index(choices):
    return sorted(choices, key=lambda choice: choice.index)


def test_greedy_texts_equal_the_offline_api(client, model, reference):
    response = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    expected = offline(reference, PROMPTS, **GREEDY)

    assert [c.text for c in by_index(response.choices)] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in by_index(response.choices)] == [o.outputs[0].finish_reason for o in expected]
    assert response.object == "text_completion" and response.model == model
    usage = response.usage
    assert usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_token_id_prompts_give_the_same_texts_and_usage(client, model, reference):
    ids = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    expected = offline(reference, ids, **GREEDY)

    stream = client.completions.create(
        model=model, prompt=ids, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts, finish, chunks = {0: "", 1: ""}, {}, list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.index not in finish, "nothing comes after a choice's finish_reason"
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason

    assert [texts[0], texts[1]] == [o.outputs[0].text for o in expected]
    assert [finish[0], finish[1]] == [o.outputs[0].finish_reason for o in expected]
    assert sum(1 for c in chunks if c.choices) > 2, "the text came in several chunks"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert all(c.usage is None for c in chunks[:-1])


def test_n_2_with_a_seed_is_reproducible_and_samples_what_the_offline_api_samples(client, model, reference):
    params = dict(temperature=0.9, top_p=0.95, seed=7, n=2, max_tokens=8)
    top_k = 40  # with top_p, a top_k of at most 64 samples from the best 64 logits (no sort of the vocabulary)
    first = client.completions.create(model=model, prompt=PROMPTS[0], extra_body={"top_k": top_k}, **params)
    second = client.completions.create(model=model, prompt=PROMPTS[0], extra_body={"top_k": top_k}, **params)
    [expected] = offline(reference, [PROMPTS[0]], top_k=top_k, **params)

    texts = [c.text for c in by_index(first.choices)]
    assert texts == [c.text for c in by_index(second.choices)] == [c.text for c in expected.outputs]
    assert len(set(texts)) == 2, "the two samples differ"
    other = client.completions.create(
        model=model, prompt=PROMPTS[0], extra_body={"top_k": top_k}, **{**params, "seed": 8}
    )
    assert [c.text for c in by_index(other.choices)] != texts


def test_streamed_choices_of_several_prompts_and_samples_are_indexed_prompt_times_n_plus_sample(
    client, model, reference
):
    params = dict(temperature=0.9, top_p=0.95, seed=3, n=2, max_tokens=6)
    prompts = PROMPTS[:2]
    expected = offline(reference, prompts, top_k=40, **params)
    stream = client.completions.create(model=model, prompt=prompts, stream=True, extra_body={"top_k": 40}, **params)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i * 2 + c.index: c.text for i, o in enumerate(expected) for c in o.outputs}


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(client, model, reference):
    prompt = reference.tokenizer.encode(" ".join(["a long shared prefix"] * 10))  # 40 tokens: 2 full blocks
    assert 32 < len(prompt) <= 48
    first = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 32  # the blocks before the last one


def test_logprobs_equal_the_offline_api(client, model, reference):
    response = client.completions.create(model=model, prompt=PROMPTS[1], logprobs=3, **GREEDY)
    [expected] = offline(reference, [PROMPTS[1]], logprobs=3, **GREEDY)
    sample, logprobs = expected.outputs[0], response.choices[0].logprobs

    chosen = [position[token] for position, token in zip(sample.logprobs, sample.token_ids, strict=True)]
    assert logprobs.tokens == [c.decoded_token for c in chosen]
    assert logprobs.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=1e-5)
    assert logprobs.text_offset == list(itertools.accumulate((len(t) for t in logprobs.tokens[:-1]), initial=0))
    for top, position in zip(logprobs.top_logprobs, sample.logprobs, strict=True):
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in position.values()}, abs=1e-5)
        assert 3 <= len(top) <= 4  # the top 3, and the chosen token when it is not among them


def test_echo_with_logprobs_and_max_tokens_0_gives_the_prompt_logprobs(client, model, reference):
    prompt = PROMPTS[2]
    response = client.completions.create(
        model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0.0
    )
    [expected] = offline(reference, [prompt], max_tokens=1, prompt_logprobs=1)
    ids, scores = expected.prompt_token_ids, expected.prompt_logprobs
    choice = response.choices[0]

    assert choice.text == prompt and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert len(logprobs.tokens) == len(ids)
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [scores[i][t].logprob for i, t in enumerate(ids) if i], abs=1e-5
    )
    for top, position in zip(logprobs.top_logprobs[1:], scores[1:], strict=True):
        assert top == pytest.approx({lp.decoded_token: lp.logprob for lp in position.values()}, abs=1e-5)


def test_echo_with_generation_prepends_the_prompt_and_its_logprobs(client, model, reference):
    prompt = PROMPTS[0]
    response = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=0, **GREEDY)
    [expected] = offline(reference, [prompt], logprobs=0, prompt_logprobs=0, **GREEDY)
    choice, sample = response.choices[0], expected.outputs[0]

    assert choice.text == prompt + sample.text
    prompt_scores = [expected.prompt_logprobs[i][t].logprob for i, t in enumerate(expected.prompt_token_ids) if i]
    sampled = [position[t].logprob for position, t in zip(sample.logprobs, sample.token_ids, strict=True)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(prompt_scores + sampled, abs=1e-5)


def test_stop_strings_end_the_text_and_are_reported(client, model, reference):
    [expected] = offline(reference, [PROMPTS[0]], **GREEDY)
    full = expected.outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    response = client.completions.create(model=model, prompt=PROMPTS[0], stop=[stop], **GREEDY)
    kept = client.completions.create(
        model=model, prompt=PROMPTS[0], stop=stop, extra_body={"include_stop_str_in_output": True}, **GREEDY
    )

    choice = response.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert kept.choices[0].text == full[: full.index(stop)] + stop


def test_prompt_logprobs_come_in_vllm_format(client, model, reference):
    response = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 2}
    )
    [expected] = offline(reference, [PROMPTS[1]], max_tokens=1, temperature=0.0, prompt_logprobs=2)

    served = response.choices[0].model_extra["prompt_logprobs"]
    assert served[0] is None and len(served) == len(expected.prompt_token_ids)
    for entry, position in zip(served[1:], expected.prompt_logprobs[1:], strict=True):
        assert {int(t) for t in entry} == set(position)
        for token, logprob in position.items():
            assert entry[str(token)]["logprob"] == pytest.approx(logprob.logprob, abs=1e-5)
            assert entry[str(token)]["rank"] == logprob.rank


def test_an_unknown_field_is_ignored_as_vllm_ignores_it(client, model, reference):
    response = client.completions.create(model=model, prompt=PROMPTS[0], extra_body={"no_such_field": 1}, **GREEDY)
    [expected] = offline(reference, [PROMPTS[0]], **GREEDY)
    assert response.choices[0].text == expected.outputs[0].text

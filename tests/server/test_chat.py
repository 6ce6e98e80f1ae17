"""POST /v1/chat/completions through the openai client against `LLM.chat` with the same engine settings:
greedy answers whole and streamed (the first delta carries the role), and logprobs in the chat format."""

from __future__ import annotations

import pytest

from jaxserve.sampling import SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
MAX_TOKENS = 8


def offline(reference, conversation, **params):
    [output] = reference.chat(conversation, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params))
    return output.outputs[0]


def test_greedy_answers_equal_llm_chat(client, model, reference):
    for conversation in CONVERSATIONS:
        response = client.chat.completions.create(
            model=model, messages=conversation, temperature=0.0, max_completion_tokens=MAX_TOKENS
        )
        expected = offline(reference, conversation)
        [choice] = response.choices
        assert choice.message.role == "assistant" and choice.message.content == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert response.object == "chat.completion"
        assert response.usage.completion_tokens == len(expected.token_ids)


def test_a_stream_starts_with_the_role_and_its_deltas_join_to_the_answer(client, model, reference):
    conversation = CONVERSATIONS[1]
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=conversation,
            temperature=0.0,
            max_tokens=MAX_TOKENS,  # the older name of max_completion_tokens
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    expected = offline(reference, conversation)

    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    deltas = [c.choices[0] for c in chunks[1:] if c.choices]
    assert all(d.delta.role is None for d in deltas)
    assert "".join(d.delta.content or "" for d in deltas) == expected.text
    assert deltas[-1].finish_reason == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_logprobs_come_in_the_chat_format_and_equal_the_offline_api(client, model, reference):
    conversation = CONVERSATIONS[0]
    response = client.chat.completions.create(
        model=model, messages=conversation, temperature=0.0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2
    )
    expected = offline(reference, conversation, logprobs=2)

    content = response.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    for entry, token, position in zip(content, expected.token_ids, expected.logprobs, strict=True):
        chosen = position[token]
        assert entry.token == chosen.decoded_token and entry.bytes == list(chosen.decoded_token.encode())
        assert entry.logprob == pytest.approx(chosen.logprob, abs=1e-5)
        top = sorted(position.values(), key=lambda lp: lp.rank)[:2]
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp.logprob for lp in top], abs=1e-5)
        assert entry.top_logprobs[0].token == entry.token, "greedy: the chosen token is the most likely"

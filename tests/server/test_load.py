"""64 concurrent streaming clients, a third of them disconnecting mid-stream: every other client gets its
complete greedy text (the offline API's), the disconnected requests are aborted, the engine is left with
nothing running and no block held but the prefix cache's reusable ones, and /metrics adds up. A client
that gives up waiting for a whole (not streamed) response aborts its request too."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import requests

from jaxserve.sampling import SamplingParams

NUM_CLIENTS = 64
CHUNKS_BEFORE_DISCONNECT = 2
DISCONNECTED_MAX_TOKENS = 48  # long enough that each is still running when its client leaves


def workload(vocab_size: int) -> list[tuple[list[int], int, bool]]:
    """(prompt ids, max_tokens, disconnects) per client: random prompts of 3-16 tokens, 2-12 new tokens."""
    rng = np.random.default_rng(0)
    clients = []
    for i in range(NUM_CLIENTS):
        prompt = rng.integers(100, vocab_size, rng.integers(3, 17)).tolist()
        disconnects = i % 3 == 0
        clients.append((prompt, DISCONNECTED_MAX_TOKENS if disconnects else int(rng.integers(2, 13)), disconnects))
    return clients


async def run_client(client, model: str, prompt: list[int], max_tokens: int, disconnects: bool) -> tuple[str, int]:
    """The streamed text and the number of chunks read."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
    )
    text, chunks = "", 0
    async for chunk in stream:
        chunks += 1
        text += "".join(choice.text for choice in chunk.choices)
        if disconnects and chunks == CHUNKS_BEFORE_DISCONNECT:
            await stream.close()
            break
    return text, chunks


async def run_clients(served, clients) -> list[tuple[str, int]]:
    async with served.async_client() as client:
        return await asyncio.gather(*(run_client(client, served.model, *c) for c in clients))


def test_concurrent_streams_with_disconnects_lose_nothing(served, reference):
    engine = served.llm.engine
    clients = workload(engine.vocab_size)
    complete = [(prompt, max_tokens) for prompt, max_tokens, disconnects in clients if not disconnects]
    expected = reference.generate(
        [prompt for prompt, _ in complete],
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in complete],
        use_tqdm=False,
    )
    assert served.frontend.wait_idle(60)
    before = served.metrics()

    results = asyncio.run(run_clients(served, clients))

    texts = [text for (text, _), (_, _, disconnects) in zip(results, clients, strict=True) if not disconnects]
    assert texts == [o.outputs[0].text for o in expected]
    assert served.frontend.wait_idle(120), "the server did not come back to idle"
    assert not engine.has_unfinished() and engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    blocks = engine.block_manager
    assert blocks.num_used_blocks == 0
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks)), "only reusable prefix blocks are left"

    after = served.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    num_disconnected = sum(1 for *_, disconnects in clients if disconnects)
    assert grew('jaxserve:request_success_total{finished_reason="length"}') == len(complete)
    assert grew('jaxserve:request_success_total{finished_reason="abort"}') == num_disconnected
    assert grew("jaxserve:prompt_tokens_total") == sum(len(prompt) for prompt, *_ in clients)
    generated = grew("jaxserve:generation_tokens_total") - sum(n for _, n in complete)
    # A disconnected client read CHUNKS_BEFORE_DISCONNECT chunks (each of one token or more) and its request
    # was aborted before max_tokens.
    assert CHUNKS_BEFORE_DISCONNECT * num_disconnected <= generated < DISCONNECTED_MAX_TOKENS * num_disconnected
    assert grew("jaxserve:time_to_first_token_seconds_count") == NUM_CLIENTS
    assert grew("jaxserve:e2e_request_latency_seconds_count") == NUM_CLIENTS
    assert grew("jaxserve:time_per_output_token_seconds_count") == NUM_CLIENTS  # every one made > 1 token
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"jaxserve:{gauge}"] == 0.0


def test_a_client_gone_before_its_whole_response_aborts_the_request(served):
    body = {"model": served.model, "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0.0}
    body["ignore_eos"] = True
    before = served.metrics()
    with pytest.raises(requests.exceptions.ReadTimeout):  # the client gives up and closes its connection
        requests.post(
            f"{served.url}/v1/completions",
            json=body,
            headers={"Authorization": f"Bearer {served.api_key}"},
            timeout=(10, 1.0),
        )
    assert served.frontend.wait_idle(60)
    after = served.metrics()
    aborted = 'jaxserve:request_success_total{finished_reason="abort"}'
    assert after[aborted] - before.get(aborted, 0.0) == 1
    generated = after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"]
    assert generated < 200, "aborted before its max_tokens"
    assert served.llm.engine.block_manager.num_used_blocks == 0


def test_the_engine_loop_summary_counts_its_rounds_and_steps(served):
    """What the engine loop logs when it ends: its rounds, and each replica's steps as the bench counts them."""
    driver = served.frontend.backend.driver
    engine = served.llm.engine
    assert served.frontend.wait_idle(60)
    before = driver._rounds
    served.client().completions.create(model=served.model, prompt="Hello", max_tokens=4, temperature=0.0)
    assert served.frontend.wait_idle(60)
    assert driver._rounds - before >= 4  # a prefill and at least three decode steps, a round each
    summary = driver.summary()
    rounds = re.search(r"engine loop: (\d+) rounds, per round ([\d.]+) ms stepping and ([\d.]+) ms", summary)
    assert rounds is not None and int(rounds.group(1)) == driver._rounds, summary
    assert float(rounds.group(2)) > 0
    steps = re.search(
        r"replica 0: (\d+) steps, host ([\d.]+) ms \(dispatch ([\d.]+)\), decode step ([\d.]+) ms", summary
    )
    assert steps is not None and int(steps.group(1)) == len(engine.stats), summary
    assert 0 < float(steps.group(3)) <= float(steps.group(2))

"""`jaxserve serve --data-parallel-size 2`: the server drives both replicas of the LLM. Concurrent requests,
and the prompts of one request, spread over the replicas by load and get the greedy tokens of a one-replica
offline LLM; afterwards no replica has work or blocks left; a failing step fails only its replica's request.

jax fixes its device count when it starts, so the server runs in one fresh process with four host devices
(XLA_FLAGS=--xla_force_host_platform_device_count=4) on a tiny random model whose text is its token ids, and
reports one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

SERVER_TESTS = Path(__file__).resolve().parent

CHECK = textwrap.dedent(
    """
    import json, sys
    from concurrent.futures import ThreadPoolExecutor
    sys.path.insert(0, {server_tests!r})
    import jax, numpy as np, openai
    from conftest import start_server, stop_server
    from jaxserve.cli import build_parser, served_llm
    from jaxserve.sampling import SamplingParams
    from jaxserve.server.config import ServerConfig

    assert jax.device_count() == 4, jax.devices()
    FLAGS = ["--random-weights", "tiny-llama", "--dtype=float32", "--max-seq-len=64", "--max-batch-size=4"]
    FLAGS += ["--max-num-tokens=16", "--decode-batch-sizes=4", "--token-buckets=16", "--no-penalty-variants"]
    NEW_TOKENS = 6
    rng = np.random.default_rng(0)
    PROMPTS = [rng.integers(0, 160, n).tolist() for n in (3, 11, 7, 14, 1, 9, 5, 12)]

    offline, name = served_llm(build_parser().parse_args(["serve", *FLAGS]))
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, greedy, use_tqdm=False)]
    offline.close()

    llm, _ = served_llm(build_parser().parse_args(["serve", *FLAGS, "--data-parallel-size", "2"]))
    served = [[] for _ in llm.engines]  # the request ids each replica was given
    for replica, engine in enumerate(llm.engines):
        def add_request(*args, _add=engine.add_request, _ids=served[replica], **kwargs):
            _ids.append(_add(*args, **kwargs))
            return _ids[-1]
        engine.add_request = add_request
    running = start_server(llm, ServerConfig(name, None, 1 << 20))
    client = openai.OpenAI(base_url=f"{{running[0].url}}/v1", api_key="none", max_retries=0)

    def complete(prompt):
        answer = client.completions.create(
            model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, extra_body={{"ignore_eos": True}}
        )
        return [[int(t) for t in c.text.split()] for c in sorted(answer.choices, key=lambda c: c.index)]

    def idle():
        frontend = running[0].frontend
        replicas = frontend.backend.driver.replicas  # where the server routes
        return frontend.wait_idle(60) and all(
            not e.has_unfinished() and e.block_manager.num_used_blocks == 0 for e in llm.engines
        ) and replicas.loads == [0, 0] and not replicas.routes

    # The openai client's response models build their pydantic schemas lazily on first use, and two threads
    # building one at once can read pydantic's placeholder (a race in the client library): one request from
    # this thread builds them before the concurrent ones.
    complete(PROMPTS[0])
    assert idle()
    for ids in served:
        ids.clear()
    results = {{}}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = [tokens for [tokens] in pool.map(complete, PROMPTS)]
    results["concurrent"] = dict(
        matches=concurrent == expected, served=[len(s) for s in served], idle=idle(),
        unique_ids=len({{i for s in served for i in s}}) == sum(len(s) for s in served),
    )
    before = [len(s) for s in served]
    results["one_request"] = dict(
        matches=complete(PROMPTS) == expected, served=[len(s) - b for s, b in zip(served, before)], idle=idle(),
    )

    # Replica 1's next step raises: the request spread over both replicas fails (a 500), its prompt on
    # replica 0 is aborted, not failed; then both replicas serve on.
    runner = llm.engines[1].runner
    failures, run = iter(range(1)), runner.run
    def failing_run(*args, **kwargs):
        if next(failures, None) is not None:
            raise RuntimeError("injected step failure")
        return run(*args, **kwargs)
    runner.run = failing_run
    error_metric = 'jaxserve:request_success_total{{finished_reason="error"}}'
    abort_metric = 'jaxserve:request_success_total{{finished_reason="abort"}}'
    errors_before = running[0].metrics().get(error_metric, 0.0)
    aborts_before = running[0].metrics().get(abort_metric, 0.0)
    try:
        complete(PROMPTS[:2])
        status = 200
    except openai.APIStatusError as error:
        status = error.status_code
    settled = idle()  # the failed request's final output counted
    errors = running[0].metrics().get(error_metric, 0.0) - errors_before
    aborted = running[0].metrics().get(abort_metric, 0.0) - aborts_before
    results["failed_step"] = dict(
        status=status, errors=errors, aborted=aborted, after=complete(PROMPTS) == expected, idle=settled and idle(),
    )
    metrics = running[0].metrics()
    results["metrics"] = dict(
        running=metrics["jaxserve:num_requests_running"], waiting=metrics["jaxserve:num_requests_waiting"],
        kv_usage=metrics["jaxserve:kv_cache_usage_perc"],
        length=metrics['jaxserve:request_success_total{{finished_reason="length"}}'],
        generation_tokens=metrics["jaxserve:generation_tokens_total"],
    )
    stop_server(*running)
    llm.close()
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = CHECK.format(server_tests=str(SERVER_TESTS))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_concurrent_requests_get_the_offline_greedy_tokens_from_both_replicas(results):
    concurrent = results["concurrent"]
    assert concurrent["matches"], "the served tokens differ from the one-replica offline LLM's"
    assert all(n > 0 for n in concurrent["served"]) and sum(concurrent["served"]) == 8, concurrent["served"]
    assert concurrent["unique_ids"]
    assert concurrent["idle"], "a replica kept work, blocks or load after the requests finished"


def test_the_prompts_of_one_request_spread_evenly_by_load(results):
    one_request = results["one_request"]
    assert one_request["matches"] and one_request["idle"]
    assert one_request["served"] == [4, 4], "eight prompts submitted at once were not balanced by load"


def test_a_failing_step_fails_only_its_replicas_request(results):
    failed = results["failed_step"]
    assert failed["status"] == 500
    assert failed["errors"] == 1, "the other replica's request was failed too (or none was)"
    assert failed["after"] and failed["idle"], "the replicas did not serve on after the failed step"


def test_metrics_are_summed_over_the_replicas(results):
    metrics = results["metrics"]
    assert metrics["running"] == 0 and metrics["waiting"] == 0 and metrics["kv_usage"] == 0
    # The warm-up request, the concurrent ones, one request of eight, the eight after the failure; and the failed
    # request's prompt on replica 0, unless it was aborted first (its 6 tokens can be done before the failure on
    # replica 1 reaches it: a race between the replicas, which either way finishes that prompt once).
    aborted = results["failed_step"]["aborted"]
    assert aborted in (0, 1)
    assert metrics["length"] + aborted == 1 + 8 * 3 + 1
    assert metrics["generation_tokens"] >= (1 + 8 * 3) * 6

"""Data parallelism: `LLM(data_parallel_size=2)` on a 4-device CPU mesh, without and with tensor
parallelism, gives the dense reference's greedy tokens on every request of a batch spread over both
replicas; streams, aborts and update_weights work across replicas; bad sizes are clear errors.

jax fixes its device count when it starts, so the checks run in one fresh process with four host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=4) and report one JSON object.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.llm import LLM

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"

CHECK = textwrap.dedent(
    """
    import dataclasses, json, sys
    sys.path.insert(0, {engine_tests!r})
    import jax, numpy as np
    from jax.sharding import Mesh
    from conftest import _make_llm, _tiny_model
    from jaxserve import bench
    from jaxserve.dense import generate_dense
    from jaxserve.sampling import SamplingParams

    assert jax.device_count() == 4, jax.devices()
    NEW_TOKENS = 6
    GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    rng = np.random.default_rng(0)
    PROMPTS = [rng.integers(0, 160, n).tolist() for n in (3, 17, 9, 30, 1, 24, 12, 40)]
    model, new_model = _tiny_model("llama", seed=0), _tiny_model("llama", seed=1)

    def reference(m, prompts=PROMPTS):
        return generate_dense(m.family, m.config, m.weights, prompts, NEW_TOKENS)

    def record_requests(llm):
        # The request ids each replica was given.
        served = [[] for _ in llm.engines]
        for replica, engine in enumerate(llm.engines):
            def add_request(*args, _add=engine.add_request, _ids=served[replica], **kwargs):
                _ids.append(_add(*args, **kwargs))
                return _ids[-1]
            engine.add_request = add_request
        return served

    def tokens(llm, prompts=PROMPTS):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    def idle(llm):
        return all(
            not e.has_unfinished() and e.block_manager.num_free_blocks == e.block_manager.num_usable_blocks
            for e in llm.engines
        )

    def devices(llm):
        return [sorted(d.id for d in e.runner.mesh.devices.flat) for e in llm.engines]

    expected, new_expected = reference(model), reference(new_model)
    results = {{}}

    llm = _make_llm(model, data_parallel_size=2)
    served = record_requests(llm)
    results["dp2"] = dict(
        devices=devices(llm), matches=tokens(llm) == expected, served=[len(s) for s in served], idle=idle(llm),
        unique_ids=len({{i for s in served for i in s}}) == sum(len(s) for s in served),
        steps=[len(e.stats) for e in llm.engines], step_stats=len(llm.step_stats),
        summary=dataclasses.asdict(bench.engine_summary(llm, 0.0, 0.0)),
        replica_blocks=[e.kv_budget.num_blocks for e in llm.engines],
    )

    # Two streams, one per replica: closing the second aborts it; the first runs to the reference's tokens.
    kept, dropped = llm.stream(PROMPTS[1], GREEDY), llm.stream(PROMPTS[3], GREEDY)
    next(dropped)
    dropped.close()
    partials = [o.outputs[0].token_ids for o in kept]
    llm._drain()
    owners = [len(s) for s in served]
    results["stream"] = dict(
        growing=[len(p) for p in partials] == list(range(1, NEW_TOKENS + 1)), final=partials[-1] == expected[1],
        served=owners, idle=idle(llm), after_abort=tokens(llm) == expected,
    )

    version = llm.update_weights(new_model.weights)
    served_before = [len(s) for s in served]
    new_tokens = tokens(llm)
    results["update_weights"] = dict(
        version=version, matches=new_tokens == new_expected, changed=new_tokens != expected,
        served=[len(s) - b for s, b in zip(served, served_before)], idle=idle(llm),
    )
    llm.sleep(1)
    llm.wake_up()
    results["sleep"] = dict(matches=tokens(llm) == new_expected)
    llm.close()
    results["closed"] = all(e.closed for e in llm.engines)

    # tp=2 x dp=2 through a mesh: the replicas are the two rows of its "data" axis.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    llm = _make_llm(model, mesh=mesh, data_parallel_size=2)
    served = record_requests(llm)
    results["tp2_dp2"] = dict(
        devices=devices(llm), matches=tokens(llm) == expected, served=[len(s) for s in served], idle=idle(llm),
        model_axis=[int(e.runner.mesh.shape["model"]) for e in llm.engines],
    )
    llm.close()
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK.format(engine_tests=str(ENGINE_TESTS)), num_devices=4)


def test_dp2_gives_the_dense_tokens_on_every_request_spread_over_both_replicas(results):
    dp2 = results["dp2"]
    assert dp2["devices"] == [[0], [1]]
    assert dp2["matches"], "dp=2 tokens differ from the dense reference"
    assert dp2["served"] == [4, 4], "the batch was not spread evenly by load"
    assert dp2["unique_ids"] and dp2["idle"]
    assert all(n > 0 for n in dp2["steps"]) and dp2["step_stats"] == sum(dp2["steps"])
    summary = dp2["summary"]  # what `jaxserve bench` reports: the pool over both replicas
    assert (summary["data_parallel_size"], summary["tensor_parallel_size"]) == (2, 1)
    assert summary["kv_blocks"] == sum(dp2["replica_blocks"])


def test_dp2_streams_and_aborts_on_either_replica(results):
    stream = results["stream"]
    assert stream["growing"] and stream["final"]
    assert stream["served"] == [4 + 1, 4 + 1], "the two streams were meant to go to different replicas"
    assert stream["idle"], "the aborted stream's blocks were not freed"
    assert stream["after_abort"]


def test_dp2_update_weights_reaches_every_replica(results):
    update = results["update_weights"]
    assert update["version"] == 1
    assert update["changed"] and update["matches"], "the tokens are not the new weights' reference"
    assert update["served"] == [4, 4] and update["idle"]
    assert results["sleep"]["matches"] and results["closed"]


def test_tp2_dp2_on_a_mesh_gives_the_dense_tokens(results):
    tp2_dp2 = results["tp2_dp2"]
    assert tp2_dp2["devices"] == [[0, 1], [2, 3]] and tp2_dp2["model_axis"] == [2, 2]
    assert tp2_dp2["matches"], "tp=2 x dp=2 tokens differ from the dense reference"
    assert tp2_dp2["served"] == [4, 4] and tp2_dp2["idle"]


# ---- bad sizes: refused before the model is loaded -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(data_parallel_size=0), ValueError, "data_parallel_size must be an int >= 1, got 0"),
        (dict(data_parallel_size=1.5), TypeError, "data_parallel_size must be an int >= 1"),
        (dict(data_parallel_size=True), TypeError, "data_parallel_size must be an int >= 1"),
        (dict(data_parallel_size=None), TypeError, "data_parallel_size must be an int >= 1"),
        (dict(data_parallel_size=jax.device_count() + 1), ValueError, "devices, but only"),
        (dict(data_parallel_size=2, tensor_parallel_size=jax.device_count()), ValueError, "devices, but only"),
    ],
)
def test_bad_data_parallel_sizes_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        LLM("no/such/model", **kwargs)


def test_data_parallel_size_must_divide_the_mesh_data_axis():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="data_parallel_size=2 must divide the mesh's data-parallel axis"):
        LLM("no/such/model", mesh=mesh, data_parallel_size=2)

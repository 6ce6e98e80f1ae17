"""The experts' layout as an engine option (`enable_expert_parallel`): on a tp=2 CPU mesh it reaches the weights'
shardings (expert weights split on E under expert parallelism, on F otherwise) and the step, both layouts give the
dense reference's greedy tokens for a tiny Qwen3-MoE; a dense model ignores it with a warning, experts that do not
divide over tp are refused when it is asked for, and the CLI flags parse into the LLM keyword.

jax fixes its device count when it starts, so the engine checks run in a fresh process with two host devices.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest

from jaxserve.cli import _engine_keywords
from jaxserve.cli_args import build_parser
from jaxserve.config import EngineConfig
from jaxserve.models.layers import LayerMlp
from jaxserve.runner import EXPERT_PARALLEL_DEFAULT, resolve_expert_parallel

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"

CHECK = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {engine_tests!r})
    import jax, jax.numpy as jnp, numpy as np, transformers
    from conftest import _TINY_HF, _make_llm
    from jaxserve.dense import generate_dense
    from jaxserve.models import registry
    from jaxserve.models.loader import LoadedModel
    from jaxserve.sampling import SamplingParams

    assert jax.device_count() == 2, jax.devices()
    hf = transformers.Qwen3MoeConfig(**{{**_TINY_HF, "head_dim": 16, "num_hidden_layers": 3, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1]}})
    hf.architectures = ["Qwen3MoeForCausalLM"]
    family, cfg = registry.resolve(hf.to_dict())
    weights = family.init_weights(cfg, jax.random.key(0), jnp.float32)
    model = LoadedModel(family, cfg, weights, hf.to_dict(), None, "tiny")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 160, n).tolist() for n in (5, 19, 11)]
    expected = generate_dense(family, cfg, model.weights, prompts, 5)
    results = {{}}
    for flag in (False, True, None):
        llm = _make_llm(model, tensor_parallel_size=2, enable_expert_parallel=flag)
        engine = llm.engine
        experts = engine.runner.weights.arrays.layers[0].mlp
        outputs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outputs]
        results[str(flag)] = dict(
            resolved=engine.runner.spec.expert_parallel,
            gate_up=[str(a) for a in experts.w_gate_up.sharding.spec],
            down=[str(a) for a in experts.w_down.sharding.spec],
            shard=list(experts.w_gate_up.addressable_shards[0].data.shape),
            kv=[str(a) for a in engine.runner.kv_cache.k.sharding.spec],
            matches=tokens == expected,
        )
        llm.close()
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results(run_with_host_devices) -> dict:
    return run_with_host_devices(CHECK.format(engine_tests=str(ENGINE_TESTS)), num_devices=2)


@pytest.mark.parametrize("flag", [False, True])
def test_the_flag_reaches_the_expert_weights_and_both_layouts_give_the_dense_tokens(results, flag):
    result = results[str(flag)]
    assert result["resolved"] is flag
    if flag:  # 2 of the 4 whole experts a device
        assert result["gate_up"] == ["model", "None", "None", "None"] and result["down"] == ["model", "None", "None"]
        assert result["shard"] == [2, 64, 2, 32]
    else:  # every expert, half its hidden
        assert result["gate_up"] == ["None", "None", "None", "model"] and result["down"] == ["None", "model", "None"]
        assert result["shard"] == [4, 64, 2, 16]
    assert result["kv"] == results["False"]["kv"], "the KV pool's split does not depend on the experts' layout"
    assert result["matches"], f"enable_expert_parallel={flag}: greedy tokens differ from the dense reference"


def test_the_default_is_the_measured_layout(results):
    assert results["None"]["resolved"] is EXPERT_PARALLEL_DEFAULT and results["None"]["matches"]


# ---- resolving the option, without devices ---------------------------------------------------------


class _Moe:
    """What `resolve_expert_parallel` reads of a config: each layer's MLP."""

    def __init__(self, *mlps: LayerMlp) -> None:
        self.mlp_layers = mlps


class _Dense:
    pass


EXPERTS_5 = _Moe(LayerMlp(32), LayerMlp(32, num_experts=5, top_k=2))


def test_experts_that_do_not_divide_over_tp_are_refused_under_expert_parallelism():
    with pytest.raises(
        ValueError, match=r"5 experts do not divide over tensor_parallel_size=2.*enable_expert_parallel"
    ):
        resolve_expert_parallel(True, EXPERTS_5, 2)


def test_the_default_and_false_keep_indivisible_experts_tensor_parallel():
    assert resolve_expert_parallel(None, EXPERTS_5, 2) is False
    assert resolve_expert_parallel(False, EXPERTS_5, 2) is False


def test_one_device_has_nothing_to_split():
    assert resolve_expert_parallel(True, EXPERTS_5, 1) is False


def test_a_dense_model_ignores_the_flag_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.runner"):
        assert resolve_expert_parallel(True, _Dense(), 2) is False
    assert "enable_expert_parallel=True is ignored" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve.runner"):
        assert resolve_expert_parallel(None, _Dense(), 2) is False
        assert resolve_expert_parallel(False, _Dense(), 2) is False
    assert not caplog.text


def test_the_engine_config_checks_the_flag():
    with pytest.raises(ValueError, match="enable_expert_parallel must be None or a bool, got 'yes'"):
        EngineConfig(8, 64, 128, enable_expert_parallel="yes")


# ---- the CLI flag ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "value"),
    [([], None), (["--enable-expert-parallel"], True), (["-ep"], True), (["--no-enable-expert-parallel"], False)],
)
@pytest.mark.parametrize("command", [["bench", "throughput"], ["bench", "latency"], ["serve"]])
def test_the_cli_flag_parses_into_the_llm_keyword(command, flags, value):
    args = build_parser().parse_args([*command, *flags])
    assert args.enable_expert_parallel is value
    assert _engine_keywords(args)["enable_expert_parallel"] is value

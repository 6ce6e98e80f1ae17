"""benchmarks/schedule_sim.py's cost model: a mixture of experts' flops are its active parameters' and a step reads
the experts its tokens hit, E * (1 - (1 - k/E)^T) of each layer's E; the published parameter counts of the MoE
shapes come out of it; a dense model's costs are what they were."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "schedule_sim.py"
_spec = importlib.util.spec_from_file_location("schedule_sim", _PATH)
schedule_sim = importlib.util.module_from_spec(_spec)
sys.modules["schedule_sim"] = schedule_sim  # dataclasses look their module up
_spec.loader.exec_module(schedule_sim)


def test_experts_hit_is_the_expected_count_under_uniform_routing():
    costs = schedule_sim.model_costs("qwen3-30b-a3b")
    assert (costs.num_experts, costs.top_k) == (128, 8)
    assert costs.experts_hit(1) == pytest.approx(8)
    assert costs.experts_hit(2) == pytest.approx(128 * (1 - (120 / 128) ** 2))  # 15.5: some pairs share one
    assert costs.experts_hit(10_000) == pytest.approx(128)
    assert costs.experts_hit(0) == 0


@pytest.mark.parametrize(
    ("shape", "total", "active"),
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],  # the models' published counts
)
def test_moe_costs_count_the_published_parameters(shape, total, active):
    costs = schedule_sim.model_costs(shape)
    # Per token: the layers' active matrices and lm_head; the published active count adds the embedding.
    assert costs.layer_params + 2 * costs.head_params == pytest.approx(active, rel=0.02)
    # A step whose tokens hit every expert reads every bf16 weight.
    assert costs.step_weight_bytes(100_000) / 2 == pytest.approx(total, rel=0.01)
    # One token reads the always-read weights and its top_k experts of each layer.
    assert costs.step_weight_bytes(1) == pytest.approx(costs.weight_bytes + costs.top_k * costs.expert_bytes)


def test_a_dense_model_reads_every_weight_whatever_its_tokens():
    costs = schedule_sim.model_costs("llama-3.1-8b")
    assert costs.num_experts == 0 and costs.expert_bytes == 0
    assert costs.weight_bytes == pytest.approx(16.06e9, rel=1e-3)
    assert costs.step_weight_bytes(1) == costs.step_weight_bytes(4096) == costs.weight_bytes


def test_fp8_weights_and_kv_cost_one_byte_a_value_but_embedding_and_lm_head():
    bf16, fp8 = schedule_sim.model_costs("llama-3.1-8b"), schedule_sim.model_costs("llama-3.1-8b", True, True)
    assert fp8.weight_bytes == pytest.approx(9.08e9, rel=1e-3)  # 6.98 GB of e4m3 linears + 2 x 1.05 GB bf16
    assert fp8.kv_bytes * 2 == bf16.kv_bytes and fp8.layer_params == bf16.layer_params
    # A prefill-sized step is flops-bound: its layers' GEMMs at the FP8 rate, the lm_head's at the bf16 one.
    rates = SimpleNamespace(bandwidth=1e3, matmul_tflops=500.0, fp8_tflops=1000.0, overhead_ms=0.0, quantization="fp8")
    expected_ms = 1e3 * (2 * fp8.layer_params * 8192 / 1e15 + 2 * fp8.head_params * 4 / 5e14)
    assert schedule_sim.step_cost_ms(fp8, 8192, 4, [], [], rates) == pytest.approx(expected_ms)


def test_a_moe_decode_step_costs_the_experts_it_hits():
    costs = schedule_sim.model_costs("qwen3-30b-a3b")
    rates = SimpleNamespace(bandwidth=1.0, matmul_tflops=1e6, overhead_ms=0.0, quantization=None)  # 1 TB/s
    for rows in (1, 8, 64):
        expected_ms = 1e3 * costs.step_weight_bytes(rows) / 1e12
        assert schedule_sim.step_cost_ms(costs, rows, rows, [], [], rates) == pytest.approx(expected_ms)

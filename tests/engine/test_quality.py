"""Quality of FP8 serving on the real default model (SmolLM2-135M-Instruct, float32 on the CPU), by
benchmarks/quality.py's measures: perplexity of its held text and the accuracy of the batch_eval notebook's 16
questions. FP8 weights with an FP8 KV cache (one engine: each scoring engine costs minutes on a 2-core CPU) stay
within the measured bounds of the unquantized engine, and the same engine with its FP8 scales permuted within
each output axis (a transposed channel) does not: the bounds are tight enough to catch a wrong scale. Measured
(docs/performance.md, "FP8: quality"): perplexity 26.50 -> 27.51 (FP8 weights), 27.68 (and FP8 KV); accuracy
0.75 -> 0.81, 0.75."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import pytest

from jaxserve.models import quant

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
_spec = importlib.util.spec_from_file_location("quality", _PATH)
quality = importlib.util.module_from_spec(_spec)
sys.modules["quality"] = quality  # its dataclass looks its module up while the module runs
_spec.loader.exec_module(quality)

PERPLEXITY_RATIO = 1.06  # measured 1.038 (fp8 / float32), 1.045 with the FP8 KV cache too
ACCURACY_DROP = 1 / 16  # at most one question of the 16 lost


@pytest.fixture(scope="module")
def base_quality(smollm2):
    loaded, _ = smollm2
    llm = quality.scoring_llm(loaded, "float32")
    yield quality.measure(llm, "base")
    llm.close()


@pytest.fixture(scope="module")
def fp8_llm(smollm2):
    """FP8 weights with an FP8 KV cache: every FP8 path of the engine at once (the weights-only and KV-only figures
    are benchmarks/quality.py's; their greedy tokens against the dense reference are tests/engine/test_fp8.py's)."""
    loaded, _ = smollm2
    llm = quality.scoring_llm(loaded, "float32", quantization="fp8", kv_cache_dtype="fp8")
    yield llm
    llm.close()


def test_fp8_weights_and_fp8_kv_keep_perplexity_and_accuracy(base_quality, fp8_llm):
    both = quality.measure(fp8_llm, "fp8+fp8_kv")
    assert base_quality.perplexity < both.perplexity <= PERPLEXITY_RATIO * base_quality.perplexity
    assert both.accuracy >= base_quality.accuracy - ACCURACY_DROP


def _permuted_scales(tree):
    """Every FP8 weight with its scale reversed along its last output axis: each channel scaled by another's."""

    def permute(leaf):
        if isinstance(leaf, quant.Fp8Weight):
            return dataclasses.replace(leaf, scale=leaf.scale[..., ::-1])
        return leaf

    return jax.tree.map(permute, tree, is_leaf=lambda x: isinstance(x, quant.Fp8Weight))


def test_a_wrong_scale_breaks_the_bounds(base_quality, fp8_llm):
    weights = fp8_llm.engine.runner.weights
    original = weights.arrays
    weights.arrays = _permuted_scales(original)
    try:
        broken = quality.perplexity(fp8_llm)  # the held text only: the questions' prompts cost most of the time
    finally:
        weights.arrays = original
    assert broken > PERPLEXITY_RATIO * base_quality.perplexity

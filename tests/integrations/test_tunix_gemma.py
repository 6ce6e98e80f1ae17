"""`JaxserveRollout` of tiny random-weight tunix Gemma, Gemma 2 and Gemma3 models, with and without qwix LoRA: the
rollout's per-token logps equal tunix's own forward; the tunix Gemma configs that no Hugging Face config describes
are refused. The models: tests/tunix_models.py.

Needs google-tunix (`pip install -e ".[tunix]"`; CI runs this file in its Python 3.12 virtualenv).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

pytest.importorskip("tunix", reason='google-tunix is not installed: pip install -e ".[tunix]" (Python >= 3.11)')

from flax import nnx  # noqa: E402
from tunix.models.gemma import model as gemma  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix_models import (  # noqa: E402
    ENGINE,
    LORA_ALPHA,
    PAD,
    VOCAB,
    CharTokenizer,
    check_logps_match_tunix,
    padded_completions,
    rollout_config,
    tiny_gemma,
    tiny_lora_gemma,
    tunix_logps,
)

from jaxserve.integrations.tunix import JaxserveRollout, gemma3_hf_config, gemma_hf_config  # noqa: E402
from jaxserve.models import registry  # noqa: E402

pytestmark = [pytest.mark.needs_tunix, pytest.mark.usefixtures("unoptimized_compiles")]  # tests/conftest.py says why


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


@pytest.mark.parametrize("version", [1, 2, 3])
def test_gemma_rollout_logps_equal_tunix_forward(mesh, version):
    """Gemma 2 on prompts that need no padding: tunix's Gemma (google-tunix 0.1.7) places its sliding window
    by comparing key indices with query positions, so left padding moves a padded row's window in tunix's
    forward (its Gemma3 compares indices with indices, and padded batches agree)."""
    model = tiny_gemma(version, seed=0)
    config = rollout_config()
    rollout = JaxserveRollout(model, CharTokenizer(), mesh, config, **ENGINE)
    assert rollout.llm.model.config.version == version
    if version == 2:  # BOS + 15 tokens each: max_prompt_length, so no row is padded
        prompts = ["hello there you", "what is two plu", "a cat and a dog"]
    else:  # BOS + 21 tokens: past the windows of 8, and padded to 32
        prompts = ["hello there", "what is two plus two?", "a"]
    out = rollout.generate(prompts, config)
    assert (out.left_padded_prompt_tokens != PAD).all() == (version == 2)
    check_logps_match_tunix(model, out, config)
    assert np.ptp(np.concatenate(out.logprobs)) > 1.0, "a distribution far from uniform"

    trained = tiny_gemma(version, seed=1)
    rollout.update_params(nnx.state(trained, nnx.Param), (nnx.Param,))
    greedy = rollout_config(temperature=0.0)
    check_logps_match_tunix(trained, rollout.generate(prompts[:2], greedy), greedy)


@pytest.mark.parametrize("version", [2, 3])
def test_gemma_lora_rollout_logps_equal_tunix_forward(mesh, version):
    """A Gemma 2 (the fused qkv einsum) and a Gemma3 (q and kv einsums) trained with qwix LoRA: served as the base
    model plus the adapter, their logprobs are tunix's forward with the adapter applied."""
    model = tiny_lora_gemma(version, seed=0)
    config = rollout_config(temperature=0.0)
    rollout = JaxserveRollout(model, CharTokenizer(), mesh, config, lora_alpha=LORA_ALPHA, **ENGINE)
    assert rollout.llm.list_loras() == ["actor"]
    # BOS + 15 tokens each: no padded row (Gemma 2's window in tunix's forward; see the test above).
    prompts = ["hello there you", "what is two plu"]
    out = rollout.generate(prompts, config)
    check_logps_match_tunix(model, out, config)
    without = tunix_logps(
        tiny_gemma(version, seed=0), out.left_padded_prompt_tokens, padded_completions(out.tokens), 1.0
    )
    assert not np.allclose(out.logprobs[0], without[0, : len(out.tokens[0])], atol=1e-2), "the adapter is applied"


def test_gemma_configs_without_a_hugging_face_counterpart_are_refused():
    full = gemma.AttentionType.GLOBAL
    half = gemma.ModelConfig(
        num_layers=1,
        num_embed=VOCAB,
        embed_dim=64,
        hidden_dim=96,
        num_heads=4,
        head_dim=16,
        num_kv_heads=1,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=False,
        attention_types=(full,),
    )
    with pytest.raises(ValueError, match="use_post_attn_norm=True, use_post_ffw_norm=False.* is neither a Gemma"):
        gemma_hf_config(half, 64)
    # Both post norms and no soft-caps: a Gemma 2 whose caps are written null, which jaxserve reads as none.
    uncapped = dataclasses.replace(half, use_post_ffw_norm=True, attn_logits_soft_cap=None)
    hf = gemma_hf_config(uncapped, 64)
    assert hf["model_type"] == "gemma2"
    assert hf["attn_logit_softcapping"] is None and hf["final_logit_softcapping"] is None
    _, cfg = registry.resolve(hf)
    assert cfg.final_logit_soft_cap is None and all(layer.soft_cap is None for layer in cfg.attention_layers)
    scaled = gemma3.ModelConfig(
        num_layers=1, num_embed=VOCAB, embed_dim=64, hidden_dim=96, num_heads=4, head_dim=16, num_kv_heads=1,
        sliding_window_size=8, local_scale_factor=2.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="local_scale_factor=2.0"):
        gemma3_hf_config(scaled, 64)

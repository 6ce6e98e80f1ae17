"""Tiny random-weight tunix models (Llama3, Gemma, Gemma 2, Gemma3, with and without qwix LoRA), the rollout
settings and tunix's own per-token logps that tests/integrations/test_tunix*.py check `JaxserveRollout` against.
Imported after those files' importorskip of tunix."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from tunix.models.gemma import model as gemma
from tunix.models.gemma3 import model as gemma3
from tunix.models.llama3 import model as llama3
from tunix.rl import common
from tunix.rl.rollout import base_rollout

from jaxserve.config import CompileConfig

PAD, BOS, EOS = 0, 1, 2
VOCAB = 64
MAX_PROMPT = 16
MAX_NEW = 8
ENGINE = dict(
    max_batch_size=4,
    max_num_tokens=64,
    compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(64,), penalty_variants=False),
    attention_backend="xla",
)


class CharTokenizer:
    """Lowercase letters and a few marks, one id each after PAD, BOS and EOS (tunix's custom-tokenizer
    interface: encode, decode, bos_id, eos_id, pad_id)."""

    CHARS = "abcdefghijklmnopqrstuvwxyz ?.!"

    def encode(self, text: str, **kwargs) -> list[int]:
        return [3 + self.CHARS.index(c) for c in text]

    def decode(self, ids, **kwargs) -> str:
        return "".join(self.CHARS[i - 3] if 3 <= i < 3 + len(self.CHARS) else f"<{i}>" for i in ids)

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return EOS

    def pad_id(self) -> int:
        return PAD


def tiny_llama3(seed: int) -> llama3.Llama3:
    config = llama3.ModelConfig(
        num_layers=2,
        vocab_size=VOCAB,
        embed_dim=64,
        hidden_dim=96,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        rope_theta=10_000,
        norm_eps=1e-5,
    )
    model = llama3.Llama3(config, rngs=nnx.Rngs(seed))
    # Larger logits than tunix's unit-normal init gives a 64-wide model, so that sampling is not uniform.
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 3.0, state))
    return model


LORA_ALPHA = 8.0


def tiny_lora_llama3(seed: int, rank: int = 4) -> llama3.Llama3:
    """`tiny_llama3` with qwix LoRA on all seven projections, its B random (qwix starts it at zero) and large
    enough to move the logprobs."""
    modules = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
    base = tiny_llama3(seed)
    model = qwix.apply_lora_to_model(
        base, qwix.LoraProvider(module_path=modules, rank=rank, alpha=LORA_ALPHA), **base.get_model_input()
    )
    randomize_lora(model, seed)
    return model


def randomize_lora(model, seed: int) -> None:
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.LoRAParam))
    rng = np.random.default_rng(seed + 100)
    nnx.update(
        model, jax.tree.unflatten(treedef, [jnp.asarray(rng.standard_normal(x.shape) * 0.5, x.dtype) for x in leaves])
    )


def tiny_gemma(version: int, seed: int) -> gemma.Gemma | gemma3.Gemma3:
    """A tunix Gemma (version 1: one kv head), Gemma 2 (as many kv heads as query heads: the fused qkv einsum)
    or Gemma3 (grouped kv heads, one full layer after five sliding ones, rope bases and query scale unlike
    their defaults), with windows shorter than the longest prompt and soft-caps that bind."""
    sizes = dict(num_embed=VOCAB, embed_dim=64, hidden_dim=96, num_heads=4)
    if version == 3:
        config = gemma3.ModelConfig(
            **sizes,
            num_layers=6,
            head_dim=32,
            num_kv_heads=2,
            sliding_window_size=8,
            local_base_frequency=100,
            global_base_frequency=1_000_000,
            global_scale_factor=4.0,
            query_pre_attn_norm=gemma3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
            param_dtype=jnp.float32,
        )
        module = functools.partial(gemma3.Gemma3, config)
    else:
        local, full = gemma.AttentionType.LOCAL_SLIDING, gemma.AttentionType.GLOBAL
        v2 = version == 2
        config = gemma.ModelConfig(
            **sizes,
            num_layers=3 if v2 else 2,
            head_dim=16,
            num_kv_heads=4 if v2 else 1,
            final_logit_softcap=2.0 if v2 else None,
            use_post_attn_norm=v2,
            use_post_ffw_norm=v2,
            attention_types=(local, full, local) if v2 else (full, full),
            attn_logits_soft_cap=1.0 if v2 else None,
            sliding_window_size=8 if v2 else None,
        )
        module = functools.partial(gemma.Gemma, config)
    # Every parameter random (tunix starts norm scales and MLP kernels at zero, which would hide a misplaced
    # norm or MLP weight), drawn with numpy into an abstract model: tunix's initialisers compile per shape.
    model = nnx.eval_shape(lambda: module(rngs=nnx.Rngs(seed)))
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    rng = np.random.default_rng(seed)
    fresh = [
        jnp.asarray(rng.standard_normal(x.shape, np.float32) * (0.2 if len(x.shape) == 1 else 0.125)) for x in leaves
    ]
    nnx.update(model, jax.tree.unflatten(treedef, fresh))
    return model


def rollout_config(**overrides) -> base_rollout.RolloutConfig:
    fields = dict(
        max_tokens_to_generate=MAX_NEW,
        max_prompt_length=MAX_PROMPT,
        kv_cache_size=64,
        temperature=0.9,
        top_p=1.0,
        top_k=None,
        return_logprobs=True,
    )
    return base_rollout.RolloutConfig(**{**fields, **overrides})


def tunix_logps(model, prompt_tokens, completion_tokens, temperature) -> np.ndarray:
    """tunix's own per-token logps of its own model forward (what its trainer computes for the actor)."""
    graphdef, state = nnx.split(model)
    logps = common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=jnp.asarray(prompt_tokens),
        completion_tokens=jnp.asarray(completion_tokens),
        pad_id=PAD,
        eos_id=EOS,
        temperature=temperature,
    )
    return np.asarray(logps)


def padded_completions(tokens: list[np.ndarray]) -> np.ndarray:
    out = np.full((len(tokens), MAX_NEW), PAD, np.int32)
    for i, t in enumerate(tokens):
        out[i, : len(t)] = t
    return out


def check_logps_match_tunix(model, out, config) -> None:
    """The rollout's logprobs of every generated token (EOS included) against tunix's forward."""
    completions = padded_completions(out.tokens)
    expected = tunix_logps(model, out.left_padded_prompt_tokens, completions, config.temperature)
    for row, logprobs in enumerate(out.logprobs):
        n = len(out.tokens[row])
        np.testing.assert_allclose(logprobs, expected[row, :n], atol=2e-4, rtol=0, err_msg=f"row {row}")


def tiny_lora_gemma(version: int, seed: int, rank: int = 4) -> gemma.Gemma | gemma3.Gemma3:
    """`tiny_gemma` with qwix LoRA on its einsum projections (q / kv, or Gemma 2's qkv: one A for the projections
    each holds; attn_vec) and its MLP, B random."""
    modules = ".*q_einsum|.*kv_einsum|.*qkv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj"
    base = tiny_gemma(version, seed)
    model = qwix.apply_lora_to_model(
        base, qwix.LoraProvider(module_path=modules, rank=rank, alpha=LORA_ALPHA), **base.get_model_input()
    )
    randomize_lora(model, seed)
    return model

"""jaxserve as google-tunix's rollout engine: `JaxserveRollout` against tunix's own expectations (its
RolloutOutput layout, its per-token logps of its own model forward) for tiny random-weight tunix Llama3,
Gemma, Gemma 2 and Gemma3 models and a tunix Llama3 trained with qwix LoRA (served as the base model plus an
adapter, updated in place), then a few GRPO steps of a tunix Llama3, and of one with LoRA, end to end on CPU with the
rollout served by jaxserve.

Needs google-tunix (`pip install -e ".[tunix]"`; CI runs this file in its Python 3.12 virtualenv).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason='google-tunix is not installed: pip install -e ".[tunix]" (Python >= 3.11)')

import optax  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from grain import python as grain  # noqa: E402
from tunix.models.gemma import model as gemma  # noqa: E402
from tunix.models.gemma3 import model as gemma3  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.rl import common  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

from jaxserve.config import CompileConfig  # noqa: E402
from jaxserve.integrations.tunix import JaxserveRollout, gemma3_hf_config, gemma_hf_config  # noqa: E402
from jaxserve.models import registry  # noqa: E402

pytestmark = pytest.mark.needs_tunix

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


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def test_rollout_generate_logps_and_update_params_against_tunix(mesh):
    model = tiny_llama3(seed=0)
    config = rollout_config()
    rollout = JaxserveRollout(model, CharTokenizer(), mesh, config, **ENGINE)
    assert (rollout.pad_id(), rollout.eos_id(), rollout.model()) == (PAD, EOS, None)

    prompts = ["hello there", "what is two plus two?", "hello there", "a"]
    out = rollout.generate(prompts, config)

    assert len(out.text) == len(out.tokens) == len(out.logprobs) == len(prompts)
    assert out.logits is None
    # The longest prompt (BOS + 21 tokens) exceeds max_prompt_length: padded to the next power of two.
    assert out.left_padded_prompt_tokens.shape == (len(prompts), 32)
    first = out.left_padded_prompt_tokens[0]
    assert first[-12:].tolist() == [BOS, *CharTokenizer().encode("hello there")]
    assert (first[:-12] == PAD).all()
    for tokens, logprobs, text in zip(out.tokens, out.logprobs, out.text, strict=True):
        assert tokens.dtype == np.int32 and 1 <= len(tokens) <= MAX_NEW
        assert logprobs.dtype == np.float32 and logprobs.shape == tokens.shape
        assert EOS not in tokens[:-1].tolist(), "generation stops at EOS, which it keeps"
        assert text == CharTokenizer().decode(tokens.tolist())
    assert out.tokens[0].tolist() != out.tokens[2].tolist() or len(out.tokens[0]) == 1, "copies sampled alike"
    check_logps_match_tunix(model, out, config)
    assert np.ptp(np.concatenate(out.logprobs)) > 1.0, "a distribution far from uniform"

    completions = padded_completions(out.tokens)
    logps = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens, completions))
    assert logps.shape == completions.shape
    for row, logprobs in enumerate(out.logprobs):
        np.testing.assert_array_equal(logps[row, : len(logprobs)], logprobs)
        assert (logps[row, len(logprobs) :] == 0).all()
    with pytest.raises(ValueError, match="row 0 was not generated by the last generate call"):
        rollout.get_per_token_logps(out.left_padded_prompt_tokens[:1], completions[:1] % 7 + 3)

    # tunix's weight sync: new values for the actor's Params, served without recompiling.
    trained = tiny_llama3(seed=1)
    rollout.update_params(nnx.state(trained, nnx.Param), (nnx.Param,))
    assert rollout.llm.weights_version == 1
    greedy = rollout_config(temperature=0.0)
    out = rollout.generate(prompts[:2], greedy)
    check_logps_match_tunix(trained, out, greedy)
    with pytest.raises(ValueError, match="LoRA parameter layers.0.attn.q_proj.w_lora_a"):
        rollout.update_params({"layers": {0: {"attn": {"q_proj": {"w_lora_a": jnp.zeros((64, 4))}}}}})


def test_lora_rollout_logps_equal_tunix_forward_and_updates_send_the_adapter_only(mesh, record_compiles):
    """An actor trained with LoRA: served as the base model plus one adapter; its logprobs are tunix's forward with
    the adapter applied; a LoRA-only sync (what tunix sends) replaces the adapter, not the weights, compiling
    nothing."""
    model = tiny_lora_llama3(seed=0)
    config = rollout_config()
    with pytest.raises(ValueError, match="pass lora_alpha"):
        JaxserveRollout(model, CharTokenizer(), mesh, config, **ENGINE)
    rollout = JaxserveRollout(model, CharTokenizer(), mesh, config, lora_alpha=LORA_ALPHA, **ENGINE)
    assert rollout.llm.list_loras() == ["actor"]
    prompts = ["hello there", "what is two plus two?", "a"]
    check_logps_match_tunix(model, rollout.generate(prompts, config), config)
    base = tiny_llama3(seed=0)  # the same base weights without the adapter: other logprobs
    greedy = rollout_config(temperature=0.0)
    out = rollout.generate(prompts[:1], greedy)
    without = tunix_logps(base, out.left_padded_prompt_tokens, padded_completions(out.tokens), 1.0)
    assert not np.allclose(out.logprobs[0], without[0, : len(out.tokens[0])], atol=1e-2), "the adapter is applied"

    randomize_lora(model, seed=7)  # a training step's new adapter, synced as tunix syncs it
    with record_compiles() as compiled:
        rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
        out = rollout.generate(prompts, greedy)
    assert not compiled, compiled
    assert rollout.llm.weights_version == 0, "the base weights were not sent again"
    check_logps_match_tunix(model, out, greedy)


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


def count_a(prompts, completions, **kwargs):
    """Reward: how many 'a' a completion holds."""
    return [float(c.count("a")) for c in completions]


class Prompts(grain.RandomAccessDataSource):
    def __init__(self, prompts: list[str]) -> None:
        self._prompts = prompts

    def __getitem__(self, index: int) -> str:
        return self._prompts[index]

    def __len__(self) -> int:
        return len(self._prompts)


def rl_cluster(mesh, actor, reference, config, *, max_steps: int, **rollout_options) -> rl_cluster_lib.RLCluster:
    """tunix's RL cluster of the GRPO tests: every role on `mesh`, the rollout served by jaxserve (with
    `rollout_options`, e.g. lora_alpha), SGD on the actor."""
    roles = rl_cluster_lib.Role
    return rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=CharTokenizer(),
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
            rollout_engine=functools.partial(JaxserveRollout, **rollout_options, **ENGINE),
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=100, max_steps=max_steps
            ),
            rollout_config=config,
        ),
    )


def test_grpo_steps_with_the_jaxserve_rollout(mesh):
    """GRPO with a reference model (beta > 0) and two iterations per batch (old logps from the rollout):
    the actor trains, every weight sync reaches the engine, and its logprobs stay tunix's own."""
    actor, reference = tiny_llama3(seed=0), tiny_llama3(seed=0)
    before = jax.tree.map(jnp.copy, nnx.state(actor, nnx.Param))
    config = rollout_config()
    cluster = rl_cluster(mesh, actor, reference, config, max_steps=4)
    rollout = cluster.rollout
    assert isinstance(rollout, JaxserveRollout)
    calls = {"logps": 0}
    original = rollout.get_per_token_logps

    def counted(*args):
        calls["logps"] += 1
        return original(*args)

    rollout.get_per_token_logps = counted
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=count_a,
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=2, beta=0.04),
    )
    dataset = grain.MapDataset.source(Prompts(["a cat", "banana", "say aaa", "hi"] * 2)).batch(2)
    learner.train(dataset.map(lambda prompts: {"prompts": prompts}))

    trained = nnx.state(cluster.actor_trainer.model, nnx.Param)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, trained))
    assert any(changed), "the actor trains"
    assert cluster.global_steps >= 1 and rollout.llm.weights_version == cluster.global_steps
    assert calls["logps"] >= 1, "num_iterations > 1 reads the old policy's logps from the rollout"
    out = rollout.generate(["a cat", "banana"], config)
    check_logps_match_tunix(cluster.actor_trainer.model, out, config)


def test_grpo_steps_of_a_lora_actor_with_the_jaxserve_rollout(mesh):
    """GRPO of an actor trained with LoRA (the reference: its base model): each weight sync sends the adapter only,
    which the engine serves in place; its logprobs stay tunix's forward with the trained adapter."""
    actor, reference = tiny_lora_llama3(seed=0), tiny_llama3(seed=0)
    before = jax.tree.map(jnp.copy, nnx.state(actor, nnx.LoRAParam))
    config = rollout_config()
    cluster = rl_cluster(mesh, actor, reference, config, max_steps=2, lora_alpha=LORA_ALPHA)
    rollout = cluster.rollout
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        reward_fns=count_a,
        algo_config=grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04),
    )
    dataset = grain.MapDataset.source(Prompts(["a cat", "banana", "say aaa", "hi"])).batch(2)
    learner.train(dataset.map(lambda prompts: {"prompts": prompts}))

    trained = nnx.state(cluster.actor_trainer.model, nnx.LoRAParam)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, trained))
    assert any(changed), "the adapter trains"
    assert cluster.global_steps >= 1 and rollout.llm.weights_version == 0, "only the adapter was synced"
    out = rollout.generate(["a cat", "banana"], config)
    check_logps_match_tunix(cluster.actor_trainer.model, out, config)

"""Training to serving: a Flax NNX Llama built from a Hugging Face config dict, with Hugging Face module names,
trained a few optax steps, is served by `LLM.from_params` from its `nnx.State` as it is, with the dense
reference's greedy tokens; after more training `update_weights(nnx.State)` switches the tokens to the new
reference's without compiling anything, and no prefix block computed before the update is reused after it.

The model is what a JAX trainer would write: `nnx.Linear` ([in, out] kernels), `nnx.Embed`, a list of layers,
its own rotary embedding and attention; it shares no code with the engine's model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxserve.config import CompileConfig, KvCacheConfig
from jaxserve.dense import generate_dense
from jaxserve.llm import LLM
from jaxserve.models import registry
from jaxserve.models.loader import load_from_pytree
from jaxserve.sampling import SamplingParams

VOCAB = 160  # the char tokenizer's
NEW_TOKENS = 6
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
ENGINE = dict(
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=64,
    kv_cache_config=KvCacheConfig(max_tokens=256),
    compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    attention_backend="xla",
    show_progress=False,
)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def rotate(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of x [batch, seq, heads, head_dim], rotate-half layout."""
    half = x.shape[-1] // 2
    angles = jnp.arange(x.shape[1])[:, None] / theta ** (jnp.arange(half) / half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float) -> None:
        self.weight = nnx.Param(jnp.ones(dim))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight


def linear(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, c: dict, rngs: nnx.Rngs) -> None:
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim, self.theta = c["hidden_size"] // self.heads, c["rope_theta"]
        self.q_proj = linear(c["hidden_size"], self.heads * self.head_dim, rngs)
        self.k_proj = linear(c["hidden_size"], self.kv_heads * self.head_dim, rngs)
        self.v_proj = linear(c["hidden_size"], self.kv_heads * self.head_dim, rngs)
        self.o_proj = linear(self.heads * self.head_dim, c["hidden_size"], rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, _ = x.shape
        q = rotate(self.q_proj(x).reshape(batch, seq, self.heads, self.head_dim), self.theta)
        k = rotate(self.k_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim), self.theta)
        v = self.v_proj(x).reshape(batch, seq, self.kv_heads, self.head_dim)
        group = self.heads // self.kv_heads  # query heads per kv head, Hugging Face's repeat_kv order
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim**0.5
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(batch, seq, -1))


class DecoderLayer(nnx.Module):
    def __init__(self, c: dict, rngs: nnx.Rngs) -> None:
        d, f = c["hidden_size"], c["intermediate_size"]
        self.input_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.self_attn = Attention(c, rngs)
        self.post_attention_layernorm = RMSNorm(d, c["rms_norm_eps"])
        self.mlp = nnx.Dict(gate_proj=linear(d, f, rngs), up_proj=linear(d, f, rngs), down_proj=linear(f, d, rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.self_attn(self.input_layernorm(x))
        y = self.post_attention_layernorm(h)
        return h + self.mlp["down_proj"](jax.nn.silu(self.mlp["gate_proj"](y)) * self.mlp["up_proj"](y))


class LlamaForCausalLM(nnx.Module):
    """`model.embed_tokens`, `model.layers.<i>...`, `model.norm`, `lm_head`: Hugging Face's module tree."""

    def __init__(self, c: dict, rngs: nnx.Rngs) -> None:
        self.model = nnx.Dict(
            embed_tokens=nnx.Embed(c["vocab_size"], c["hidden_size"], rngs=rngs),
            layers=nnx.List([DecoderLayer(c, rngs) for _ in range(c["num_hidden_layers"])]),
            norm=RMSNorm(c["hidden_size"], c["rms_norm_eps"]),
        )
        self.lm_head = linear(c["hidden_size"], c["vocab_size"], rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """[batch, seq] token ids -> [batch, seq, vocab] logits."""
        x = self.model["embed_tokens"](tokens)
        for layer in self.model["layers"]:
            x = layer(x)
        return self.lm_head(self.model["norm"](x))


@nnx.jit
def train_step(model: LlamaForCausalLM, optimizer: nnx.Optimizer, batch: jax.Array) -> jax.Array:
    def loss_fn(model: LlamaForCausalLM) -> jax.Array:
        logits = model(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def train(model: LlamaForCausalLM, steps: int, seed: int) -> None:
    """`steps` AdamW steps of next-token prediction on a repeating character pattern at random offsets."""
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    pattern = np.arange(VOCAB, dtype=np.int32) * 7 % VOCAB
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        starts = rng.integers(0, VOCAB, 8)
        losses.append(float(train_step(model, optimizer, pattern[(starts[:, None] + np.arange(24)) % VOCAB])))
    assert losses[-1] < losses[0], f"training did not lower the loss: {losses}"


def prompts() -> list[list[int]]:
    """Random prompts, each with full 16-token blocks for the prefix cache to keep."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, n).tolist() for n in (35, 20, 5)]


def reference(state: nnx.State) -> list[list[int]]:
    """The dense reference's greedy tokens over the parameters of `state`."""
    family, cfg = registry.resolve(HF_CONFIG)
    return generate_dense(family, cfg, load_from_pytree(family, cfg, state, "float32"), prompts(), NEW_TOKENS)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def trained() -> LlamaForCausalLM:
    model = LlamaForCausalLM(HF_CONFIG, nnx.Rngs(0))
    train(model, steps=5, seed=0)
    return model


def test_the_served_weights_compute_the_nnx_models_logits(trained, char_tokenizer):
    """The engine's prompt logprobs (its serving-layout weights, through the paged step) equal the NNX
    model's log-softmax at every position."""
    scoring = CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False, prompt_logprobs=True)
    llm = LLM.from_params(
        nnx.state(trained, nnx.Param), HF_CONFIG, char_tokenizer(), **{**ENGINE, "compile_config": scoring}
    )
    ids = prompts()[0]
    want = np.asarray(jax.nn.log_softmax(trained(jnp.asarray([ids]))[0], axis=-1))
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    served = [out.prompt_logprobs[p][token].logprob for p, token in enumerate(ids) if p > 0]
    np.testing.assert_allclose(
        served, [want[p - 1, token] for p, token in enumerate(ids) if p > 0], rtol=1e-5, atol=1e-5
    )
    llm.close()


def test_trained_parameters_are_served_then_updated_in_place(
    trained, char_tokenizer, record_compiles, assert_engine_idle
):
    model = nnx.clone(trained)
    llm = LLM.from_params(nnx.state(model, nnx.Param), HF_CONFIG, char_tokenizer(), **ENGINE)
    before = reference(nnx.state(model, nnx.Param))
    assert tokens(llm) == before
    stats = llm.engine.block_manager.stats
    hits = stats.hit_tokens
    assert tokens(llm) == before and stats.hit_tokens > hits, "the same prompts again should hit the prefix cache"

    train(model, steps=5, seed=1)
    after = reference(nnx.state(model, nnx.Param))
    assert after != before, "more training should change the greedy tokens"
    hits = stats.hit_tokens
    with record_compiles() as compiled:
        assert llm.update_weights(nnx.state(model, nnx.Param)) == 1
        got = tokens(llm)
    assert got == after
    assert not compiled, f"update_weights or the generate after it compiled: {compiled}"
    assert stats.hit_tokens == hits, "a prefix block computed with the old weights was reused"
    assert_engine_idle(llm)
    llm.close()

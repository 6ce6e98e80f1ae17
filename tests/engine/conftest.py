"""Shared pieces of the engine tests: tiny random models held in memory, a one-character-per-token
tokenizer, the dense references (tokens and logits), the default model, and a compile detector.

Engines are built on the `xla` attention backend (the CPU path) with small bucket tables, so each one
compiles in a few seconds; test modules build theirs once, in module-scoped fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxserve.buckets import Bucket
from jaxserve.config import CapacityPolicy, CompileConfig, KvCacheConfig, SchedulerConfig
from jaxserve.llm import LLM
from jaxserve.models import registry
from jaxserve.models.attention import DenseAttentionMetadata, init_dense_cache
from jaxserve.models.loader import LoadedModel
from jaxserve.runner import Runner
from jaxserve.variants import SamplerMode, StepVariant

VOCAB = 160
# Token id i decodes to the character chr(_CHAR_BASE + i); _CHAR_BASE is a multiple of VOCAB so that
# encode(decode(ids)) == ids. Outside Latin-1, so no id decodes to whitespace or a control character.
_CHAR_BASE = 2 * VOCAB
# Small bucket tables: every engine of the tests compiles 2 decode and 2 mixed buckets.
SMALL_BUCKETS = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False)

_TINY_HF = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
_HF_CONFIGS = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),
    # A window shorter than most prompts, so the paged path must mask by position, not only by length.
    "mistral": (transformers.MistralConfig, {"sliding_window": 8}),
    # Sliding and full layers with a window of 8, soft-caps that bind (Gemma 2); q/k norm, two ropes (Gemma 3).
    "gemma2": (
        transformers.Gemma2Config,
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "attn_logit_softcapping": 1.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "rope_local_base_freq": 100.0,
        },
    ),
    # Mixtures of experts (5 experts, top 2): Qwen3-MoE with a dense layer between two expert layers and q/k norm;
    # Mixtral with its window of 8.
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    "mixtral": (
        transformers.MixtralConfig,
        {"num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 48, "sliding_window": 8},
    ),
}
_ARCHITECTURE_NAMES = {"gemma3": "Gemma3ForCausalLM"}


class CharTokenizer:
    """One character per token id: texts and stop strings are exact functions of the token ids."""

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(_CHAR_BASE + int(i)) for i in ids)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def _tiny_model(model_type: str, seed: int = 0) -> LoadedModel:
    """A tiny random Llama, Qwen3 (q/k norm), Mistral (sliding window), Gemma 2, Gemma 3, Qwen3-MoE or Mixtral
    with float32 weights, as `load_model` would return it."""
    config_class, extra = _HF_CONFIGS[model_type]
    config = config_class(**{**_TINY_HF, **extra})
    default_name = config.__class__.__name__.replace("Config", "ForCausalLM")
    config.architectures = [_ARCHITECTURE_NAMES.get(model_type, default_name)]
    hf = config.to_dict()
    family, cfg = registry.resolve(hf)
    weights = family.init_weights(cfg, jax.random.key(seed), jnp.float32)
    return LoadedModel(family, cfg, weights, hf, tokenizer_source=None, source=f"tiny random {model_type}")


def _make_llm(
    model: LoadedModel,
    tokenizer: Any = None,
    *,
    policy: CapacityPolicy = CapacityPolicy.MAX_UTILIZATION,
    kv_tokens: int | None = None,
    compile_config: CompileConfig = SMALL_BUCKETS,
    max_batch_size: int = 4,
    max_num_tokens: int = 32,
    max_seq_len: int = 128,
    enable_prefix_caching: bool = True,
    sliding_window_kv: bool = True,
    **engine_kwargs: Any,
) -> LLM:
    """An xla-backend engine over `model`; kv_tokens caps the KV pool (None: what the batch can use);
    engine_kwargs: other `LLM` keywords."""
    return LLM(
        model,
        tokenizer=tokenizer if tokenizer is not None else CharTokenizer(),
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        kv_cache_config=KvCacheConfig(
            max_tokens=kv_tokens, enable_prefix_caching=enable_prefix_caching, sliding_window_kv=sliding_window_kv
        ),
        scheduler_config=SchedulerConfig(capacity_policy=policy),
        compile_config=compile_config,
        attention_backend="xla",
        show_progress=False,
        **engine_kwargs,
    )


@partial(jax.jit, static_argnames=("family", "cfg"))
def _dense_forward_logits(weights: Any, token_ids: jax.Array, *, family: Any, cfg: Any) -> jax.Array:
    num_tokens = token_ids.shape[0]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    cache = init_dense_cache(cfg, 1, num_tokens, weights.embed.dtype)
    meta = DenseAttentionMetadata(jnp.zeros(num_tokens, jnp.int32))
    weights = family.to_serving(weights, cfg)
    hidden, _ = family.forward(weights, token_ids, positions, cache, meta, cfg)
    return family.compute_logits(weights, hidden, cfg)


def _dense_logits(model: LoadedModel, token_ids: Sequence[int], padded_len: int = 256) -> np.ndarray:
    """[len(token_ids), V] float32 logits of every position, from the dense reference path.

    Causal attention makes trailing padding invisible to earlier positions, so every sequence is padded
    to one length and the forward compiles once.
    """
    if len(token_ids) > padded_len:
        raise ValueError(f"{len(token_ids)} tokens exceed padded_len={padded_len}")
    padded = np.zeros(padded_len, np.int32)
    padded[: len(token_ids)] = token_ids
    logits = _dense_forward_logits(model.weights, padded, family=model.family, cfg=model.config)
    return np.asarray(logits)[: len(token_ids)]


def _assert_engine_idle(llm: LLM) -> None:
    """Nothing queued or in flight, every block back in the pool with a zero ref count."""
    engine = llm.engine
    manager = engine.block_manager
    assert not engine.has_unfinished()
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    assert manager.num_free_blocks == manager.num_usable_blocks, "KV blocks leaked"
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_blocks)), "ref counts did not return to zero"


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., LoadedModel]:
    return _tiny_model


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., LLM]:
    return _make_llm


@pytest.fixture(scope="session")
def char_tokenizer() -> type[CharTokenizer]:
    return CharTokenizer


@pytest.fixture(scope="session")
def dense_logits() -> Callable[..., np.ndarray]:
    return _dense_logits


@pytest.fixture(scope="session")
def assert_engine_idle() -> Callable[[LLM], None]:
    return _assert_engine_idle


@pytest.fixture
def record_runs(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[tuple[Bucket, StepVariant]]]:
    """Calling it starts recording the (bucket, variant) of each Runner.run call into the list it returns."""

    def start() -> list[tuple[Bucket, StepVariant]]:
        ran: list[tuple[Bucket, StepVariant]] = []
        original = Runner.run

        def run(self, inputs, bucket, variant):
            ran.append((bucket, variant))
            return original(self, inputs, bucket, variant)

        monkeypatch.setattr(Runner, "run", run)
        return ran

    return start


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[SamplerMode]:
    """The sampler mode of each Runner.run call."""
    calls: list[SamplerMode] = []
    original = Runner.run

    def run(self, inputs, bucket, variant):
        calls.append(variant.sampler)
        return original(self, inputs, bucket, variant)

    monkeypatch.setattr(Runner, "run", run)
    return calls


@pytest.fixture(scope="session")
def smollm2() -> tuple[LoadedModel, Any]:
    """The default model (SmolLM2-135M-Instruct GGUF) in float32, and its tokenizer."""
    from jaxserve.models.hub import DEFAULT_MODEL
    from jaxserve.models.loader import load_model
    from jaxserve.tokenizer import Tokenizer

    loaded = load_model(DEFAULT_MODEL, dtype="float32")
    return loaded, Tokenizer.from_source(loaded.tokenizer_source)

"""The forward on the pallas backend (its fused kernels in interpret mode) against the xla backend, float32:
a prefill step of two sequences and a decode step over the paged cache give the same logits and the same
cache, with and without Qwen3's q/k norm (which keeps rope out of the fused kernel); the mixtures of experts'
logits with their grouped GEMM kernels. Traced for the GPU, each layer without q/k norm runs one `rope_write_kv`,
every residual add one `add_rms_norm` and every expert layer one `grouped_gate_up` and one `grouped_matmul`."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

from jaxserve.models.attention import PagedAttentionMetadata, init_paged_cache
from jaxserve.models.registry import resolve

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # tests/conftest.py says why

FAMILIES = {
    "llama3_tied": ("llama", {"tie_word_embeddings": True}),
    "mistral_window": ("mistral", {"sliding_window": 8}),
    "qwen3_qk_norm": ("qwen3", {"head_dim": 32}),
    # Soft-capped attention in both kernels, sliding and full layers.
    "gemma2_caps": (
        "gemma2",
        {
            "head_dim": 16,
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "attn_logit_softcapping": 1.0,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 2.0,
        },
    ),
}
# The mixtures of experts (the grouped GEMM kernels on the pallas backend), one expert layer each: Qwen3-MoE with
# q/k norm and renormalised top-k, Qwen2-MoE with its shared expert and top-k not renormalised, Mixtral.
_EXPERTS = {"num_hidden_layers": 1, "num_experts_per_tok": 2}
MOE_FAMILIES = {
    "qwen3_moe": ("qwen3_moe", {**_EXPERTS, "head_dim": 16, "num_experts": 5, "moe_intermediate_size": 32}),
    "qwen2_moe_shared": (
        "qwen2_moe",
        {**_EXPERTS, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    ),
    "mixtral": ("mixtral", {**_EXPERTS, "num_local_experts": 5}),
}
FAMILIES.update(MOE_FAMILIES)
# Step 1: prompts of 20 (blocks 1, 2) and 9 tokens (block 3). Step 2: one decode token each.
STEPS = [
    dict(positions=[*range(20), *range(9)], slots=[*range(16, 36), *range(48, 57)], kv_lens=[20, 9], cu=[0, 20, 29]),
    dict(positions=[20, 9], slots=[36, 57], kv_lens=[21, 10], cu=[0, 1, 2]),
]


def _model(name: str, tiny_hf_config):
    model_type, overrides = FAMILIES[name]
    family, cfg = resolve(tiny_hf_config(model_type, **overrides))
    weights = family.to_serving(family.init_weights(cfg, jax.random.key(0), jnp.float32), cfg)
    return family, cfg, weights


def _meta(step: dict, backend: str, interpret: bool) -> PagedAttentionMetadata:
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return PagedAttentionMetadata(
        slot_mapping=i32(step["slots"]),
        block_table=i32([[1, 2], [3, 0]]),
        kv_lens=i32(step["kv_lens"]),
        cu_q_lens=i32(step["cu"]),
        num_seqs=i32(2),
        backend=backend,
        max_q_len=1 if len(step["positions"]) == 2 else None,
        interpret=interpret,
    )


def _run(
    name: str, backend: str, tiny_hf_config, steps: list[dict] = STEPS
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    family, cfg, weights = _model(name, tiny_hf_config)
    cache = init_paged_cache(cfg, 8, 16, jnp.float32)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 31)
    logits, start = [], 0
    for step in steps:
        meta = _meta(step, backend, interpret=backend == "pallas")
        count = len(step["positions"])

        @jax.jit
        def forward(weights, cache, tokens, positions, meta=meta):
            hidden, cache = family.forward(weights, tokens, positions, cache, meta, cfg)
            return family.compute_logits(weights, hidden, cfg), cache

        ids, positions = jnp.asarray(tokens[start : start + count], jnp.int32), jnp.asarray(step["positions"])
        out, cache = forward(weights, cache, ids, positions.astype(jnp.int32))
        logits.append(np.asarray(out))
        start += count
    return logits, np.asarray(cache.k), np.asarray(cache.v)


# The wiring differs between layers with and without q/k norm; windows, biases and tied embeddings do not
# reach the fused kernels (each is interpret-compiled: ~35 s a family on a 2-core CPU).
@pytest.mark.parametrize("name", ["mistral_window", "qwen3_qk_norm", "gemma2_caps"])
def test_pallas_forward_matches_xla(name: str, tiny_hf_config) -> None:
    pallas_logits, pallas_k, pallas_v = _run(name, "pallas", tiny_hf_config)
    xla_logits, xla_k, xla_v = _run(name, "xla", tiny_hf_config)
    for ours, want in zip(pallas_logits, xla_logits, strict=True):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # The second layer's K/V come from the first layer's output: float32 sums in another order.
    for ours, want in ((pallas_k, xla_k), (pallas_v, xla_v)):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# A decode step (4 routed rows, fewer than a row tile) for one family, a prefill step (58 rows) for each: every
# step is interpret-compiled (~5 s a step on a 2-core CPU).
@pytest.mark.parametrize(("name", "num_steps"), [("qwen3_moe", 1), ("qwen2_moe_shared", 2), ("mixtral", 1)])
def test_pallas_moe_forward_matches_xla(name: str, num_steps: int, tiny_hf_config) -> None:
    """The grouped GEMM kernels (with the fused attention kernels) against the XLA ragged_dots: the same logits."""
    pallas_logits, _, _ = _run(name, "pallas", tiny_hf_config, STEPS[:num_steps])
    xla_logits, _, _ = _run(name, "xla", tiny_hf_config, STEPS[:num_steps])
    for ours, want in zip(pallas_logits, xla_logits, strict=True):
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _kernel_calls(jaxpr, counts: collections.Counter) -> collections.Counter:
    """How many times each Pallas kernel is called, by its name, through nested jaxprs (jit, shard_map)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts[eqn.params["name"]] += 1
        for value in eqn.params.values():
            if isinstance(value, ClosedJaxpr | Jaxpr):
                _kernel_calls(value.jaxpr if isinstance(value, ClosedJaxpr) else value, counts)
    return counts


@pytest.mark.parametrize("name", ["llama3_tied", "qwen3_qk_norm", "qwen2_moe_shared"])
def test_pallas_forward_calls_the_fused_kernels(name: str, tiny_hf_config) -> None:
    family, cfg, weights = _model(name, tiny_hf_config)
    cache = init_paged_cache(cfg, 8, 16, jnp.float32)
    meta = _meta(STEPS[1], "pallas", interpret=False)
    ids = jnp.asarray([1, 2], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda w, c, t, p: family.forward(w, t, p, c, meta, cfg))(weights, cache, ids, ids)
    calls = _kernel_calls(jaxpr.jaxpr, collections.Counter())
    layers = cfg.num_layers
    # Qwen3 norms q and k before rope: its layers keep rope as XLA ops and write_kv.
    qk_norm = getattr(cfg, "base", cfg).qk_norm  # a mixture of experts' attention is its dense counterpart's
    assert calls["rope_write_kv"] == (0 if qk_norm else layers), calls
    assert calls["write_kv"] == (layers if qk_norm else 0), calls
    assert calls["add_rms_norm"] == 2 * layers, calls
    assert calls["ragged_paged_attention_decode"] + calls["ragged_paged_attention"] >= layers, calls
    # Each expert layer's grouped GEMMs (Qwen2-MoE's shared expert and dense layers stay XLA GEMMs).
    expert_layers = len(getattr(cfg, "moe_layers", ()))
    assert calls["moe_gate_up"] == calls["moe_matmul"] == expert_layers, calls


def test_a_forward_traces_its_decoder_layer_once(tiny_hf_config, monkeypatch) -> None:
    """The layers' arguments have the same shapes, so `decoder_layer` (one jit) is traced for the first layer
    and reused for the others: a forward's tracing does not grow with the layer count."""
    import jaxserve.models.llama as llama_module

    family, cfg, weights = _model("llama3_tied", tiny_hf_config)
    assert cfg.num_layers > 1
    cache = init_paged_cache(cfg, 8, 16, jnp.float32)
    meta = _meta(STEPS[1], "xla", interpret=False)
    ids = jnp.asarray([1, 2], jnp.int32)
    traced = []
    block = llama_module.attention_block
    monkeypatch.setattr(llama_module, "attention_block", lambda *args: traced.append(1) or block(*args))
    jax.clear_caches()  # no earlier test's trace of the layer stands in for this one
    try:
        jax.make_jaxpr(lambda w, c, t, p: family.forward(w, t, p, c, meta, cfg))(weights, cache, ids, ids)
    finally:
        jax.clear_caches()  # nor does this one's, with the counting wrapper, reach a later test
    assert len(traced) == 1


def _run_grouped(name: str, backend: str, tiny_hf_config) -> list[np.ndarray]:
    """STEPS over a pool laid out by layer group (each group's pages its own, interleaved in the block table)."""
    from jaxserve.kv_layout import kv_layout

    family, cfg, weights = _model(name, tiny_hf_config)
    layout = kv_layout([layer.sliding_window for layer in cfg.attention_layers])
    groups = layout.num_groups
    assert groups > 1
    # Sequence 0's blocks 0, 1 and sequence 1's block 0 get pages 1 + 3 * g + (0, 1, 2) in group g.
    pages = {(0, 0): 0, (0, 1): 1, (1, 0): 2}
    page = lambda seq, block, g: 1 + 3 * g + pages[(seq, block)]  # noqa: E731
    table = np.zeros((2, 2 * groups), np.int32)
    for seq, block in pages:
        for g in range(groups):
            table[seq, block * groups + g] = page(seq, block, g)
    cache = init_paged_cache(cfg, 1 + 3 * groups, 16, jnp.float32, layout.layers_per_page)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 31)
    logits, start = [], 0
    for step in STEPS:
        count = len(step["positions"])
        seqs = [0] * (count - 1) + [1] if count == 2 else [0] * 20 + [1] * 9
        positions = np.asarray(step["positions"])
        slots = np.array(
            [[page(s, p // 16, g) * 16 + p % 16 for s, p in zip(seqs, positions, strict=True)] for g in range(groups)],
            np.int32,
        )
        meta = PagedAttentionMetadata(
            slot_mapping=jnp.asarray(slots),
            block_table=jnp.asarray(table),
            kv_lens=jnp.asarray(step["kv_lens"], jnp.int32),
            cu_q_lens=jnp.asarray(step["cu"], jnp.int32),
            num_seqs=jnp.int32(2),
            backend=backend,
            max_q_len=1 if count == 2 else None,
            interpret=backend == "pallas",
            kv_layout=layout,
        )

        @jax.jit
        def forward(weights, cache, tokens, positions, meta=meta):
            hidden, cache = family.forward(weights, tokens, positions, cache, meta, cfg)
            return family.compute_logits(weights, hidden, cfg), cache

        ids = jnp.asarray(tokens[start : start + count], jnp.int32)
        out, cache = forward(weights, cache, ids, jnp.asarray(positions, jnp.int32))
        logits.append(np.asarray(out))
        start += count
    return logits


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_pool_laid_out_by_layer_group_gives_the_same_logits(backend: str, tiny_hf_config) -> None:
    """Gemma 2's sliding and full layers in groups of their own pages: each layer reads its group's pages and
    slot, on both backends, and the logits are those of the one-group pool."""
    reference, _, _ = _run("gemma2_caps", "xla", tiny_hf_config)
    for ours, want in zip(_run_grouped("gemma2_caps", backend, tiny_hf_config), reference, strict=True):
        np.testing.assert_allclose(ours, want, rtol=2e-5, atol=2e-5)

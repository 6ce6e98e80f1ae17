"""LLM.update_weights: new values in place without compiling anything, no prefix computed with the old
weights reused, refused while requests are unfinished or when the new parameters do not fit (before
anything changes), the old device buffers freed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.llm import LLM
from jaxserve.models.loader import load_from_pytree
from jaxserve.sampling import SamplingParams

VOCAB = 160
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
BUCKETS = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")

_compiles: list[str] = []
_counting = [False]


def _on_event(event: str, duration: float, **kwargs: object) -> None:
    if _counting[0] and event in COMPILE_EVENTS:
        _compiles.append(event)


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def model_and_llm(tiny_model, make_llm):
    model = tiny_model("llama")
    return model, make_llm(model, kv_tokens=256, compile_config=BUCKETS)


def prompts(seed: int, count: int, length: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(count)]


def tokens(llm, batch) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]


def test_updates_change_the_tokens_to_the_new_references_and_compile_nothing(model_and_llm, assert_engine_idle):
    model, llm = model_and_llm
    family, cfg = model.family, model.config
    batch = prompts(seed=1, count=3)
    assert tokens(llm, batch) == generate_dense(family, cfg, model.weights, batch, NEW_TOKENS)
    for version, seed in ((1, 11), (2, 12)):
        new = family.init_weights(cfg, jax.random.key(seed), jnp.float32)
        reference = generate_dense(family, cfg, new, batch, NEW_TOKENS)
        _compiles.clear()
        _counting[0] = True
        try:
            assert llm.update_weights(new) == version == llm.weights_version
            got = tokens(llm, batch)
        finally:
            _counting[0] = False
        assert got == reference
        assert not _compiles, f"update_weights or the generate after it compiled: {_compiles}"
    assert_engine_idle(llm)


def test_no_prefix_cached_before_an_update_is_reused_after_it(model_and_llm):
    model, llm = model_and_llm
    family, cfg = model.family, model.config
    batch = prompts(seed=2, count=1, length=40)  # two full blocks of 16 to cache
    tokens(llm, batch)
    stats = llm.engine.block_manager.stats
    hits = stats.hit_tokens
    tokens(llm, batch)
    assert stats.hit_tokens > hits, "the same prompt again should hit the prefix cache"
    new = family.init_weights(cfg, jax.random.key(21), jnp.float32)
    llm.update_weights(new)
    hits = stats.hit_tokens
    assert tokens(llm, batch) == generate_dense(family, cfg, new, batch, NEW_TOKENS)
    assert stats.hit_tokens == hits, "a block computed with the old weights was reused"


def test_refused_while_a_request_is_unfinished(model_and_llm):
    model, llm = model_and_llm
    request_id = llm.engine.add_request(prompts(seed=3, count=1)[0], GREEDY)
    new = model.family.init_weights(model.config, jax.random.key(31), jnp.float32)
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        llm.update_weights(new)
    assert llm.weights_version == 0
    llm.engine.abort(request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.update_weights(new) == 1


def test_parameters_that_do_not_fit_are_refused_before_anything_changes(model_and_llm):
    model, llm = model_and_llm
    family, cfg = model.family, model.config
    batch = prompts(seed=4, count=2)
    before = tokens(llm, batch)
    new = family.init_weights(cfg, jax.random.key(41), jnp.float32)
    layers = new.layers
    wrong_shape = dataclasses.replace(new, layers=dataclasses.replace(layers, wq=layers.wq[:, :, :-1]))
    with pytest.raises(ValueError, match="wq"):
        llm.update_weights(wrong_shape)
    with pytest.raises(ValueError, match="no_such_weight"):
        llm.update_weights({"no_such_weight": np.zeros(3, np.float32)})
    integers = dataclasses.replace(new, layers=dataclasses.replace(layers, wq=layers.wq.astype(jnp.int32)))
    with pytest.raises(ValueError, match=r"parameter layers\.wq: dtype int32, expected a floating-point array"):
        llm.update_weights(integers)
    assert llm.weights_version == 0 and tokens(llm, batch) == before


def test_the_old_buffers_are_freed(model_and_llm):
    model, llm = model_and_llm
    old = jax.tree.leaves(llm.engine.runner.weights.arrays)
    llm.update_weights(model.family.init_weights(model.config, jax.random.key(51), jnp.float32))
    assert all(leaf.is_deleted() for leaf in old)
    new = jax.tree.leaves(llm.engine.runner.weights.arrays)
    assert [(x.shape, x.dtype, x.sharding) for x in new] == [(x.shape, x.dtype, x.sharding) for x in old]


def test_float32_parameters_into_a_bfloat16_llm_are_cast_layer_by_layer_compiling_nothing(tiny_model, char_tokenizer):
    """A trainer's float32 parameters served in bfloat16: neither from_params nor update_weights makes a cast
    copy of the tree (the loader hands the arrays on as they are), the runner casts each layer as it places
    it, and an update in the construction's dtype compiles nothing."""
    model = tiny_model("llama")
    family, cfg = model.family, model.config
    assert load_from_pytree(family, cfg, model.weights, "bfloat16", cast=False).layers.wq is model.weights.layers.wq
    llm = LLM.from_params(
        model.weights,
        model.hf_config,
        char_tokenizer(),
        dtype="bfloat16",
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=128,
        compile_config=BUCKETS,
        attention_backend="xla",
        show_progress=False,
    )
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(llm.engine.runner.weights.arrays))
    batch = prompts(seed=6, count=2)
    before = tokens(llm, batch)
    other = family.init_weights(cfg, jax.random.key(61), jnp.float32)
    _compiles.clear()
    _counting[0] = True
    try:
        llm.update_weights(other)
        changed = tokens(llm, batch)
        llm.update_weights(model.weights)
        again = tokens(llm, batch)
    finally:
        _counting[0] = False
    assert not _compiles, f"update_weights or the generate after it compiled: {_compiles}"
    assert changed != before and again == before
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(llm.engine.runner.weights.arrays))

"""LLM.sleep / wake_up / close: device memory (on CPU, the live arrays' bytes) handed back and taken again,
the same tokens after wake_up, new weights after sleep(level=2), nothing left behind by build-close cycles,
and clear errors for what cannot be done in each state."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.dense import generate_dense
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

VOCAB = 160
NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
ENGINE = dict(
    max_batch_size=4,
    max_num_tokens=32,
    max_seq_len=64,
    compile_config=CompileConfig(decode_batch_sizes=(4,), token_buckets=(32,), penalty_variants=False),
    attention_backend="xla",
    show_progress=False,
)


def live_bytes() -> int:
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays())


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(9)
    return [rng.integers(0, VOCAB, n).tolist() for n in (5, 12)]


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture
def model(tiny_model):
    return tiny_model("llama")


def served_bytes(llm: LLM) -> int:
    runner = llm.engine.runner
    return sum(x.nbytes for x in jax.tree.leaves((runner.weights.arrays, runner.kv_cache)))


def test_sleep_level_1_frees_weights_and_pool_and_wake_up_gives_the_same_tokens(model, char_tokenizer):
    llm = LLM(model, tokenizer=char_tokenizer(), **ENGINE)
    before = tokens(llm)
    awake, held = live_bytes(), served_bytes(llm)
    llm.sleep(1)
    assert awake - live_bytes() >= held
    with pytest.raises(RuntimeError, match="asleep: call wake_up"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep(1)
    llm.wake_up()
    assert live_bytes() == awake
    assert tokens(llm) == before
    llm.close()


@pytest.mark.parametrize("update_first", [False, True])
def test_sleep_level_2_then_update_weights_serves_the_new_weights(model, char_tokenizer, update_first):
    llm = LLM(model, tokenizer=char_tokenizer(), **ENGINE)
    tokens(llm)
    llm.sleep(2)
    assert llm.engine.runner.weights.arrays is None and not llm.engine.runner.weights.on_host
    new = model.family.init_weights(model.config, jax.random.key(7), jnp.float32)
    if update_first:
        llm.update_weights(new)
        llm.wake_up()
    else:
        llm.wake_up()
        with pytest.raises(RuntimeError, match=r"no weights since sleep\(level=2\): call update_weights"):
            llm.generate(prompts(), GREEDY, use_tqdm=False)
        llm.update_weights(new)
    assert tokens(llm) == generate_dense(model.family, model.config, new, prompts(), NEW_TOKENS)
    llm.close()


def test_close_hands_every_buffer_back_and_build_close_cycles_leak_nothing(model, char_tokenizer):
    baseline = live_bytes()
    for _ in range(3):
        with LLM(model, tokenizer=char_tokenizer(), **ENGINE) as llm:
            assert live_bytes() > baseline
            # What exists once the engine is ready is out of the garbage collector's reach until close.
            assert gc.get_freeze_count() > 0
            assert tokens(llm) == generate_dense(model.family, model.config, model.weights, prompts(), NEW_TOKENS)
        assert live_bytes() == baseline and gc.get_freeze_count() == 0
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(model.weights)), "the caller's arrays were freed"
    with pytest.raises(RuntimeError, match="the engine is closed"):
        llm.generate(prompts(), GREEDY, use_tqdm=False)
    for action in (llm.wake_up, lambda: llm.sleep(1), lambda: llm.update_weights(model.weights)):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            action()
    llm.close()  # closing twice is harmless


def test_sleep_is_refused_while_a_request_is_unfinished_or_at_an_unknown_level(model, char_tokenizer):
    llm = LLM(model, tokenizer=char_tokenizer(), **ENGINE)
    llm.engine.add_request(prompts()[0], GREEDY)
    with pytest.raises(RuntimeError, match="sleep while 1 requests are unfinished"):
        llm.sleep(1)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level)
    llm.close()  # aborts the unfinished request
    assert not llm.engine.scheduler.has_unfinished()


def test_an_llm_keeps_no_second_copy_of_the_weights(tiny_model, make_llm):
    """The engine serves its own (serving-layout) copy; once the caller drops the loaded model, its
    checkpoint-layout arrays are freed: `llm.model` describes the model without holding them."""
    model = tiny_model("llama")
    checkpoint_leaves = [weakref.ref(leaf) for leaf in jax.tree.leaves(model.weights)]
    llm = make_llm(model)
    del model
    gc.collect()
    assert llm.model.weights is None
    assert [ref for ref in checkpoint_leaves if ref() is not None] == []
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids

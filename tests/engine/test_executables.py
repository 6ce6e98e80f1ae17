"""The executable store: a compiled step comes back from disk for the same key and only for it, a broken
entry is compiled again, the store stays under its size, and an engine built twice over one store loads
every step the second time and generates the same tokens."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CompileConfig
from jaxserve.executables import ExecutableStore
from jaxserve.sampling import SamplingParams


def _double_sum(x, y):
    return {"sum": (x * 2 + y).sum(), "scaled": x * 2}


def _compile_fn(args, calls):
    def compile_fn():
        calls.append(1)
        return jax.jit(_double_sum, donate_argnums=(0,)).lower(*args).compile()

    return compile_fn


def _args(n=8, dtype=jnp.float32):
    return (jax.ShapeDtypeStruct((n,), dtype), jax.ShapeDtypeStruct((n,), dtype))


def test_the_same_key_loads_what_was_stored_and_runs_it(tmp_path):
    calls = []
    first = ExecutableStore(tmp_path, jax.devices()[:1])
    compiled = first.get_or_compile("f", "statics", _args(), _compile_fn(_args(), calls))
    second = ExecutableStore(tmp_path, jax.devices()[:1])  # a new process, in effect
    loaded = second.get_or_compile("f", "statics", _args(), _compile_fn(_args(), calls))
    assert calls == [1] and (first.misses, second.hits, second.misses) == (1, 1, 0)
    x, y = np.arange(8, dtype=np.float32), np.ones(8, np.float32)
    expected = compiled(jnp.asarray(x), jnp.asarray(y))
    got = loaded(jnp.asarray(x), jnp.asarray(y))
    assert set(got) == {"sum", "scaled"}
    np.testing.assert_array_equal(np.asarray(got["scaled"]), np.asarray(expected["scaled"]))
    assert float(got["sum"]) == float(expected["sum"]) == float((x * 2 + y).sum())


@pytest.mark.parametrize("change", ["statics", "kind", "shape", "dtype"])
def test_a_different_step_is_a_different_key(tmp_path, change):
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    base = store.key("f", "statics", _args())
    changed = {
        "statics": lambda: store.key("f", "statics2", _args()),
        "kind": lambda: store.key("g", "statics", _args()),
        "shape": lambda: store.key("f", "statics", _args(n=16)),
        "dtype": lambda: store.key("f", "statics", _args(dtype=jnp.int32)),
    }[change]()
    assert changed != base
    assert store.key("f", "statics", _args()) == base


def test_a_changed_source_or_flag_is_a_different_key(tmp_path, monkeypatch):
    from jaxserve import executables

    base = ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args())
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_dump_to=/nonexistent")
    assert ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args()) != base
    monkeypatch.undo()
    monkeypatch.setattr(executables, "source_digest", lambda: "an edited source")
    assert ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args()) != base


@pytest.mark.parametrize("option", ["jax_disable_most_optimizations", "jax_default_matmul_precision"])
def test_a_changed_jax_option_is_a_different_key(tmp_path, option):
    """Both kinds of jax option: one read with jax.config.read (no attribute), one with a context manager."""
    base = ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args())
    value = {"jax_disable_most_optimizations": True, "jax_default_matmul_precision": "highest"}[option]
    before = getattr(jax.config, option) if hasattr(jax.config, option) else jax.config.read(option)
    jax.config.update(option, value)
    try:
        assert ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args()) != base
    finally:
        jax.config.update(option, before)
    assert ExecutableStore(tmp_path, jax.devices()[:1]).key("f", "s", _args()) == base


def test_an_unreadable_entry_is_logged_removed_and_compiled_again(tmp_path, caplog):
    calls = []
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    store.get_or_compile("f", "s", _args(), _compile_fn(_args(), calls))
    [entry] = list(tmp_path.glob("*.exe"))
    entry.write_bytes(b"not a pickle")
    with caplog.at_level(logging.WARNING, logger="jaxserve.executables"):
        again = ExecutableStore(tmp_path, jax.devices()[:1]).get_or_compile(
            "f", "s", _args(), _compile_fn(_args(), calls)
        )
    assert calls == [1, 1]
    assert "could not be loaded" in caplog.text
    assert float(again(jnp.ones(8), jnp.ones(8))["sum"]) == 24.0
    assert ExecutableStore(tmp_path, jax.devices()[:1]).get_or_compile("f", "s", _args(), lambda: None) is not None


def test_the_store_keeps_under_its_size_removing_the_oldest(tmp_path):
    calls = []
    one = ExecutableStore(tmp_path, jax.devices()[:1])
    one.get_or_compile("f", "a", _args(), _compile_fn(_args(), calls))
    size = sum(p.stat().st_size for p in tmp_path.glob("*.exe"))
    oldest = next(tmp_path.glob("*.exe"))
    os.utime(oldest, (1, 1))
    small = ExecutableStore(tmp_path, jax.devices()[:1], max_bytes=int(size * 1.5))
    small.get_or_compile("f", "b", _args(), _compile_fn(_args(), calls))
    remaining = list(tmp_path.glob("*.exe"))
    assert len(remaining) == 1 and oldest not in remaining
    with pytest.raises(ValueError, match="max_bytes"):
        ExecutableStore(tmp_path, jax.devices()[:1], max_bytes=-1)


def test_an_engine_built_again_loads_every_step_and_generates_the_same_tokens(tmp_path, tiny_model, make_llm):
    model = tiny_model("llama")
    config = CompileConfig(
        decode_batch_sizes=(2, 4), token_buckets=(16, 32), penalty_variants=False, cache_dir=str(tmp_path), lazy=False
    )
    prompts = [[3, 5, 7, 9], [11, 13, 17, 19, 23, 29]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    tokens = []
    for build in range(2):
        llm = make_llm(model, compile_config=config)
        store = llm.engine.runner.store
        expected = (0, llm.engine.runner.table.num_executables)  # (hits, misses); on CPU no capacity probe compiles
        assert (store.hits, store.misses) == (expected if build == 0 else expected[::-1])
        # Each executable compiled reports its tracing + lowering and its XLA compile; one loaded reports none.
        timings = llm.engine.runner.table.compile_timings
        assert len(timings) == (expected[1] if build == 0 else 0)
        assert all(lowering > 0 and xla > 0 for lowering, xla in timings)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.close()
    assert tokens[0] == tokens[1]


def test_without_the_store_the_engine_turns_on_jax_cache_instead(tiny_model, make_llm, monkeypatch, tmp_path):
    from jaxserve import engine

    enabled = []
    monkeypatch.setattr(engine, "enable_compilation_cache", enabled.append)  # jax's cache is process-wide
    config = CompileConfig(
        decode_batch_sizes=(2,), token_buckets=(16,), penalty_variants=False, cache_dir=str(tmp_path)
    )
    llm = make_llm(tiny_model("llama"), compile_config=config)
    assert llm.engine.runner.store is not None and enabled == []
    llm.close()
    llm = make_llm(tiny_model("llama"), compile_config=dataclasses.replace(config, store_executables=False))
    assert llm.engine.runner.store is None and enabled == [str(tmp_path)]
    llm.close()


def test_nothing_is_stored_while_jax_cache_is_on(tmp_path, monkeypatch, caplog):
    from jaxserve import executables

    monkeypatch.setattr(executables, "jax_cache_on", lambda: True)
    calls = []
    store = ExecutableStore(tmp_path, jax.devices()[:1])
    with caplog.at_level(logging.INFO, logger="jaxserve.executables"):
        store.get_or_compile("f", "s", _args(), _compile_fn(_args(), calls))
    assert calls == [1] and list(tmp_path.glob("*.exe")) == []
    assert "stores nothing" in caplog.text


def test_running_every_step_once_leaves_the_pool_and_the_tokens_alone(tiny_model, make_llm):
    """What the warmup does on a GPU (each executable's first run loads its kernels), run on CPU: every
    forward and sampler once on padding, which writes only the reserved block."""
    model = tiny_model("llama")
    config = CompileConfig(decode_batch_sizes=(2, 4), token_buckets=(16, 32), lazy=False)
    llm = make_llm(model, compile_config=config)
    prompts = [[3, 5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59], [2, 4, 6]]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner = llm.engine.runner
    pool = jax.tree.map(lambda x: np.asarray(x)[:, 1:].copy(), runner.kv_cache)  # all but the reserved block
    assert any(np.abs(x).sum() > 0 for x in jax.tree.leaves(pool)), "the prompts should have filled blocks"
    seconds, runner.kv_cache = runner.table.run_each_once(runner.weights.step_weights, runner.kv_cache, runner.state)
    assert seconds > 0
    after_pool = jax.tree.map(lambda x: np.asarray(x)[:, 1:], runner.kv_cache)
    jax.tree.map(np.testing.assert_array_equal, after_pool, pool)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before
    llm.close()


def test_gpu_forwards_of_many_tokens_compile_with_cublas_gemms_only(monkeypatch):
    from jaxserve.buckets import Bucket
    from jaxserve.step_table import CUBLAS_MIN_TOKENS, TRITON_GEMM_OPTION, forward_compiler_options

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    large, small = Bucket(CUBLAS_MIN_TOKENS, CUBLAS_MIN_TOKENS, decode_only=True), Bucket(CUBLAS_MIN_TOKENS - 1, 8)
    assert forward_compiler_options("gpu", large) == {TRITON_GEMM_OPTION: False}
    assert forward_compiler_options("gpu", Bucket(8192, 64)) == {TRITON_GEMM_OPTION: False}
    assert forward_compiler_options("gpu", small) == {}
    assert forward_compiler_options("cpu", large) == {}
    # A user's own choice in XLA_FLAGS is left alone.
    monkeypatch.setenv("XLA_FLAGS", f"--{TRITON_GEMM_OPTION}=true")
    assert forward_compiler_options("gpu", large) == {}


def test_a_forward_compiles_with_its_options_and_the_store_keys_them(tmp_path, tiny_model, make_llm):
    from jaxserve.step_table import TRITON_GEMM_OPTION

    config = CompileConfig(
        decode_batch_sizes=(2,), token_buckets=(16,), penalty_variants=False, cache_dir=str(tmp_path), lazy=True
    )
    llm = make_llm(tiny_model("llama"), compile_config=config)
    runner = llm.engine.runner
    table = runner.table
    bucket, prompt_logprobs = min(llm.engine.steps.forwards(), key=lambda key: key[0].num_tokens)
    # The options reach XLA's compile: one it does not know fails there.
    with pytest.raises(Exception, match="xla_no_such_option"):
        table.compile_forward(bucket, prompt_logprobs, table.num_blocks, compiler_options={"xla_no_such_option": 1})
    # Each set of options is its own executable in the store: a miss, then a hit; the default set another miss.
    options = {TRITON_GEMM_OPTION: False}
    table.compile_forward(bucket, prompt_logprobs, table.num_blocks, compiler_options=options)
    table.compile_forward(bucket, prompt_logprobs, table.num_blocks, compiler_options=options)
    assert (runner.store.misses, runner.store.hits) == (2, 1)
    table.compile_forward(bucket, prompt_logprobs, table.num_blocks)
    assert (runner.store.misses, runner.store.hits) == (3, 1)
    llm.close()

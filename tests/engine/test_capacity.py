"""KV capacity: bytes per token, the budget from measured memory profiles (every term, the user caps,
the error that names the knobs), the CPU fallback, and raising JAX's GPU memory fraction."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import capacity
from jaxserve.capacity import DeviceMemory, MemoryProfile, kv_budget, kv_bytes_per_token
from jaxserve.config import EngineConfig, KvCacheConfig
from jaxserve.models.attention import paged_cache_specs

MiB = 2**20
GB = 10**9
BYTES_PER_TOKEN = 1024
BLOCK_SIZE = 16
BYTES_PER_BLOCK = BYTES_PER_TOKEN * BLOCK_SIZE


def engine_config(max_batch_size: int = 4, max_seq_len: int = 256, **kv: object) -> EngineConfig:
    return EngineConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=64,
        max_seq_len=max_seq_len,
        kv_cache=KvCacheConfig(block_size=BLOCK_SIZE, **kv),
    )


@pytest.mark.parametrize(
    "layers, kv_heads, head_dim, dtype, tp, expected",
    [
        (32, 8, 128, jnp.bfloat16, 1, 128 * 1024),  # Llama-3.1-8B: 128 KiB per token
        (32, 8, 128, jnp.bfloat16, 4, 32 * 1024),  # kv heads split over 4 devices
        (30, 3, 64, jnp.float32, 1, 2 * 30 * 3 * 64 * 4),  # SmolLM2-135M in float32
        (30, 3, 64, jnp.float32, 2, 2 * 30 * 3 * 64 * 4),  # 3 kv heads over 2 devices: replicated
        (2, 2, 16, np.float16, 1, 2 * 2 * 2 * 16 * 2),
    ],
)
def test_bytes_per_token(layers, kv_heads, head_dim, dtype, tp, expected):
    """From the pool's declaration split by the rules table (a mesh given by its axis sizes)."""
    cfg = SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    specs = paged_cache_specs(cfg, num_blocks=5, block_size=BLOCK_SIZE)
    assert kv_bytes_per_token(specs, {"data": 1, "model": tp}, dtype) == expected


def profile(*devices: DeviceMemory, per_token: int = BYTES_PER_TOKEN) -> MemoryProfile:
    return MemoryProfile(per_token, devices)


def test_budget_from_one_device_profile_uses_every_term(caplog):
    device = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=20 * MiB, activation_peak=5 * MiB)

    with caplog.at_level(logging.INFO, logger="jaxserve.capacity"):
        budget = kv_budget(profile(device), engine_config(free_memory_fraction=0.5))

    blocks = capacity.stable_num_blocks(int(75 * MiB * 0.5) // BYTES_PER_BLOCK)
    assert budget.kv_bytes == blocks * BYTES_PER_BLOCK and budget.bytes_per_block == BYTES_PER_BLOCK
    assert budget.num_blocks == blocks
    assert budget.tokens(BLOCK_SIZE) == (budget.num_blocks - 1) * BLOCK_SIZE  # block 0 is reserved
    assert budget.source == "device memory"
    log = caplog.text
    for term in ("bytes_limit 0.10 GiB", "in use after weights 0.02 GiB", "activation peak 0.00 GiB"):
        assert term in log
    assert "free_memory_fraction 0.50" in log and f"{budget.num_blocks} blocks" in log


def test_budget_is_the_smallest_over_devices():
    roomy = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=10 * MiB, activation_peak=0)
    tight = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=60 * MiB, activation_peak=10 * MiB)

    budget = kv_budget(profile(roomy, tight), engine_config())

    assert budget.num_blocks == capacity.stable_num_blocks(int(30 * MiB * 0.9) // BYTES_PER_BLOCK)


def test_a_measured_pool_is_rounded_to_a_size_that_small_memory_changes_keep():
    """The pool size is in every compiled step's shapes: runs whose free memory differs by a fraction of
    a percent (the H200 measured 50251 to 50666 blocks) must get the same pool to reuse cached steps."""
    sizes = {capacity.stable_num_blocks(n) for n in (50251, 50558, 50579, 50666)}
    assert sizes == {50176}
    for n in [*range(1, 200), 1000, 4097, 50666, 10**6 + 7]:
        rounded = capacity.stable_num_blocks(n)
        assert n * (1 - 1 / 32) < rounded <= n and capacity.stable_num_blocks(rounded) == rounded
    # 4550 and 4544 blocks measured: both 4480 (a multiple of 128)
    device = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=21 * MiB, activation_peak=0)
    nudged = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=21 * MiB + 100 * 1024, activation_peak=0)
    budgets = [kv_budget(profile(d), engine_config()).num_blocks for d in (device, nudged)]
    assert budgets == [4480, 4480]


def test_default_fraction_on_an_8b_model_leaves_room_for_750k_tokens():
    """The issue's sizing: a 150 GB card, 16 GB of weights, 128 KiB of KV per token."""
    device = DeviceMemory(bytes_limit=int(0.92 * 150 * GB), bytes_in_use=16 * GB, activation_peak=2 * GB)
    config = EngineConfig(max_batch_size=256, max_num_tokens=8192, max_seq_len=131072)

    budget = kv_budget(profile(device, per_token=128 * 1024), config)

    assert budget.tokens(16) >= 750_000


@pytest.mark.parametrize(
    "max_tokens, max_total_bytes, expected_blocks",
    [
        (1000, None, 1000 // BLOCK_SIZE + 2),  # ceil(1000 / 16) = 63 blocks for the tokens, plus block 0
        (None, 70 * BYTES_PER_BLOCK + 5, 70),
        (1000, 40 * BYTES_PER_BLOCK, 40),  # the smaller cap wins
        # caps above the measured budget change nothing
        (10**9, 10**12, capacity.stable_num_blocks(int(90 * MiB * 0.9) // BYTES_PER_BLOCK)),
    ],
)
def test_user_caps(max_tokens, max_total_bytes, expected_blocks):
    device = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=10 * MiB, activation_peak=0)
    config = engine_config(max_tokens=max_tokens, max_gpu_total_bytes=max_total_bytes)

    budget = kv_budget(profile(device), config)

    assert budget.num_blocks == expected_blocks
    if max_total_bytes is None:
        assert budget.tokens(BLOCK_SIZE) >= max_tokens


def test_a_budget_for_exactly_one_full_length_request_is_accepted():
    config = engine_config(max_seq_len=256, max_gpu_total_bytes=17 * BYTES_PER_BLOCK)  # 16 blocks + block 0
    device = DeviceMemory(bytes_limit=100 * MiB, bytes_in_use=0, activation_peak=0)
    assert kv_budget(profile(device), config).num_blocks == 17


@pytest.mark.parametrize(
    "device, kv",
    [
        (DeviceMemory(100 * MiB, 10 * MiB, 0), {"max_gpu_total_bytes": 16 * MiB}),  # one block short
        (DeviceMemory(100 * MiB, 10 * MiB, 0), {"max_tokens": 100}),
        (DeviceMemory(100 * MiB, 99 * MiB, 0), {}),  # the weights leave 1 MiB
        (DeviceMemory(100 * MiB, 60 * MiB, 50 * MiB), {}),  # the activations exceed what is left
    ],
    ids=["bytes-cap", "token-cap", "weights", "activations"],
)
def test_too_small_for_one_max_seq_len_request_names_the_knobs(device, kv):
    config = engine_config(max_seq_len=256, **kv)
    with pytest.raises(ValueError) as error:
        kv_budget(profile(device, per_token=MiB // BLOCK_SIZE), config)  # 1 MiB per block
    message = str(error.value)
    assert "max_seq_len=256 needs 16 blocks" in message
    for knob in ("max_seq_len", "max_batch_size", "max_num_tokens", "free_memory_fraction", "max_tokens", "dtype"):
        assert knob in message


def test_cpu_fallback_is_capped_at_what_the_batch_can_use():
    config = engine_config(max_batch_size=4, max_seq_len=256)  # 4 sequences x 16 blocks

    roomy = kv_budget(profile(), config, host_bytes=64 * 2**30)
    tight = kv_budget(profile(), config, host_bytes=40 * BYTES_PER_BLOCK)

    assert roomy.num_blocks == 4 * 16 + 1 and roomy.source == "host memory"
    assert tight.num_blocks == int(40 * BYTES_PER_BLOCK * 0.9) // BYTES_PER_BLOCK
    capped = kv_budget(profile(), engine_config(max_tokens=20 * BLOCK_SIZE), host_bytes=64 * 2**30)
    assert capped.num_blocks == 21


def test_cpu_fallback_reads_the_host_when_not_given():
    assert capacity.host_available_bytes() > 0
    budget = kv_budget(profile(), engine_config())
    assert budget.source == "host memory" and budget.num_blocks == 4 * 16 + 1


def test_device_memory_and_activation_peak_readers():
    assert capacity.device_memory(SimpleNamespace(memory_stats=lambda: None)) is None
    assert capacity.device_memory(SimpleNamespace(memory_stats=lambda: {"bytes_in_use": 3})) is None
    stats = {"bytes_limit": 1000, "bytes_in_use": 300, "peak_bytes_in_use": 500}
    assert capacity.device_memory(SimpleNamespace(memory_stats=lambda: stats)) == (1000, 300)

    assert capacity.activation_peak(SimpleNamespace(memory_analysis=lambda: None)) == 0
    analysis = SimpleNamespace(temp_size_in_bytes=4096, argument_size_in_bytes=10**6)
    assert capacity.activation_peak(SimpleNamespace(memory_analysis=lambda: analysis)) == 4096
    compiled = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T).lower(jnp.ones((64, 64))).compile()
    assert isinstance(capacity.activation_peak(compiled), int) and capacity.activation_peak(compiled) >= 0


_MEMORY_FRACTION_PRELUDE = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from jaxserve import capacity
env = capacity.MEM_FRACTION_ENV
def call():
    return [capacity.raise_memory_fraction_default(), os.environ.get(env)]
"""
# The user's value is kept; once jax has a backend the variable is moot and left alone.
_USER_SET_THEN_INITIALISED = """
os.environ[env] = "0.5"
user_set = call()
del os.environ[env]
import jax
jax.devices()
print(json.dumps([user_set, call()]))
"""
# Unset before jax starts: raised, once per process.
_UNSET = """
print(json.dumps([call(), call()]))
"""


def run_fresh(script: str) -> tuple[list, str]:
    """Runs the prelude and `script` in a new Python process; returns its printed JSON and its log."""
    env = {k: v for k, v in os.environ.items() if k != capacity.MEM_FRACTION_ENV}
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, "-c", _MEMORY_FRACTION_PRELUDE + script]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_memory_fraction_is_kept_when_set_by_the_user_or_when_jax_has_started():
    (user_set, initialised), log = run_fresh(_USER_SET_THEN_INITIALISED)
    assert user_set == [False, "0.5"] and "=0.5 (set by the user)" in log
    assert initialised == [False, None] and "already initialised" in log


def test_memory_fraction_is_raised_when_unset_before_jax_starts():
    (first, second), log = run_fresh(_UNSET)
    fraction = capacity.DEFAULT_MEM_FRACTION
    assert first == [True, fraction] and second == [False, fraction]
    assert log.count(f"set {capacity.MEM_FRACTION_ENV}={fraction}") == 1
    # run_fresh runs on CPU (JAX_PLATFORMS=cpu): the log does not promise the GPU to the KV cache.
    assert "no effect on CPU" in log and "most of the GPU" not in log


def test_engine_sizes_its_pool_from_device_memory_and_a_probe_step(monkeypatch, caplog, tiny_model, make_llm):
    """The accelerator path on CPU, with faked memory statistics: the largest bucket is compiled over a
    small probe pool and run once; its peak and the compiled memory analysis feed the budget."""
    limit, in_use, probe_peak = 4 * GB, GB, GB + 300 * MiB
    state = {"peak": in_use}
    real_probe = capacity.peak_bytes_in_use
    monkeypatch.setattr(capacity, "device_memory", lambda device: (limit, in_use))
    monkeypatch.setattr(capacity, "peak_bytes_in_use", lambda device: state["peak"])
    from jaxserve import memory_probe

    original = memory_probe.probe_step

    def probe_step(*args):
        original(*args)  # really runs the step on its all-padding batch
        state["peak"] = probe_peak

    monkeypatch.setattr(memory_probe, "probe_step", probe_step)
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        llm = make_llm(tiny_model("llama"), max_seq_len=64)
    activation = 300 * MiB  # the probe's peak above what was in use: larger than the compiled temp here
    assert "probe step" in caplog.text
    expected = capacity.stable_num_blocks(
        int((limit - in_use - activation) * 0.9) // llm.engine.kv_budget.bytes_per_block
    )
    assert llm.engine.kv_budget.num_blocks == expected
    assert llm.engine.kv_budget.source == "device memory"
    assert real_probe(jax.devices()[0]) >= 0  # the real reader answers on CPU too (0: not reported)


def test_the_probe_pool_is_in_use_before_the_probe_step_not_counted_as_its_activations(
    monkeypatch, tiny_model, make_llm
):
    """The probe's pool holds one max_seq_len sequence (16 GiB at the 8B shape's 131072 tokens, measured on
    an H200 as a 17.25 GiB activation peak against 1.48 GiB at 256): it is allocated before the memory in
    use is read, so the probe step's peak above that is the step's own. Faked statistics: in use = the live
    arrays' bytes; the peak = what is live when the forward is called (the pool among its arguments) plus
    the step's own scratch; the compiled memory analysis is left out (0)."""
    from jaxserve import memory_probe
    from jaxserve.runner import Runner

    def live_bytes() -> int:
        return sum(array.nbytes for array in jax.live_arrays())

    scratch = 16 * 1024
    state = {"peak": 0}
    monkeypatch.setattr(capacity, "device_memory", lambda device: (live_bytes() + 256 * MiB, live_bytes()))
    monkeypatch.setattr(capacity, "peak_bytes_in_use", lambda device: state["peak"])
    monkeypatch.setattr(capacity, "activation_peak", lambda compiled: 0)
    original_probe, original_profile, profiles = memory_probe.probe_step, Runner.profile, []

    def probe_step(forward, sampler, *args):
        def sampled(*forward_args):
            state["peak"] = live_bytes() + scratch
            return forward(*forward_args)

        original_probe(sampled, sampler, *args)

    def profile(self):
        profiles.append(original_profile(self))
        return profiles[-1]

    monkeypatch.setattr(memory_probe, "probe_step", probe_step)
    monkeypatch.setattr(Runner, "profile", profile)
    llm = make_llm(tiny_model("llama"), max_seq_len=4096)
    buckets = llm.engine.steps.buckets
    pool_bytes = (buckets.max_blocks_per_seq + 1) * buckets.block_size * profiles[0].kv_bytes_per_token
    assert pool_bytes > 4 * scratch  # large enough to tell apart
    [device] = profiles[0].devices
    assert scratch <= device.activation_peak < scratch + pool_bytes // 2


def test_the_probe_runs_the_prompt_logprobs_variant_when_it_is_compiled(monkeypatch, tiny_model, make_llm):
    """With prompt-logprobs variants the largest step also holds a slice of full-vocabulary logits: that
    variant (of the largest token bucket) is the one probed."""
    from jaxserve import memory_probe
    from jaxserve.config import CompileConfig
    from jaxserve.variants import SamplerMode

    monkeypatch.setattr(capacity, "device_memory", lambda device: (4 * GB, GB))
    monkeypatch.setattr(capacity, "peak_bytes_in_use", lambda device: GB)
    probed = []
    original = memory_probe.probe_step

    def probe_step(forward, sampler, bucket, variant, *args):
        probed.append((bucket, variant))
        original(forward, sampler, bucket, variant, *args)

    monkeypatch.setattr(memory_probe, "probe_step", probe_step)
    config = CompileConfig(decode_batch_sizes=(4,), token_buckets=(16,), penalty_variants=False, prompt_logprobs=True)
    make_llm(tiny_model("llama"), max_seq_len=64, max_num_tokens=16, compile_config=config)
    [(bucket, variant)] = probed
    assert variant.prompt_logprobs and not bucket.decode_only and bucket.num_tokens == 16
    assert variant.sampler is SamplerMode.SORTED  # the sampler with the largest scratch memory


def test_auto_max_batch_size_takes_the_largest_size_whose_sequences_the_pool_holds():
    per_seq = capacity.AUTO_TOKENS_PER_SEQUENCE
    assert capacity.auto_max_batch_size(1024 * per_seq, 1024) == 1024
    assert capacity.auto_max_batch_size(1024 * per_seq - 1, 1024) == 512
    assert capacity.auto_max_batch_size(512 * per_seq - 1, 1024) == 256
    assert capacity.auto_max_batch_size(10, 1024) == 256  # the smallest: the scheduler admits what fits
    assert capacity.auto_max_batch_size(10**9, 512) == 512  # never above the upper bound
    assert capacity.auto_max_batch_size(10**9, 100) == 100


@pytest.mark.parametrize(("kv_tokens", "expected"), [(100_000, 256), (300_000, 1024)])
def test_an_auto_engine_lowers_max_batch_size_to_what_the_pool_holds(
    monkeypatch, tiny_model, char_tokenizer, kv_tokens, expected
):
    """On an accelerator (faked memory statistics) the engine profiles at the upper bound, sizes the pool
    (here capped by kv_cache.max_tokens), then builds its step table for the size the pool holds (lazily
    started: the table is what warmup would compile; compiling all of it on a CPU adds nothing here)."""
    from jaxserve.config import CompileConfig, make_engine_config
    from jaxserve.engine import Engine

    monkeypatch.setattr(capacity, "device_memory", lambda device: (40 * GB, GB))
    monkeypatch.setattr(capacity, "peak_bytes_in_use", lambda device: GB)
    model = tiny_model("llama")
    buckets = CompileConfig(decode_batch_sizes=(1, 256, 1024), token_buckets=(1024,), penalty_variants=False, lazy=True)
    config = make_engine_config(
        model.hf_config,
        max_batch_size=1024,
        max_num_tokens=1024,
        max_seq_len=64,
        kv_cache=KvCacheConfig(max_tokens=kv_tokens),
        compile=buckets,
        attention_backend="xla",
        auto_max_batch_size=True,
    )
    engine = Engine(model.family, model.config, model.weights, char_tokenizer(), config, show_progress=False)
    assert engine.config.max_batch_size == expected and not engine.config.auto_max_batch_size
    assert engine.buckets.max_batch_size == expected and engine.buckets.decode_batch_sizes[-1] == expected
    assert {b.num_seqs for b, _ in engine.runner.spec.steps.compiled_steps()} == {1, 256, expected}
    assert engine.runner.table.lazy and engine.runner.table.num_executables == 0
    assert engine.runner.state.previous.shape == (expected,)

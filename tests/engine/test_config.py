"""Engine configs: validation messages, the max_seq_len / max_num_tokens rules, and no jax in host policy."""

import logging
import subprocess
import sys

import pytest

from jaxserve.config import (
    DEFAULT_MAX_NUM_TOKENS,
    CapacityPolicy,
    CompileConfig,
    EngineConfig,
    KvCacheConfig,
    LoraConfig,
    SchedulerConfig,
    default_max_num_tokens,
    infer_max_seq_len,
    make_engine_config,
    model_max_seq_len,
)

HOST_POLICY_MODULES = (
    "jaxserve.config",
    "jaxserve.sampling",
    "jaxserve.request",
    "jaxserve.block_manager",
    "jaxserve.scheduler",
    "jaxserve.buckets",
    "jaxserve.variants",
    "jaxserve.step_inputs",
)


def test_host_policy_modules_do_not_import_jax():
    code = "import sys\n" + "".join(f"import {m}\n" for m in HOST_POLICY_MODULES)
    code += "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
    code += "assert not bad, bad\n"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_are_valid():
    kv = KvCacheConfig()
    assert (kv.block_size, kv.free_memory_fraction, kv.enable_prefix_caching) == (16, 0.9, True)
    assert SchedulerConfig().capacity_policy is CapacityPolicy.GUARANTEED_NO_EVICT
    assert SchedulerConfig().enable_chunked_prefill
    config = EngineConfig(max_batch_size=8, max_num_tokens=256, max_seq_len=100)
    assert config.attention_backend == "auto"
    assert config.max_blocks_per_seq == 7  # ceil(100 / 16)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 12}, "block_size"),
        ({"block_size": 2048}, "block_size"),
        ({"free_memory_fraction": 0.0}, "free_memory_fraction"),
        ({"free_memory_fraction": 1.5}, "free_memory_fraction"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_gpu_total_bytes": -1}, "max_gpu_total_bytes"),
        ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ],
)
def test_kv_cache_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        KvCacheConfig(**kwargs)


def test_scheduler_config_rejects_unknown_policy():
    with pytest.raises(ValueError, match="capacity_policy.*GUARANTEED_NO_EVICT, MAX_UTILIZATION"):
        SchedulerConfig(capacity_policy="fcfs")


def test_scheduler_config_bucket_aware_admission_is_on_and_a_bool():
    assert SchedulerConfig().bucket_aware_admission is True
    with pytest.raises(ValueError, match="bucket_aware_admission must be a bool, got 'no'"):
        SchedulerConfig(bucket_aware_admission="no")


def test_compile_config_normalizes_and_rejects():
    config = CompileConfig(decode_batch_sizes=[8, 1, 8, 4], token_buckets=(64, 16))
    assert config.decode_batch_sizes == (1, 4, 8)
    assert config.token_buckets == (16, 64)
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        CompileConfig(decode_batch_sizes=[0, 4])
    with pytest.raises(ValueError, match="token_buckets"):
        CompileConfig(token_buckets=[])
    with pytest.raises(ValueError, match="cache_dir"):
        CompileConfig(cache_dir="")
    with pytest.raises(ValueError, match="penalty_variants must be a bool"):
        CompileConfig(penalty_variants=1)
    with pytest.raises(ValueError, match="prompt_logprobs must be a bool"):
        CompileConfig(prompt_logprobs="yes")
    for threads in (0, 1.5, True):
        with pytest.raises(ValueError, match="compile_threads must be None or an int >= 1"):
            CompileConfig(compile_threads=threads)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"max_seq_len": 1}, "max_seq_len"),
        ({"max_seq_len": 2.5}, "max_seq_len"),
        ({"attention_backend": "cuda"}, "attention_backend"),
        ({"dtype": "int8"}, "dtype"),
        ({"kv_cache": {"block_size": 16}}, "kv_cache"),
    ],
)
def test_engine_config_rejects(kwargs, field):
    base = {"max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 128}
    with pytest.raises(ValueError, match=field):
        EngineConfig(**(base | kwargs))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"), ({"fold": "yes"}, "fold")],
)
def test_lora_config_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LoraConfig(**kwargs)
    assert LoraConfig().fold is True  # the tables folded into the weights where they can be, unless turned off


@pytest.mark.parametrize(
    ("hf_config", "expected"),
    [
        ({"max_position_embeddings": 8192}, 8192),
        ({}, 2048),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
        ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 8192),
        ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, 8192),
        # These types already state the extended length in max_position_embeddings.
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        ({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}, 32768),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "longrope", "factor": 32.0}}, 4096),
        ({"max_position_embeddings": 2048, "rope_scaling": None}, 2048),
    ],
)
def test_model_max_seq_len(hf_config, expected):
    assert model_max_seq_len(hf_config) == expected


def test_infer_max_seq_len_keeps_a_smaller_user_value_and_clamps_a_larger_one(caplog):
    hf_config = {"max_position_embeddings": 1024}
    assert infer_max_seq_len(hf_config, None) == 1024
    assert infer_max_seq_len(hf_config, 512) == 512
    with caplog.at_level(logging.WARNING, logger="jaxserve.config"):
        assert infer_max_seq_len(hf_config, 4096) == 1024
    assert any("4096" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ValueError, match="max_seq_len"):
        infer_max_seq_len(hf_config, 0)


def test_default_max_num_tokens(caplog):
    assert default_max_num_tokens(max_batch_size=64, max_seq_len=4096) == DEFAULT_MAX_NUM_TOKENS
    assert default_max_num_tokens(max_batch_size=64, max_seq_len=4096, user_value=1000) == 1000
    # Never more than a step can hold: max_batch_size * max_seq_len.
    assert default_max_num_tokens(max_batch_size=2, max_seq_len=100) == 200
    with caplog.at_level(logging.WARNING, logger="jaxserve.config"):
        assert default_max_num_tokens(max_batch_size=2, max_seq_len=100, user_value=500) == 200
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    with pytest.raises(ValueError, match="max_num_tokens"):
        default_max_num_tokens(max_batch_size=2, max_seq_len=100, user_value=0)


def test_make_engine_config_applies_both_rules():
    config = make_engine_config({"max_position_embeddings": 512}, max_batch_size=4, max_seq_len=9999)
    assert config.max_seq_len == 512
    assert config.max_num_tokens == 2048  # 8192 capped at 4 * 512
    assert config.kv_cache == KvCacheConfig()

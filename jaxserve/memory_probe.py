"""The capacity probe: bytes per KV token, and per device the memory left once the largest step of the table
is compiled over a small probe pool and run once; `capacity.kv_budget` sizes the KV pool from it
(docs/architecture.md, "KV layout and capacity")."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import jax
from jax.sharding import Mesh

from jaxserve import capacity
from jaxserve.buckets import Bucket
from jaxserve.models.attention import PagedKVCache
from jaxserve.step import StepState
from jaxserve.step_inputs import padding_inputs
from jaxserve.step_table import StepTable, cache_specs, zero_cache
from jaxserve.variants import StepConfig, StepVariant

logger = logging.getLogger("jaxserve.runner").getChild("memory_probe")


def profile_memory(table: StepTable, mesh: Mesh, weights: Any, state: StepState) -> capacity.MemoryProfile:
    """Bytes per KV token, and per device the memory left once the largest step is compiled over a small
    probe pool and run once (`probe_step`, on the weights and step state given) on an all-padding batch, the
    pool donated to it (no device statistics, as on CPU: bytes per token only).
    This process's devices only: in a multi-process run each process profiles its own, then they agree on the
    smallest pool (`distributed.agree_on_num_blocks`)."""
    spec = table.spec
    per_token = capacity.kv_bytes_per_token(cache_specs(spec, 2), mesh, spec.cache_dtype)
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if any(capacity.device_memory(d) is None for d in devices):
        return capacity.MemoryProfile(per_token)
    bucket, variant = spec.steps.largest_step()
    probe_blocks = spec.steps.buckets.max_blocks_per_seq + 1
    forward = table.compile_forward(bucket, variant.prompt_logprobs, probe_blocks)
    sampler = table.compile_sampler(bucket.num_seqs, variant.sampler, variant.penalties)
    compiled_peak = max(capacity.activation_peak(forward), capacity.activation_peak(sampler))
    # The probe's pool (one max_seq_len sequence) is in use before the step, as the real pool will be, so
    # that only the step's own memory counts.
    probe_pool = zero_cache(spec, mesh, probe_blocks)
    before = [capacity.device_memory(d) for d in devices]
    probe_step(forward, sampler, bucket, variant, probe_pool, weights, state, spec.steps)
    peaks = [capacity.peak_bytes_in_use(d) for d in devices]
    # The probe step's peak above what was in use before it. peak_bytes_in_use never resets, so a
    # load-time peak can hide the step's: the compiled figure stays the floor.
    measured = max(p - in_use for p, (_, in_use) in zip(peaks, before, strict=True))
    peak = max(compiled_peak, measured)
    logger.info(
        "activation peak of T=%d B=%d %s: %.2f GiB (compiled memory analysis), %.2f GiB (probe step); using %.2f GiB",
        bucket.num_tokens,
        bucket.num_seqs,
        variant,
        compiled_peak / 2**30,
        measured / 2**30,
        peak / 2**30,
    )
    memory = [capacity.device_memory(d) for d in devices]
    return capacity.MemoryProfile(per_token, tuple(capacity.DeviceMemory(lim, use, peak) for lim, use in memory))


def probe_step(
    forward: jax.stages.Compiled,
    sampler: jax.stages.Compiled,
    bucket: Bucket,
    variant: StepVariant,
    kv_cache: PagedKVCache,
    weights: Any,
    state: StepState,
    steps: StepConfig,
) -> None:
    """Runs a step compiled for a small pool once on an all-padding batch (for its memory peak); the pool
    `kv_cache` is donated to it."""
    inputs = padding_inputs(bucket, variant, steps)
    out, _ = forward(weights, kv_cache, replace(inputs, history=None), state.previous, state.key)
    jax.block_until_ready(sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, state.key))

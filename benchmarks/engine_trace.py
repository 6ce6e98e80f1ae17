"""Where an engine step's wall time goes: host phases per step, and the device's idle gaps between steps.

    python benchmarks/engine_trace.py --random-weights llama-3.1-8b --num-requests 1 --input-len 128 --output-len 128
    python benchmarks/engine_trace.py --random-weights llama-3.1-8b --num-requests 1024 --input-len 128 --output-len 128
    python benchmarks/engine_trace.py --random-weights tiny-llama --num-requests 8 --input-len 16 --output-len 16

The engine is built as `jaxserve bench throughput` builds it (the same options, default settings). A
warm-up generate of a few other prompts (as the bench's) comes first. The workload's generate then runs
with the engine's functions wrapped by timers: the scheduler's `schedule`, `make_step_inputs`, the
forward's and the sampler's call inside `Runner.run`, the wait for a step's tokens, and the rest of
processing them; steps --trace-from to --trace-from + --trace-steps run under `jax.profiler.trace`.
Per phase: mean and p90 ms per step over the decode-only steps (every row one token) and over the
others. From the trace: the device's busy time (the union of its kernels and copies), its idle time
between the first and the last event of the window, the largest idle gaps with the events around them,
host-to-device copies per step, and the host threads' events with the most total time (where a call
that returns late spends it).
"""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_profile import Event, busy_and_span_us, device_events, read_trace  # noqa: E402

from jaxserve import bench, capacity, cli, gpu_client  # noqa: E402
from jaxserve import engine as engine_module  # noqa: E402
from jaxserve import workload as workloads  # noqa: E402
from jaxserve.config import model_max_seq_len  # noqa: E402

PHASES = ("schedule", "inputs", "forward_call", "sampler_call", "wait_tokens", "process_rest", "step_total")


class Timers:
    """Per-step phase durations (seconds), keyed by the step's index."""

    def __init__(self) -> None:
        self.step = -1
        self.by_step: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
        self.decode_only: dict[int, bool] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.by_step[self.step][phase] += seconds

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)

        return timed


def instrument(llm: Any, timers: Timers) -> None:
    engine, runner = llm.engine, llm.engine.runner
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    make_inputs = engine_module.make_step_inputs

    def inputs(batch: Any, previous: Any, steps: Any) -> Any:
        timers.decode_only[timers.step] = all(row.num_tokens == 1 for row in batch.rows)
        return make_inputs(batch, previous, steps)

    engine_module.make_step_inputs = timers.wrap("inputs", inputs)
    executables = runner._executables

    def timed_executables(bucket: Any, variant: Any) -> Any:
        found = executables(bucket, variant)
        if found is None:
            return None
        forward, sampler = found
        return timers.wrap("forward_call", forward), timers.wrap("sampler_call", sampler)

    runner._executables = timed_executables
    process = engine._process

    def timed_process(flight: Any) -> Any:
        start = time.perf_counter()
        jax.block_until_ready(flight.output.token_ids)
        waited = time.perf_counter()
        timers.add("wait_tokens", waited - start)
        try:
            return process(flight)
        finally:
            timers.add("process_rest", time.perf_counter() - waited)

    engine._process = timed_process
    step = engine.step

    def timed_step() -> Any:
        timers.step += 1
        start = time.perf_counter()
        try:
            return step()
        finally:
            timers.add("step_total", time.perf_counter() - start)

    engine.step = timed_step


def phase_table(timers: Timers, skip: int) -> None:
    groups = {"decode-only": [], "other": []}
    for index, phases in sorted(timers.by_step.items()):
        if index < skip or index not in timers.decode_only:
            continue
        groups["decode-only" if timers.decode_only[index] else "other"].append(phases)
    for name, steps in groups.items():
        if not steps:
            continue
        print(f"\n{name} steps: {len(steps)} (ms per step: mean / p90 / max)")
        for phase in PHASES:
            values = [1e3 * s.get(phase, 0.0) for s in steps]
            p90 = float(np.percentile(values, 90))
            print(f"  {phase:<14} {statistics.fmean(values):8.3f} / {p90:8.3f} / {max(values):8.3f}")
        shares = [(s.get("forward_call", 0.0) + s.get("sampler_call", 0.0)) / s["step_total"] for s in steps]
        print(f"  dispatch (forward + sampler call) / step: mean {statistics.fmean(shares):.1%}, max {max(shares):.1%}")


def trace_summary(events: list[Event], num_steps: int, top: int) -> None:
    device, rule = device_events(events, jax.default_backend())
    print(f"\ntrace: {len(events)} events, {len(device)} device events ({rule}), {num_steps} steps")
    if device:
        busy, span = busy_and_span_us(device)
        print(
            f"  device busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span: "
            f"idle {(span - busy) / num_steps:.1f} µs/step"
        )
        ordered = sorted(device, key=lambda e: e.ts)
        gaps, end, last = [], ordered[0].ts + ordered[0].dur, ordered[0]
        for e in ordered[1:]:
            if e.ts > end:
                gaps.append((e.ts - end, last.name, e.name))
            if e.ts + e.dur >= end:
                end, last = e.ts + e.dur, e
        gaps.sort(reverse=True)
        print(
            f"  idle gaps > 5 µs: {sum(1 for g in gaps if g[0] > 5)}, "
            f"their sum {sum(g[0] for g in gaps if g[0] > 5) / 1e3:.2f} ms"
        )
        for gap, before, after in gaps[:top]:
            print(f"    {gap:9.1f} µs after {before[:60]!r} before {after[:60]!r}")
        copies = collections.Counter()
        copy_us = collections.Counter()
        for e in device:
            lowered = e.name.lower()
            if "memcpy" in lowered or "memset" in lowered:
                copies[e.name[:50]] += 1
                copy_us[e.name[:50]] += e.dur
        for name, count in copies.most_common(8):
            print(f"  {name:<50} {count / num_steps:6.1f}/step {copy_us[name] / num_steps:8.1f} µs/step")
    host = [e for e in events if e not in set(device) and not e.process.startswith("/device")]
    totals, counts = collections.Counter(), collections.Counter()
    for e in host:
        totals[(e.thread[:24], e.name[:70])] += e.dur
        counts[(e.thread[:24], e.name[:70])] += 1
    print(f"  host events by total time (µs per step, count per step), top {top}:")
    for (thread, name), total in totals.most_common(top):
        print(f"    {total / num_steps:9.1f} {counts[(thread, name)] / num_steps:6.1f}  {thread:<24} {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace-from", type=int, default=40, help="first traced step of the timed generate")
    parser.add_argument("--trace-steps", type=int, default=10)
    parser.add_argument("--trace-dir", default="/tmp/engine_trace")
    parser.add_argument("--top", type=int, default=12)
    ours, rest = parser.parse_known_args()
    args = cli.build_parser().parse_args(["bench", "throughput", *rest])
    cli._validate_bench(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    capacity.raise_memory_fraction_default()
    gpu_client.use_tfrt_client_default(cli._engine_devices(args))
    model, tokenizer = bench.load_model(args.model, args.random_weights, args.dtype, args.tokenizer)
    vocab = model.config.vocab_size
    work = workloads.random_workload(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
    limit = model_max_seq_len(model.hf_config)
    llm = cli._bench_llm(
        args, model, tokenizer, workloads.engine_max_seq_len(work.max_seq_len, args.max_seq_len, limit)
    )
    seed = args.seed if args.seed_per_request else None
    options = workloads.SamplingOptions(args.temperature, args.top_p, args.top_k, seed)
    warmup = workloads.warmup_workload(work, vocab, args.seed)  # other prompts: the timed run prefills its own
    llm.generate(warmup.prompts, options.params(warmup.output_lens), use_tqdm=False)
    params = options.params(work.output_lens)

    timers = Timers()
    instrument(llm, timers)
    step = llm.engine.step
    options = jax.profiler.ProfileOptions()
    if hasattr(options, "python_tracer_level"):
        options.python_tracer_level = 0
    tracing = {"on": False, "done": False}

    def traced_step() -> Any:
        if not tracing["on"] and not tracing["done"] and timers.step + 1 == ours.trace_from:
            jax.profiler.start_trace(ours.trace_dir, profiler_options=options)
            tracing["on"] = True
        out = step()
        if tracing["on"] and timers.step + 1 == ours.trace_from + ours.trace_steps:
            jax.block_until_ready(llm.engine.runner.kv_cache)
            jax.profiler.stop_trace()
            tracing.update(on=False, done=True)
        return out

    llm.engine.step = traced_step
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if tracing["on"]:
        jax.profiler.stop_trace()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {tokens} output tokens in {elapsed:.3f} s: "
        f"{tokens / elapsed:,.0f} tok/s, {timers.step + 1} steps"
    )
    phase_table(timers, skip=2)
    runs = glob.glob(os.path.join(ours.trace_dir, "plugins", "profile", "*"))
    if tracing["done"] and runs:
        trace_summary(read_trace(max(runs, key=os.path.getmtime)), ours.trace_steps, ours.top)
    else:
        print(f"\nno trace: the generate took {timers.step + 1} steps, fewer than --trace-from {ours.trace_from}")


if __name__ == "__main__":
    main()

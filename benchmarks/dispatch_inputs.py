"""What a compiled step's dispatch costs with its step inputs as host arrays, fresh device arrays, or the same
device arrays every call: does the launch depend on where the inputs live?

    python benchmarks/dispatch_inputs.py --batch 32 --context 192
    python benchmarks/dispatch_inputs.py --shape tiny --batch 4 --context 32 --backend xla   # CPU check

The runner and the decode step are step_profile.py's (one decode bucket of --batch rows, every row at
--context, its input carried from the previous step). Per mode, --calls `runner.run` calls with the device
idle before each ("idle": time until the call returns, and the thread's CPU time), then --calls back to back
("busy": the same, and "step", the wall time per call of the whole sequence: the device's pace once the
queue is full), and a checksum of the last call's tokens ("tokens": the same in every run of the same
arguments, whatever XLA_FLAGS say, or a flag changed the results); see `run_mode`. Modes:
- host: the step inputs as numpy arrays, as the engine passes them (each call copies them to the device);
- fresh: `jax.device_put` of the inputs before each call (timed apart as "put"), the call gets device arrays;
- same: one `jax.device_put` before the loop, the same device arrays every call (their addresses stable);
- two: two such sets, alternating (addresses alternate, as with a step in flight while the next is built).
XLA's command buffers (CUDA graphs) are recorded again when a buffer their commands use has moved; if "same"
dispatched far faster than "host", the launch cost would be that update (on the H200 it did not: see
docs/benchmarks.md, "Fifteenth 8B run").

--trace K then runs K + 1 more "host" calls (the first is not counted) under `jax.profiler.trace`, the device
idle before each, and lists the host's events (every thread of every process that is not a device's: jax's
and XLA's TraceMe scopes, CUPTI's CUDA API calls) by name: calls, total and own time (less the events nested
in them on that thread) per dispatch, most own time first. That is where a dispatch's host time goes.

--parts K times the step's calls apart over K more "host" calls, the device idle before each: the forward's
and the sampler's (none in a greedy step, whose forward samples: `StepVariant.greedy_in_forward`; use
--variant candidates for a two-call step).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import (  # noqa: E402
    DEVICE_PROCESS,
    SHAPES,
    VARIANTS,
    Event,
    build_runner,
    decode_workload,
    profiled_events,
)

from jaxserve.models import registry  # noqa: E402
from jaxserve.sampling import SamplingParams  # noqa: E402
from jaxserve.step_table import enable_compilation_cache  # noqa: E402


def run_mode(runner: Any, work: Any, variant: Any, mode: str, calls: int) -> dict[str, float]:
    """Two loops: "idle" waits for each step before timing the next call (the host's own cost of a dispatch,
    wall and this thread's CPU time); "busy" runs the calls back to back (the dispatch may then wait for
    the device: its queue is bounded) and gives the step's pace."""
    inputs = work.inputs
    sets = []
    if mode in ("same", "two"):
        sets = [jax.device_put(inputs) for _ in range(1 if mode == "same" else 2)]
        jax.block_until_ready(sets)

    def args_for(i: int, put: list[float]) -> Any:
        if mode == "host":
            return inputs
        if mode == "fresh":
            t0 = time.perf_counter()
            fresh = jax.device_put(inputs)
            put.append(time.perf_counter() - t0)
            return fresh
        return sets[i % len(sets)]

    for i in range(3):  # warm up this mode's argument handling
        jax.block_until_ready(runner.run(args_for(i, []), work.bucket, variant))
    idle, idle_cpu, put = [], [], []
    for i in range(calls):
        args = args_for(i, put)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = runner.run(args, work.bucket, variant)
        idle.append(time.perf_counter() - t0)
        idle_cpu.append(time.thread_time() - c0)
        jax.block_until_ready((out, runner.kv_cache))
    busy, busy_cpu = [], []
    start = time.perf_counter()
    for i in range(calls):
        args = args_for(i, [])
        t0, c0 = time.perf_counter(), time.thread_time()
        out = runner.run(args, work.bucket, variant)
        busy.append(time.perf_counter() - t0)
        busy_cpu.append(time.thread_time() - c0)
    jax.block_until_ready((out, runner.kv_cache))
    step = (time.perf_counter() - start) / calls
    tokens = np.asarray(out.token_ids).astype(np.int64)
    return {
        "tokens": float(np.sum(tokens * np.arange(1, tokens.size + 1)) % 1_000_003),
        "idle_ms": 1e3 * statistics.median(idle),
        "idle_cpu_ms": 1e3 * statistics.median(idle_cpu),
        "busy_ms": 1e3 * statistics.mean(busy),
        "busy_cpu_ms": 1e3 * statistics.mean(busy_cpu),
        "put_ms": 1e3 * statistics.median(put) if put else 0.0,
        "step_ms": 1e3 * step,
    }


def part_times(runner: Any, work: Any, variant: Any, calls: int) -> dict[str, float]:
    """Median ms of the forward's call and of the sampler's call (none in a `greedy_in_forward` step), each
    with the device idle before it, as `runner.run` makes them (host inputs)."""
    forward, sampler = runner._executables(work.bucket, variant)
    inputs = work.inputs
    forward_s, sampler_s = [], []
    for i in range(3 + calls):  # the first three warm up the argument handling
        t0 = time.perf_counter()
        out, runner.kv_cache = forward(
            runner.weights, runner.kv_cache, replace(inputs, history=None), runner._previous, runner._key
        )
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        tokens, key = out.greedy_tokens, out.next_key
        t2 = time.perf_counter()
        if sampler is not None:
            tokens, _, key = sampler(out.logits, out.last_tokens, inputs.sampling, inputs.history, runner._key)
        t3 = time.perf_counter()
        jax.block_until_ready(tokens)
        runner._previous, runner._key = tokens, key
        if i >= 3:
            forward_s.append(t1 - t0)
            sampler_s.append(t3 - t2)
    return {"forward_ms": 1e3 * statistics.median(forward_s), "sampler_ms": 1e3 * statistics.median(sampler_s)}


def traced_dispatches(runner: Any, work: Any, variant: Any, calls: int) -> list[Event]:
    """The host events of `calls` dispatches, each with the device idle before it (python tracer off)."""
    for _ in range(3):
        jax.block_until_ready((runner.run(work.inputs, work.bucket, variant), runner.kv_cache))

    def dispatches() -> None:
        for _ in range(calls):
            with jax.profiler.TraceAnnotation("dispatch_inputs.call"):
                out = runner.run(work.inputs, work.bucket, variant)
            jax.block_until_ready((out, runner.kv_cache))

    events = profiled_events(dispatches, tempfile.mkdtemp(prefix="dispatch_trace_"))
    return [e for e in events if not DEVICE_PROCESS.search(e.process)]


def own_times(events: list[Event]) -> list[tuple[Event, float]]:
    """Each event with its own time: its duration less that of the events directly nested in it on its thread."""
    by_thread: dict[tuple[str, str], list[Event]] = collections.defaultdict(list)
    for e in events:
        by_thread[(e.process, e.thread)].append(e)
    result = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.ts, -e.dur))
        own = [e.dur for e in thread_events]
        stack: list[int] = []
        for i, e in enumerate(thread_events):
            while stack and thread_events[stack[-1]].ts + thread_events[stack[-1]].dur <= e.ts:
                stack.pop()
            if stack:
                own[stack[-1]] -= e.dur
            stack.append(i)
        result.extend(zip(thread_events, own, strict=True))
    return result


def print_host_events(events: list[Event], top: int) -> None:
    """The host events inside the traced dispatches, by name (module docstring)."""
    windows = sorted((e.ts, e.ts + e.dur) for e in events if e.name == "dispatch_inputs.call")
    if len(windows) < 2:
        print(f"trace: {len(windows)} dispatch_inputs.call annotations in the trace, 2 or more needed")
        return
    windows, calls = windows[1:], len(windows) - 1  # the first traced call pays the profiler's start
    starts = [w[0] for w in windows]

    def inside(e: Event) -> bool:
        i = bisect.bisect_right(starts, e.ts) - 1
        return i >= 0 and e.ts < windows[i][1]

    kept = [e for e in events if e.name != "dispatch_inputs.call" and inside(e)]
    stats: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e, own in own_times(kept):
        row = stats[(e.thread, e.name)]
        row[0] += 1
        row[1] += e.dur
        row[2] += own
    call_ms = sum(b - a for a, b in windows) / calls / 1e3
    print(f"trace: {calls} dispatches, {call_ms:.3f} ms each inside the annotation; host events by own time")
    print(f"{'thread':>24} {'calls/dispatch':>14} {'total ms':>9} {'own ms':>8}  name")
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])
    for (thread, name), (n, total, own) in ranked[:top]:
        print(
            f"{thread[:24]:>24} {n / calls:>14.1f} {total / calls / 1e3:>9.3f} {own / calls / 1e3:>8.3f}  {name[:90]}"
        )
    per_thread: dict[str, float] = collections.defaultdict(float)
    for (thread, _), (_, _, own) in stats.items():
        per_thread[thread] += own
    print("own ms per dispatch by thread: " + ", ".join(f"{t}: {v / calls / 1e3:.3f}" for t, v in per_thread.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--backend", choices=["pallas", "xla"], default="pallas")
    parser.add_argument("--variant", default="greedy", choices=sorted(VARIANTS))
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the modes (order host, fresh, same, two)")
    parser.add_argument("--trace", type=int, default=0, help="dispatches traced after the modes (0: none)")
    parser.add_argument("--parts", type=int, default=0, help="calls timing the forward and sampler apart (0: none)")
    parser.add_argument("--top", type=int, default=30, help="host events listed from the trace")
    args = parser.parse_args()
    args.prefill = None
    enable_compilation_cache(None)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {' '.join(sys.argv[1:])}")
    override = {"num_hidden_layers": args.layers} if args.layers else {}
    family, cfg = registry.resolve({**SHAPES[args.shape], **override})
    weights = jax.block_until_ready(family.init_weights(cfg, jax.random.key(0), jnp.dtype(args.dtype)))
    runner = build_runner(args, family, cfg, weights)
    del weights
    work = decode_workload(runner.spec.steps, args.batch, args.context, SamplingParams(temperature=0.0))
    leaves = len(jax.tree.leaves(replace(work.inputs, history=None)))
    print(f"step inputs: {leaves} arrays to the forward; weights: {len(jax.tree.leaves(runner.weights))} arrays")
    variant = VARIANTS[args.variant]
    names = ("idle_ms", "idle_cpu_ms", "busy_ms", "busy_cpu_ms", "put_ms", "step_ms", "tokens")
    print(f"{'pass':>4} {'mode':>6} " + " ".join(f"{n:>12}" for n in names))
    for repeat in range(args.repeats):
        for mode in ("host", "fresh", "same", "two"):
            r = run_mode(runner, work, variant, mode, args.calls)
            print(f"{repeat:>4} {mode:>6} " + " ".join(f"{r[n]:>12.3f}" for n in names), flush=True)
    if args.parts:
        parts = part_times(runner, work, variant, args.parts)
        print("parts, idle ms a call: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    if args.trace:
        print_host_events(traced_dispatches(runner, work, variant, args.trace + 1), args.top)


if __name__ == "__main__":
    main()

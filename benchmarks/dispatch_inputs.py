"""What a compiled step's dispatch costs with its step inputs as host arrays, fresh device arrays, or the same
device arrays every call: does the launch depend on where the inputs live?

    python benchmarks/dispatch_inputs.py --batch 32 --context 192
    python benchmarks/dispatch_inputs.py --shape tiny --batch 4 --context 32 --backend xla   # CPU check

The runner and the decode step are step_profile.py's (one decode bucket of --batch rows, every row at
--context, its input carried from the previous step). Per mode, --calls `runner.run` calls with the device
idle before each ("idle": time until the call returns, and the thread's CPU time), then --calls back to back
("busy": the same, and "step", the wall time per call of the whole sequence: the device's pace once the
queue is full); see `run_mode`. Modes:
- host: the step inputs as numpy arrays, as the engine passes them (each call copies them to the device);
- fresh: `jax.device_put` of the inputs before each call (timed apart as "put"), the call gets device arrays;
- same: one `jax.device_put` before the loop, the same device arrays every call (their addresses stable);
- two: two such sets, alternating (addresses alternate, as with a step in flight while the next is built).
XLA's command buffers (CUDA graphs) are recorded again when a buffer their commands use has moved; if "same"
dispatched far faster than "host", the launch cost would be that update (on the H200 it did not: see
docs/benchmarks.md, "Fifteenth 8B run").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import SHAPES, VARIANTS, build_runner, decode_workload  # noqa: E402

from jaxserve.runner import enable_compilation_cache  # noqa: E402
from jaxserve.sampling import SamplingParams  # noqa: E402
from models import registry  # noqa: E402


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
    return {
        "idle_ms": 1e3 * statistics.median(idle),
        "idle_cpu_ms": 1e3 * statistics.median(idle_cpu),
        "busy_ms": 1e3 * statistics.mean(busy),
        "busy_cpu_ms": 1e3 * statistics.mean(busy_cpu),
        "put_ms": 1e3 * statistics.median(put) if put else 0.0,
        "step_ms": 1e3 * step,
    }


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
    names = ("idle_ms", "idle_cpu_ms", "busy_ms", "busy_cpu_ms", "put_ms", "step_ms")
    print(f"{'pass':>4} {'mode':>6} " + " ".join(f"{n:>12}" for n in names))
    for repeat in range(args.repeats):
        for mode in ("host", "fresh", "same", "two"):
            r = run_mode(runner, work, variant, mode, args.calls)
            print(f"{repeat:>4} {mode:>6} " + " ".join(f"{r[n]:>12.3f}" for n in names), flush=True)


if __name__ == "__main__":
    main()

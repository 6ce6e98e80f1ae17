"""What the benchmark scripts share: model shapes (HF config dicts, `jaxserve.models.shapes`) and two device
timers.

Scripts run as `python benchmarks/<name>.py`, so this folder is on sys.path and `import common` works.
"""

from __future__ import annotations

import statistics
import time

import jax

from jaxserve.models.shapes import LLAMA_3_1_8B, SMOLLM2_135M

__all__ = ["LLAMA_3_1_8B", "SMOLLM2_135M", "time_calls", "timed_ms"]


def timed_ms(fn, *args, reps: int = 20) -> float:
    """Mean milliseconds per call over `reps` calls after one warm-up call, waiting for the device."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3


def time_calls(fn, arg_sets: list[tuple], reps: int) -> float:
    """Seconds per call: `reps` calls (cycling through arg_sets) inside one jit, median of five runs."""
    sets = [arg_sets[i % len(arg_sets)] for i in range(reps)]
    many = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(many(sets))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(many(sets))
        runs.append((time.perf_counter() - start) / reps)
    return statistics.median(runs)

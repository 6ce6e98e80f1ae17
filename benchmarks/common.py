"""What the benchmark scripts share: model shapes (HF config dicts, `jaxserve.models.shapes`) and a device
timer.

Scripts run as `python benchmarks/<name>.py`, so this folder is on sys.path and `import common` works.
"""

from __future__ import annotations

import time

import jax

from jaxserve.models.shapes import LLAMA_3_1_8B, SMOLLM2_135M

__all__ = ["LLAMA_3_1_8B", "SMOLLM2_135M", "timed_ms"]


def timed_ms(fn, *args, reps: int = 20) -> float:
    """Mean milliseconds per call over `reps` calls after one warm-up call, waiting for the device."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps * 1e3

"""Collection order for parallel runs: the files that take a minute or more on a 2-core CPU first; and the
compile recorder the engine, LoRA and tunix tests share.

Under `-n auto --dist loadfile` (README.md) each file is one unit of work and the workers take units in
collection order, so a long file collected last keeps one worker busy after the others have finished. Moving
the longest files to the front lets the short ones fill in around them. The order of the tests inside a file
is kept, and a serial run runs the same tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest

# Longest first: the files over ~40 s of worker time in a full run with cold step stores (what CI runs: any edit of
# the jaxserve source changes every stored step's key) on a 2-core CPU with two workers (per-file sums of
# `--durations=0`, 2026-12-07, the GGUF header read by jaxserve): the engine against the dense reference (~320),
# the backends, FP8 quality, the Gemma 3 270M model and the notebooks (~140 each), the two-process runs (~130),
# FP8 engine, CLI, MoE meshes, lazy compilation and bench (~90-105 each), then the attention tilings,
# completions, quantization, kernel, GGUF, sharding and model files of 40-65 s. A file of ~100 s that happens to
# be collected last would otherwise keep one worker busy for that long after the other has finished.
LONGEST_FIRST = (
    # Python 3.12 with tunix only (.ci/run): the longest files of that run, collected last before (~90 and ~65 s).
    "tests/integrations/test_tunix_gemma.py",
    "tests/integrations/test_tunix.py",
    "tests/engine/test_engine.py",
    "tests/models/test_backends.py",
    "tests/models/test_gemma3_270m.py",
    "tests/engine/test_quality.py",
    "tests/test_notebooks.py",
    "tests/distributed/test_multiprocess.py",
    "tests/engine/test_fp8.py",
    "tests/test_cli.py",
    "tests/sharding/test_sharded_moe.py",
    "tests/engine/test_lazy.py",
    "tests/test_bench.py",
    "tests/kernels/test_attention_variants.py",
    "tests/server/test_completions.py",
    "tests/models/test_quant.py",
    "tests/kernels/test_ragged_paged_attention.py",
    "tests/models/test_gguf.py",
    "tests/sharding/test_sharded_pallas.py",
    "tests/sharding/test_sharded_forward.py",
    "tests/models/test_llama.py",
    "tests/sharding/test_expert_parallel.py",
    "tests/kernels/test_moe.py",
    "tests/models/test_llama_moe.py",
    "tests/server/test_engine_process.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: each file's tests, and the files of equal rank, keep their order


# Duration events jax records around tracing, lowering and compiling (persistent-cache hits included).
COMPILE_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
)


@contextlib.contextmanager
def _record_compiles() -> Iterator[list[str]]:
    """Collects the names of the functions jax traces or compiles inside the block."""
    compiled: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event in COMPILE_EVENTS:
            compiled.append(f"{event}: {kwargs.get('fun_name', '?')}")

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiled
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="session")
def record_compiles() -> Callable[[], contextlib.AbstractContextManager[list[str]]]:
    """`with record_compiles() as compiled:` lists what jax traced or compiled inside the block."""
    return _record_compiles

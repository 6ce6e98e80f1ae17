"""Collection order for parallel runs: the files that take a minute or more on a 2-core CPU first; the
compile recorder the engine, LoRA and tunix tests share; and unoptimised compiles for the files whose time is
XLA's compile.

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
# `--durations=0`, 2026-12-08, the files marked `unoptimized_compiles` compiled so): FP8 quality (~130-335: 335 in
# a run where it loaded steps compiled unoptimised, a store-key bug fixed since), the notebooks (~155), completions
# (~115), the two-process runs and the engine against the dense reference (~90-105), the backends, the MoE meshes,
# attention tilings, FP8 engine, kernels, server load, Gemma 3 270M, sharding and model files of 40-70 s. A file of
# ~100 s that happens to be collected last would otherwise keep one worker busy for that long after the other has
# finished.
LONGEST_FIRST = (
    # Python 3.12 with tunix only (.ci/run): the longest files of that run.
    "tests/integrations/test_tunix_gemma.py",
    "tests/integrations/test_tunix.py",
    "tests/engine/test_quality.py",
    "tests/test_notebooks.py",
    "tests/server/test_completions.py",
    "tests/distributed/test_multiprocess.py",
    "tests/engine/test_engine.py",
    "tests/models/test_backends.py",
    "tests/sharding/test_sharded_moe.py",
    "tests/kernels/test_attention_variants.py",
    "tests/engine/test_fp8.py",
    "tests/kernels/test_ragged_paged_attention.py",
    "tests/server/test_load.py",
    "tests/models/test_gemma3_270m.py",
    "tests/server/test_engine_process.py",
    "tests/kernels/test_moe.py",
    "tests/models/test_llama.py",
    "tests/sharding/test_sharded_pallas.py",
    "tests/models/test_gguf.py",
    "tests/sharding/test_sharded_forward.py",
    "tests/models/test_llama_moe.py",
    "tests/models/test_gemma.py",
    "tests/server/test_chat.py",
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


@pytest.fixture(scope="module")
def unoptimized_compiles() -> Iterator[None]:
    """A module's tests (`pytestmark = pytest.mark.usefixtures("unoptimized_compiles")`) compile with jax's
    `jax_disable_most_optimizations`, and so do the processes they start (JAX_DISABLE_MOST_OPTIMIZATIONS);
    restored after them. For the files whose time is mostly XLA's compile of small programs run a few times: the
    engine's steps of tiny models against the dense reference compiled the same way, the interpret-mode
    attention kernels (compared within a tolerance), the command-line, server, bench and tunix runs. Measured on a
    2-core CPU, two workers, cold step stores: the suite took 1,444 s optimised, 1,442 s with every file
    unoptimised (the files that run a real model over many tokens, FP8 perplexity, completions, the notebooks, got
    slower by as much as the others gained), 1,166 s with the files marked so (a clean-clone .ci/run); the Python
    3.12 run of .ci/run 221 -> 182 s. Not for bit-exact comparisons of bf16 kernels against their reference
    (test_rope_write_kv.py, test_add_rms_norm.py: unoptimised bf16 rounds differently there). The step store keys
    executables by this option too (jaxserve/executables.py), so the two kinds never mix."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
        yield
    jax.config.update("jax_disable_most_optimizations", before)

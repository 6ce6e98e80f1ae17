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

# Longest first (seconds on a 2-core CPU with two workers, slowest tests of a CI run): the notebooks
# (~230), the default model's engine and GGUF tests (~100, ~80), the CLI on the default model (~105), the lazy
# engine (~95), the recorded tokens and lm-eval's comparison with the hf model (~58 each), the 4-device
# sharding fixtures (~20-50 each), the server's load test (~40).
LONGEST_FIRST = (
    "tests/test_notebooks.py",
    "tests/engine/test_engine.py",
    "tests/test_cli.py",
    "tests/engine/test_lazy.py",
    "tests/models/test_gguf.py",
    "tests/engine/test_recorded_tokens.py",
    "tests/integrations/test_lm_eval.py",
    "tests/sharding/test_data_parallel.py",
    "tests/sharding/test_sharded_pallas.py",
    "tests/server/test_load.py",
    "tests/sharding/test_sharded_forward.py",
    "tests/kernels/test_attention_variants.py",
    "tests/sharding/test_kv_cache_sharding.py",
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

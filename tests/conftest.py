"""Collection order for parallel runs: the files that take a minute or more on a 2-core CPU first.

Under `-n auto --dist loadfile` (README.md) each file is one unit of work and the workers take units in
collection order, so a long file collected last keeps one worker busy after the others have finished. Moving
the longest files to the front lets the short ones fill in around them. The order of the tests inside a file
is kept, and a serial run runs the same tests.
"""

from __future__ import annotations

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

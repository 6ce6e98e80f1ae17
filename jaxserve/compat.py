"""The private jax names jaxserve needs where jax (0.10.2 to 0.12) has no public API, each wrapped once here
so that a jax release that moves one breaks this module's test (tests/test_compat.py, run on every
supported jax), not the engine.

- `backends_initialized`: whether a backend (client) exists; `jax.extend.backend.backends()` would create
  one, and a client reads its environment (memory fraction, allocator) when it is created.
- `distributed_client`: the coordination service's client that `jax.distributed.initialize` starts, whose
  key-value store carries the multi-process step channel (`jaxserve.distributed.StepChannel`); jax's own
  `multihost_utils` reads the same attribute.
"""

from __future__ import annotations

from typing import Any


def backends_initialized() -> bool:
    """Whether jax has created a backend in this process, without creating one."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def distributed_client() -> Any | None:
    """The coordination service client of `jax.distributed.initialize` (None before it and after shutdown):
    `key_value_set_bytes`, `blocking_key_value_get_bytes`, `key_value_delete`."""
    from jax._src import distributed

    return distributed.global_state.client

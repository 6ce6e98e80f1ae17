"""jaxserve: a JAX-native LLM inference engine.

`from jaxserve import LLM, SamplingParams` is the offline API. The names are imported on first use, so
the host-only modules (scheduler, block manager, inputs) stay importable without loading jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.sampling",
    "RequestOutput": "jaxserve.sampling",
    "CompletionOutput": "jaxserve.sampling",
    "KvCacheConfig": "jaxserve.config",
    "SchedulerConfig": "jaxserve.config",
    "CompileConfig": "jaxserve.config",
    "CapacityPolicy": "jaxserve.config",
    "Tokenizer": "jaxserve.tokenizer",
    "LoRARequest": "jaxserve.lora",
}

__all__ = [
    "LLM",
    "CapacityPolicy",
    "CompileConfig",
    "CompletionOutput",
    "KvCacheConfig",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "Tokenizer",
]

if TYPE_CHECKING:
    from jaxserve.config import CapacityPolicy, CompileConfig, KvCacheConfig, SchedulerConfig
    from jaxserve.llm import LLM
    from jaxserve.lora import LoRARequest
    from jaxserve.sampling import CompletionOutput, RequestOutput, SamplingParams
    from jaxserve.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

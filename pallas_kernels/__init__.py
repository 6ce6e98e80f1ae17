"""Pallas (Triton backend) kernels of jaxserve and their pure-jnp references.

Public entry points (DESIGN.md, Kernels): `ragged_paged_attention` and `write_kv`, each with a
`*_reference` of the same signature that serves the `attention_backend="xla"` path and the tests.
"""

from .attention import ragged_paged_attention
from .reference import ragged_paged_attention_reference, write_kv_reference
from .write_kv import write_kv

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference", "write_kv", "write_kv_reference"]

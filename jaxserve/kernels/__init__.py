"""Pallas (Triton backend) kernels of jaxserve and their pure-jnp references.

Public entry points (docs/kernels.md): `ragged_paged_attention`, `write_kv`, `rope_write_kv` (rope on
q and k and the K/V write, from a fused qkv projection), `add_rms_norm`, and the mixture-of-experts grouped
GEMMs `grouped_matmul` (`jax.lax.ragged_dot`'s semantics) and `grouped_gate_up` (silu(gate) * up in the epilogue;
both tiled by `MoeTiling`), each with a `*_reference` of the same signature that serves the
`attention_backend="xla"` path and the tests.
The paged forward on the pallas backend calls `rope_write_kv` in each layer without q/k norm, `add_rms_norm`
after each residual add (jaxserve/models/attention.py, `rope_attention` and `add_norm`), and `grouped_gate_up`
then `grouped_matmul` in each expert layer (jaxserve/models/moe.py, `experts_mlp`; the xla backend runs
`jax.lax.ragged_dot` there).
"""

from .add_rms_norm import add_rms_norm, add_rms_norm_reference
from .attention import ragged_paged_attention
from .moe import (
    MoeTiling,
    grouped_gate_up,
    grouped_gate_up_reference,
    grouped_matmul,
    grouped_matmul_reference,
)
from .reference import ragged_paged_attention_reference, rope_write_kv_reference, write_kv_reference
from .rope_write_kv import rope_write_kv
from .write_kv import write_kv

__all__ = [
    "MoeTiling",
    "add_rms_norm",
    "add_rms_norm_reference",
    "grouped_gate_up",
    "grouped_gate_up_reference",
    "grouped_matmul",
    "grouped_matmul_reference",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "rope_write_kv",
    "rope_write_kv_reference",
    "write_kv",
    "write_kv_reference",
]

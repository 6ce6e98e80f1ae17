"""`ragged_paged_attention`: the one attention entry point for prefill chunks and decode rows.

It validates the inputs at trace time, picks tile shapes from the tuning tables (`tuning.py`) and makes
two launches that write disjoint rows of one output: the mixed kernel (`ragged_attention.py`) computes
every sequence with two or more query tokens and zero-fills the padding tokens, then the split-KV decode
kernel (`decode_attention.py`) writes the rows of every one-token sequence in place. Which sequence is
which is decided on the device, so there is no host sync or data-dependent branch. A caller that knows
the batch is decode-only (`max_q_len=1`, as an engine's decode buckets do) skips the mixed launch: the
decode launch then writes every row. (One fused launch was measured slower for decode: the decode
programs then share the mixed tiles' registers and shared memory; docs/kernels.md.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .checks import AttentionShapes, check_attention_inputs, check_max_q_len, check_options
from .common import AttentionInputs, filter_triton_deprecation
from .decode_attention import DecodeParams, decode_attention
from .ragged_attention import MixedParams, mixed_attention
from .tuning import DecodeTiling, MixedTiling, check_tuning_keys, decode_tiling, mixed_tiling, next_power_of_2


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """Everything static about one call: program parameters and launch settings (a jit static arg)."""

    mixed: MixedParams | None  # None: decode-only batch, no mixed launch
    mixed_tiling: MixedTiling
    decode: DecodeParams | None
    decode_tiling: DecodeTiling | None


def make_plan(
    shapes: AttentionShapes,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    tuning: dict[str, int | bool],
    max_q_len: int | None = None,
) -> AttentionPlan:
    head_dim_padded = max(16, next_power_of_2(shapes.head_dim))
    mt = mixed_tiling(head_dim_padded, shapes.num_tokens, tuning)
    use_decode = bool(tuning.get("decode_kernel", True))
    common = dict(
        head_dim=shapes.head_dim,
        head_dim_padded=head_dim_padded,
        block_size=shapes.block_size,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
    )
    # A tile must hold at least one token of the whole group.
    block_m = max(mt.block_m, next_power_of_2(shapes.group))
    mixed = MixedParams(
        group=shapes.group,
        block_m=block_m,
        block_n=mt.block_n,
        num_tokens=shapes.num_tokens,
        max_seqs=shapes.max_seqs,
        skip_single=use_decode,
        **common,
    )
    if not use_decode:
        return AttentionPlan(mixed, mt, None, None)
    context = shapes.max_blocks * shapes.block_size
    dt = decode_tiling(head_dim_padded, shapes.max_seqs, shapes.num_kv_heads, context, tuning)
    decode_only = max_q_len == 1
    decode = DecodeParams(
        group=shapes.group,
        block_n=dt.block_n,
        num_heads=shapes.num_heads,
        num_splits=dt.num_splits,
        num_tokens=shapes.num_tokens,
        decode_only=decode_only,
        context=context,
        allow_eager_pages=bool(dt.eager_pages),
        **common,
    )
    return AttentionPlan(None if decode_only else mixed, mt, decode, dt)


@functools.partial(jax.jit, static_argnames=("plan", "interpret"))
def _attention(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs, *, plan: AttentionPlan, interpret):
    inputs = AttentionInputs(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs)
    out = None
    if plan.mixed is not None:
        out = mixed_attention(inputs, plan.mixed, plan.mixed_tiling, interpret=interpret)
    if plan.decode is None:
        return out
    return decode_attention(inputs, out, plan.decode, plan.decode_tiling, interpret=interpret)


def ragged_paged_attention(
    q: Float[Array, "T H Dh"],
    k_cache: Float[Array, "N Bs K Dh"],
    v_cache: Float[Array, "N Bs K Dh"],
    block_table: Int[Array, "B M"],
    kv_lens: Int[Array, " B"],
    cu_q_lens: Int[Array, " B+1"],
    num_seqs: Int[Array, ""] | int,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_q_len: int | None = None,
    interpret: bool = False,
    **tuning: int | bool,
) -> Float[Array, "T H Dh"]:
    """Causal attention of a flat ragged batch over a paged KV cache (docs/architecture.md, "One step").

    Query token t of sequence b sits at position kv_lens[b] - q_len[b] + (t - cu_q_lens[b]) and sees keys
    at positions <= its own (and > position - sliding_window); logits are sm_scale * q.k, soft-capped as
    soft_cap * tanh(logit / soft_cap) when soft_cap is set. Rows >= num_seqs, tokens from
    cu_q_lens[num_seqs] on and sequences with kv_lens 0 are padding: their outputs are zeros.

    max_q_len: a static bound on any live sequence's query tokens, if the caller knows one. 1 declares a
    decode-only batch (needs T <= B): one launch fewer. The bound is trusted, not checked on the device:
    the rows of a longer sequence are then left unwritten.

    tuning: block_m, block_n, num_warps, num_stages (mixed kernel); num_splits, decode_block_n,
    decode_num_warps, decode_num_stages, decode_eager_pages (decode kernel); decode_kernel=False sends
    one-token sequences through the mixed kernel too. Unset fields come from the tuning tables.
    """
    check_tuning_keys(tuning)
    check_options(sm_scale, sliding_window, soft_cap)
    shapes = check_attention_inputs(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs)
    check_max_q_len(max_q_len, shapes)
    plan = make_plan(shapes, sm_scale, sliding_window, soft_cap, tuning, max_q_len)
    filter_triton_deprecation()
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(1)
    return _attention(q, k_cache, v_cache, block_table, kv_lens, cu_q_lens, num_seqs, plan=plan, interpret=interpret)

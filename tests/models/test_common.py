"""Shared model blocks against Hugging Face transformers (float32): RMSNorm, every rope variant,
rotate-half rope, the gated MLP and dense attention over a ragged flat batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama import modeling_llama as hf_llama

from jaxserve.models.attention import DenseAttentionMetadata, attention, init_dense_cache
from jaxserve.models.common import RopeConfig, apply_rope, gated_mlp, rms_norm, rope_frequencies, rope_inv_freq

pytestmark = pytest.mark.usefixtures("single_threaded_torch")

HEAD_DIM = 32


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _assert_close(ours, ref, rel: float = 1e-5) -> None:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err <= rel * max(np.abs(ref).max(), 1e-30), f"max abs error {err} vs max |ref| {np.abs(ref).max()}"


# ---- RMSNorm and MLP ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = hf_llama.LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48))
    x = (3 * torch.randn(7, 48)).to(dtype)
    ref = norm(x).float()
    ours = rms_norm(jnp.asarray(_np(x.float())).astype(_jnp_dtype(dtype)), _jnp(norm.weight), 1e-5)
    assert ours.dtype == _jnp_dtype(dtype)
    # bfloat16: same float32 statistics, same cast, same rounding of the product: bit-exact.
    _assert_close(ours.astype(jnp.float32), _np(ref), rel=1e-6 if dtype == torch.float32 else 0.0)


def _jnp_dtype(dtype: torch.dtype) -> jnp.dtype:
    return jnp.float32 if dtype == torch.float32 else jnp.bfloat16


def _jnp(t: torch.Tensor) -> jnp.ndarray:
    return jnp.asarray(_np(t.float())).astype(_jnp_dtype(t.dtype))


def test_gated_mlp_matches_hf() -> None:
    torch.manual_seed(1)
    config = transformers.LlamaConfig(hidden_size=48, intermediate_size=80, num_attention_heads=4)
    mlp = hf_llama.LlamaMLP(config)
    x = torch.randn(5, 48)
    gate_up = np.stack([_np(mlp.gate_proj.weight).T, _np(mlp.up_proj.weight).T], axis=1)
    ours = gated_mlp(jnp.asarray(_np(x)), gate_up, _np(mlp.down_proj.weight).T)
    _assert_close(ours, _np(mlp(x)))


# ---- Rotary embeddings ---------------------------------------------------------------------------

# Each case: Hugging Face rope_parameters (transformers >= 5 layout) and max_position_embeddings.
ROPE_CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 128),
    "linear": ({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, 128),
    "llama3": (
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        512,
    ),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}, 256),
    "yarn_mscale": (
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 24.0,
            "beta_slow": 2.0,
        },
        2560,
    ),
    "yarn_untruncated_attention_factor": (
        {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "attention_factor": 1.25,
            "truncate": False,
        },
        256,
    ),
    "yarn_null_factor": (
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 64},
        512,
    ),
    "dynamic": ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, 64),
}


def _hf_rope_config(params: dict, max_positions: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_positions,
        rope_parameters=dict(params),
    )


def _rope(params: dict, max_positions: int) -> RopeConfig:
    return RopeConfig.from_hf({"rope_parameters": dict(params)}, max_position_embeddings=max_positions)


@pytest.mark.parametrize("case", [c for c in ROPE_CASES if c not in ("default", "dynamic")])
def test_rope_inv_freq_and_scaling_match_hf_init_functions(case: str) -> None:
    params, max_positions = ROPE_CASES[case]
    config = _hf_rope_config(params, max_positions)
    ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    rope = _rope(params, max_positions)
    _assert_close(rope_inv_freq(rope, HEAD_DIM), _np(ref_inv_freq), rel=1e-6)
    assert rope.attention_scaling() == pytest.approx(ref_scaling, rel=1e-12)


def test_default_rope_matches_hf_default() -> None:
    config = _hf_rope_config(*ROPE_CASES["default"])
    ref_inv_freq, ref_scaling = hf_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    rope = _rope(*ROPE_CASES["default"])
    _assert_close(rope_inv_freq(rope, HEAD_DIM), _np(ref_inv_freq), rel=1e-6)
    assert rope.attention_scaling() == ref_scaling == 1.0


@pytest.mark.parametrize("seq_len", [30, 64, 65, 200])
def test_dynamic_ntk_frequencies_match_hf_for_the_batch_length(seq_len: int) -> None:
    params, max_positions = ROPE_CASES["dynamic"]
    ref_inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_rope_config(params, max_positions), "cpu", seq_len=seq_len)
    rope = _rope(params, max_positions)
    # The longest sequence of the batch sets the scale, so position seq_len - 1 must be present.
    positions = jnp.array([0, seq_len - 1, seq_len // 2], jnp.int32)
    cos, sin = rope_frequencies(rope, HEAD_DIM, positions)
    angles = np.asarray(positions, np.float64)[:, None] * _np(ref_inv_freq)[None, :].astype(np.float64)
    _assert_rope_close(cos, np.cos(angles), angles)
    _assert_rope_close(sin, np.sin(angles), angles)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_cos_sin_match_hf_rotary_embedding(case: str) -> None:
    params, max_positions = ROPE_CASES[case]
    rotary = hf_llama.LlamaRotaryEmbedding(_hf_rope_config(params, max_positions))
    # Beyond max_position_embeddings for dynamic (scaled) and far positions for the others.
    positions = np.array([0, 1, 7, 63, 100, 2 * max_positions - 1], np.int64)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), torch.from_numpy(positions)[None])
    cos, sin = rope_frequencies(_rope(params, max_positions), HEAD_DIM, jnp.asarray(positions, jnp.int32))
    half = HEAD_DIM // 2
    # Hugging Face repeats the Dh/2 frequencies over both halves of the head.
    np.testing.assert_array_equal(_np(ref_cos[0, :, :half]), _np(ref_cos[0, :, half:]))
    angles = positions[:, None] * _np(rotary.inv_freq)[None, :].astype(np.float64)
    _assert_rope_close(cos, _np(ref_cos[0, :, :half]), angles)
    _assert_rope_close(sin, _np(ref_sin[0, :, :half]), angles)


def _assert_rope_close(ours, ref, angles: np.ndarray) -> None:
    """Within what float32 angles allow: inv_freq correct to 1 ulp each side (2**-23 relative), so
    the angle position * inv_freq to 2 * 2**-23 * |angle| plus its own rounding, and cos/sin to that."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    scaling = np.abs(ref).max()  # yarn scales cos and sin
    bound = (3 * 2.0**-23 * np.abs(angles) + 1e-6) * scaling
    assert np.all(np.abs(ours - ref) <= bound), f"max excess {np.max(np.abs(ours - ref) - bound)}"


def test_apply_rope_matches_hf_rotate_half() -> None:
    torch.manual_seed(2)
    positions = torch.tensor([0, 3, 9, 40, 41])
    rotary = hf_llama.LlamaRotaryEmbedding(_hf_rope_config(*ROPE_CASES["llama3"]))
    q, k = torch.randn(1, 4, 5, HEAD_DIM), torch.randn(1, 2, 5, HEAD_DIM)
    cos, sin = rotary(q, positions[None])
    ref_q, ref_k = hf_llama.apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = rope_frequencies(_rope(*ROPE_CASES["llama3"]), HEAD_DIM, jnp.asarray(positions.numpy()))
    # Ours is token-major [T, N, Dh]; Hugging Face's is [1, N, T, Dh].
    for x, ref in ((q, ref_q), (k, ref_k)):
        ours = apply_rope(jnp.asarray(_np(x[0].transpose(0, 1))), our_cos, our_sin)
        _assert_close(ours, _np(ref[0].transpose(0, 1)), rel=1e-5)


def test_rope_config_reads_old_and_new_hugging_face_keys_alike() -> None:
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}}
    old_rope_type = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}}
    configs = {RopeConfig.from_hf(hf, max_position_embeddings=131072) for hf in (old, old_rope_type, new)}
    assert configs == {
        RopeConfig(
            theta=500000.0,
            variant="llama3",
            factor=8.0,
            original_max_position_embeddings=8192,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
        )
    }
    assert RopeConfig.from_hf({}, max_position_embeddings=2048) == RopeConfig()
    assert RopeConfig.from_hf({"rope_theta": 1e6, "rope_scaling": None}, max_position_embeddings=8) == RopeConfig(1e6)
    dynamic = RopeConfig.from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, max_position_embeddings=4096)
    assert dynamic.original_max_position_embeddings == 4096


@pytest.mark.parametrize(
    ("hf", "message"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type must be one of"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0.0}}, r"rope_parameters\.factor must be a number > 0"),
        ({"rope_theta": -1.0}, "rope_theta must be a number > 0, got -1.0"),
        ({"rope_scaling": [("rope_type", "linear")]}, "rope_scaling must be a JSON object, got"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor must be a number > 0, got '2'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
            "high_freq_factor > low_freq_factor",
        ),
    ],
)
def test_rope_config_rejects_bad_parameters_naming_the_field(hf: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeConfig.from_hf(hf, max_position_embeddings=128)


def test_rope_config_requires_a_context_length_for_scaled_variants() -> None:
    with pytest.raises(ValueError, match="original_max_position_embeddings >= 1"):
        RopeConfig(variant="yarn", factor=4.0)
    with pytest.raises(ValueError, match="dynamic NTK rope depends on the positions"):
        rope_inv_freq(RopeConfig(variant="dynamic", factor=2.0, original_max_position_embeddings=64), HEAD_DIM)


# ---- Dense attention -----------------------------------------------------------------------------


def _hf_attention(q, k, v, window: int | None) -> np.ndarray:
    """Hugging Face's eager attention for one sequence; q [T, H, Dh], k/v [T, K, Dh]."""
    n = q.shape[0]
    module = torch.nn.Module()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    module.training = False
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]
    to_heads = lambda x: torch.from_numpy(np.asarray(x)).transpose(0, 1)[None]  # noqa: E731
    out, _ = hf_llama.eager_attention_forward(
        module, to_heads(q), to_heads(k), to_heads(v), mask, scaling=q.shape[-1] ** -0.5
    )
    return _np(out[0])


_jit_attention = jax.jit(attention, static_argnames=("sm_scale", "sliding_window"))


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    group=st.sampled_from([1, 3]),
    window=st.sampled_from([None, 1, 4]),
    seed=st.integers(0, 2**16),
)
def test_dense_attention_of_a_ragged_batch_matches_hf_per_sequence(
    lengths: list[int], group: int, window: int | None, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    num_kv_heads, head_dim = 2, 8
    total = sum(lengths)
    q = rng.standard_normal((total, num_kv_heads * group, head_dim), np.float32)
    k = rng.standard_normal((total, num_kv_heads, head_dim), np.float32)
    v = rng.standard_normal((total, num_kv_heads, head_dim), np.float32)
    seq_ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    # Shuffle the flat batch: attention depends on (sequence, position), not on token order.
    order = rng.permutation(total)

    class Shape:
        num_layers, num_kv_heads, head_dim = 1, 2, 8

    # Fixed cache shape (3 sequences of 14 slots), so examples differ in T only: fewer compiles.
    cache = init_dense_cache(Shape, 3, 14, jnp.float32)
    out, _ = _jit_attention(
        jnp.asarray(q[order]),
        jnp.asarray(k[order]),
        jnp.asarray(v[order]),
        jnp.asarray(positions[order]),
        cache,
        jnp.int32(0),
        DenseAttentionMetadata(jnp.asarray(seq_ids[order])),
        sm_scale=head_dim**-0.5,
        sliding_window=window,
    )
    out = np.asarray(out)[np.argsort(order)]
    starts = np.cumsum([0, *lengths])
    for b, n in enumerate(lengths):
        rows = slice(starts[b], starts[b] + n)
        _assert_close(out[rows], _hf_attention(q[rows], k[rows], v[rows], window), rel=1e-5)

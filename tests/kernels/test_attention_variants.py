"""ragged_paged_attention options and tilings against the numpy oracle and the reference: sliding windows,
logit soft-capping, split-KV decode (split counts, tiles, padding sequences), query/key tile shapes, the
decode kernel switched off, and calls under an outer jit (tracer inputs, no value checks).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import kernels as pk

pytestmark = pytest.mark.usefixtures("unoptimized_compiles")  # conftest.py says why

TOL = 1e-5  # float32 throughout
SCALE = 0.125


def _compare(batch, numpy_attention, rel_err, *, sliding_window=None, soft_cap=None, max_q_len=None, **tuning):
    want = numpy_attention(batch, SCALE, sliding_window, soft_cap)
    options = dict(sm_scale=SCALE, sliding_window=sliding_window, soft_cap=soft_cap, max_q_len=max_q_len)
    out = pk.ragged_paged_attention(*batch.args(), interpret=True, **options, **tuning)
    ref = pk.ragged_paged_attention_reference(*batch.args(), **options)
    assert rel_err(out, want) < TOL
    assert rel_err(ref, want) < TOL


@pytest.mark.parametrize(
    "sliding_window,soft_cap", [(1, None), (8, None), (40, 2.0), (None, 2.0), (None, 50.0), (200, None)]
)
def test_window_and_soft_cap(sliding_window, soft_cap, paged_batch, numpy_attention, rel_err):
    """Windows narrower than a tile, across tiles, and wider than the sequences; soft-caps that bite and not."""
    seqs = [(90, 60), (1, 100), (20, 0), (1, 7)]
    batch = paged_batch(np.random.default_rng(7), seqs, max_seqs=5, num_tokens=128)
    _compare(batch, numpy_attention, rel_err, sliding_window=sliding_window, soft_cap=soft_cap, block_n=32)


# (tiling, whether the window and soft-cap variants run on it too): every tiling plain, the masks on the
# tilings that reach them differently (one split; two rounds of the combine; one-tile splits through the
# loop), since each variant is one more interpret-mode compile.
DECODE_TILINGS = [
    (dict(num_splits=1, decode_block_n=16), True),
    (dict(num_splits=2, decode_block_n=64), False),
    (dict(num_splits=8, decode_block_n=32), False),
    (dict(num_splits=16, decode_block_n=16), True),  # two rounds of the combine loop
    (dict(num_splits=32, decode_block_n=16), False),  # more splits than some sequences have tiles: one-tile splits
    (dict(num_splits=32, decode_block_n=16, decode_eager_pages=False), True),  # the same through the loop
    (dict(num_splits=4, decode_block_n=128), False),  # one wide tile per split
]


# max_q_len=1 (the decode buckets' launch alone) on every tiling, with the masks where listed; max_q_len=None
# (a batch that could hold prefill rows: the mixed launch runs too) plain on the tilings listed with masks. The
# masks through the mixed launch are test_window_and_soft_cap's.
DECODE_CASES = [pytest.param(tuning, masks, 1, id=f"decode-{i}") for i, (tuning, masks) in enumerate(DECODE_TILINGS)]
DECODE_CASES += [
    pytest.param(tuning, False, None, id=f"mixed-{i}") for i, (tuning, masks) in enumerate(DECODE_TILINGS) if masks
]


@pytest.mark.parametrize(("tuning", "masks", "max_q_len"), DECODE_CASES)
def test_decode_splits(tuning, masks, max_q_len, paged_batch, numpy_attention, rel_err):
    """Decode-only batch with padding sequences inside num_seqs (kv_len 0) and padding rows and tokens after
    it; with max_q_len=1 the decode launch alone writes every row (interpret mode NaN-fills outputs, so an
    unwritten padding row fails the comparison)."""
    seqs = [(1, 300), (1, 0), (1, -1), (1, 47), (1, 16), (1, 128)]
    batch = paged_batch(np.random.default_rng(11), seqs, num_heads=8, num_kv_heads=2, max_seqs=8, num_tokens=8)
    _compare(batch, numpy_attention, rel_err, max_q_len=max_q_len, **tuning)
    if masks:
        _compare(batch, numpy_attention, rel_err, sliding_window=20, max_q_len=max_q_len, **tuning)
        _compare(batch, numpy_attention, rel_err, soft_cap=5.0, max_q_len=max_q_len, **tuning)


@pytest.mark.parametrize("max_q_len", [None, 1])
@pytest.mark.parametrize(("num_splits", "block_n"), [(1, 16), (8, 16), (1, 128)])
def test_decode_padded_head_dim(num_splits, block_n, max_q_len, paged_batch, numpy_attention, rel_err):
    """head_dim 80 (padded to 128 inside the kernels): masked loads, the combine's masked stores, zero rows.
    (1, 128): one split holding the whole 80-token table, so the eager-page path writes the rows itself."""
    seqs = [(1, 70), (1, 5), (1, 33)]
    batch = paged_batch(np.random.default_rng(3), seqs, num_heads=6, num_kv_heads=2, head_dim=80, max_seqs=5)
    _compare(batch, numpy_attention, rel_err, num_splits=num_splits, decode_block_n=block_n, max_q_len=max_q_len)


@pytest.mark.parametrize(
    "tuning",
    [
        dict(block_m=16, block_n=16),
        dict(block_m=32, block_n=128),
        dict(block_m=64, block_n=32, decode_kernel=False),
        dict(block_m=16, block_n=64, decode_kernel=False),
    ],
)
def test_query_and_key_tiles(tuning, paged_batch, numpy_attention, rel_err):
    """Tiles of one token of the group (block_m 16 with 9 heads / 3 kv heads: 5 tokens), big key tiles,
    and one-token sequences served by the query tiles instead of the decode programs."""
    seqs = [(45, 33), (1, 60), (2, 0), (1, 0), (17, 100)]
    batch = paged_batch(np.random.default_rng(5), seqs, num_heads=9, num_kv_heads=3, max_seqs=6, num_tokens=72)
    _compare(batch, numpy_attention, rel_err, **tuning)
    _compare(batch, numpy_attention, rel_err, sliding_window=9, soft_cap=3.0, **tuning)


def test_under_jit_matches_eager(paged_batch, rel_err):
    """Inside a caller's jit the inputs are tracers: no value checks, same result."""
    batch = paged_batch(np.random.default_rng(2), [(30, 10), (1, 40)], max_seqs=3, num_tokens=40)
    eager = pk.ragged_paged_attention(*batch.args(), sm_scale=SCALE, interpret=True)
    jitted = jax.jit(lambda *a: pk.ragged_paged_attention(*a, sm_scale=SCALE, interpret=True))(*batch.args())
    assert rel_err(jitted, eager) == 0.0


def test_no_sequences_gives_zeros(paged_batch):
    batch = paged_batch(np.random.default_rng(4), [(5, 5)], max_seqs=3, num_tokens=16)
    batch.num_seqs = 0
    out = np.asarray(pk.ragged_paged_attention(*batch.args(), sm_scale=SCALE, interpret=True))
    assert (out == 0).all()


def test_eager_pages_needs_one_tile_per_split_and_no_window():
    """Splits read their page ids before kv_len only where the tile of split s cannot depend on kv_len."""
    from jaxserve.kernels.decode_attention import DecodeParams

    base = dict(group=4, head_dim=64, head_dim_padded=64, block_size=16, num_heads=8, sm_scale=0.1)
    base |= dict(soft_cap=None, num_tokens=4, decode_only=True, context=1024)

    def eager(num_splits, block_n, window=None, switch=True):
        splits = dict(num_splits=num_splits, block_n=block_n)
        return DecodeParams(**splits, sliding_window=window, allow_eager_pages=switch, **base).eager_pages

    assert eager(16, 64) and eager(8, 128) and eager(64, 64) and eager(1, 1024)
    assert not eager(8, 64)  # two tiles per split: where they start depends on kv_len
    assert not eager(16, 64, window=100)  # the first visible tile depends on kv_len
    assert not eager(16, 64, switch=False)

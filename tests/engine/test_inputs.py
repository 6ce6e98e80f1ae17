"""Bucket tables (the seed's batch size rules) and StepInputs / SamplingInputs against hand-built expectations."""

import numpy as np
import pytest

from jaxserve.config import CompileConfig, EngineConfig, KvCacheConfig
from jaxserve.inputs import (
    NO_TARGET,
    Bucket,
    BucketTable,
    carried_tokens,
    default_token_buckets,
    filter_decode_batch_sizes,
    generate_decode_batch_sizes,
    make_prompt_targets,
    make_sampling_inputs,
    make_step_inputs,
    make_token_history,
)
from jaxserve.request import Request, make_requests
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow


def table(max_batch_size=4, max_num_tokens=16, max_seq_len=32, block_size=4, **compile_kwargs):
    config = EngineConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        kv_cache=KvCacheConfig(block_size=block_size),
        compile=CompileConfig(**compile_kwargs),
    )
    return BucketTable.from_config(config)


# ---- bucket rules -------------------------------------------------------------------------------


def test_generate_decode_batch_sizes_follows_the_seed():
    multiples_of_8 = [8 * i for i in range(1, 17)]
    assert generate_decode_batch_sizes(128, True) == [1, 2, 4, *multiples_of_8]
    assert generate_decode_batch_sizes(256, True) == [1, 2, 4, *multiples_of_8, 192, 256]
    assert generate_decode_batch_sizes(300, True) == [1, 2, 4, *multiples_of_8, 192, 256, 300]
    assert generate_decode_batch_sizes(20, True) == [1, 2, 4, 8, 16, 20]
    assert generate_decode_batch_sizes(1, True) == [1]
    assert generate_decode_batch_sizes(5, False) == [1, 2, 3, 4, 5]
    assert generate_decode_batch_sizes(300, False) == [*range(1, 33), 64, 128, 256, 300]


def test_filter_caps_at_batch_and_token_limits_and_pads_the_first_size_above():
    assert filter_decode_batch_sizes([1, 2, 4, 8, 16], 6, 100, True) == [1, 2, 4, 6]
    assert filter_decode_batch_sizes([1, 2, 4, 8, 16], 6, 100, False) == [1, 2, 4]
    assert filter_decode_batch_sizes([1, 2, 4, 8], 64, 3, True) == [1, 2, 3]  # max_num_tokens caps too
    assert filter_decode_batch_sizes([1, 2, 4, 8], 4, 100, True) == [1, 2, 4]  # the cap is there already
    assert filter_decode_batch_sizes([8, 16], 4, 100, True) == [4]


def test_token_buckets():
    assert default_token_buckets(100) == [16, 32, 64, 100]
    assert default_token_buckets(64) == [16, 32, 64]
    assert default_token_buckets(8) == [8]
    assert table(max_num_tokens=64, token_buckets=[8, 50, 1000]).token_buckets == (8, 50, 64)


def test_table_from_config_and_its_bucket_list():
    buckets = table(max_batch_size=16, max_num_tokens=16)
    assert buckets.decode_batch_sizes == (1, 2, 4, 8, 16)
    assert buckets.token_buckets == (16,)
    assert (buckets.block_size, buckets.max_blocks_per_seq) == (4, 8)
    # (16, 16) is both the largest decode bucket and the only token bucket: compiled as both, since the
    # decode variant skips the attention's mixed launch and cannot serve a prefill.
    decode = tuple(Bucket(s, s, decode_only=True) for s in (1, 2, 4, 8, 16))
    assert buckets.buckets == (*decode, Bucket(16, 16))
    assert table(decode_batch_sizes=[2, 64]).decode_batch_sizes == (2, 4)


def test_lookup_pads_to_the_smallest_bucket():
    buckets = table()  # decode (1, 2, 4), tokens (16,), B = 4
    assert buckets.lookup(3, 3, decode_only=True) == Bucket(4, 4, decode_only=True)
    assert buckets.lookup(1, 1, decode_only=True) == Bucket(1, 1, decode_only=True)
    assert buckets.lookup(3, 3, decode_only=False) == Bucket(16, 4)
    assert buckets.lookup(10, 3, decode_only=False) == Bucket(16, 4)
    assert buckets.lookup(16, 4, decode_only=False) == Bucket(16, 4)
    without_padding = table(enable_padding=False, decode_batch_sizes=[1, 2, 4])
    assert without_padding.lookup(3, 3, decode_only=True) == Bucket(16, 4)  # no exact decode bucket
    assert without_padding.lookup(2, 2, decode_only=True) == Bucket(2, 2, decode_only=True)


@pytest.mark.parametrize(("num_tokens", "num_seqs"), [(17, 2), (5, 5), (0, 0)])
def test_a_step_outside_the_table_is_an_error_naming_its_shape(num_tokens, num_seqs):
    with pytest.raises(ValueError, match=f"{num_tokens} tokens over {num_seqs} sequences"):
        table().lookup(num_tokens, num_seqs, decode_only=False)


# ---- step inputs --------------------------------------------------------------------------------


def request_with(prompt, request_id="r", **params):
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(**params))


def row(request, start, num_tokens, block_ids, *, pending=False, prefill=True, samples=True, generation_index=0):
    known_end = start + num_tokens - (1 if pending else 0)
    return ScheduledRow(
        request=request,
        start=start,
        num_tokens=num_tokens,
        token_ids=request.token_ids[start:known_end],
        block_ids=block_ids,
        samples=samples,
        input_pending=pending,
        generation_index=generation_index,
        epoch=0,
        is_prefill=prefill,
    )


def mixed_batch():
    a = request_with(list(range(100, 109)), "a")  # 9-token prompt, first block from the prefix cache
    b = request_with(list(range(200, 220)), "b")  # a chunk of a 20-token prompt
    c = request_with(list(range(300, 307)), "c")  # decoding; its last token is known
    d = request_with([400, 401, 402], "d")  # decoding; its last token is still on the device
    rows = [
        row(a, 4, 5, [7, 3, 9]),
        row(b, 0, 3, [5], samples=False),
        row(c, 6, 1, [2, 8], prefill=False, generation_index=4),
        row(d, 2, 1, [6], pending=True, prefill=False, generation_index=1),
    ]
    return ScheduledBatch(rows=rows, num_prefill_rows=2)


def test_step_inputs_of_a_mixed_batch():
    inputs = make_step_inputs(mixed_batch(), table())
    assert inputs.bucket == Bucket(16, 4)
    pad6 = [0] * 6
    expected = {
        "token_ids": [100 + p for p in range(4, 9)] + [200, 201, 202] + [306] + [0] + pad6,
        "positions": [4, 5, 6, 7, 8, 0, 1, 2, 6, 2] + pad6,
        # block_id * 4 + offset: a's positions 4..7 in block 3, 8 in block 9; b in block 5; c's 6 in
        # block 8; d's 2 in block 6; padding tokens in block 0.
        "slot_mapping": [12, 13, 14, 15, 36, 20, 21, 22, 34, 26] + pad6,
        "cu_q_lens": [0, 5, 8, 9, 10],
        "kv_lens": [9, 3, 7, 3],
        "block_table": [[7, 3, 9, 0, 0, 0, 0, 0], [5] + [0] * 7, [2, 8] + [0] * 6, [6] + [0] * 7],
        "logits_indices": [4, 7, 8, 9],
        "num_seqs": 4,
    }
    for name, value in expected.items():
        array = getattr(inputs, name)
        assert array.dtype == np.int32, name
        np.testing.assert_array_equal(array, np.array(value, dtype=np.int32), err_msg=name)


def test_prompt_targets_are_the_next_prompt_token_of_scoring_rows_only():
    a = request_with(list(range(100, 109)), "a", prompt_logprobs=2)  # last chunk: positions 4..8 of 9
    b = request_with(list(range(200, 220)), "b", prompt_logprobs=0)  # first chunk: positions 0..2 of 20
    c = request_with(list(range(300, 307)), "c")  # no prompt logprobs
    rows = [row(a, 4, 5, [7, 3, 9]), row(b, 0, 3, [5], samples=False), row(c, 0, 2, [2], samples=False)]
    targets = make_prompt_targets(ScheduledBatch(rows=rows, num_prefill_rows=3), 16)
    none = NO_TARGET
    # a: positions 4..7 score prompt tokens 5..8; position 8 is the last prompt token (it samples).
    expected = [105, 106, 107, 108, none] + [201, 202, 203] + [none, none] + [none] * 6
    np.testing.assert_array_equal(targets, np.array(expected, dtype=np.int32))


def test_padding_rows_of_a_decode_step_own_no_tokens_and_point_at_block_0():
    requests = [request_with([1, 2, 3, 4, 5], f"r{i}") for i in range(3)]
    rows = [row(r, 4, 1, [i + 1, i + 4], prefill=False) for i, r in enumerate(requests)]
    inputs = make_step_inputs(ScheduledBatch(rows=rows), table())
    assert inputs.bucket == Bucket(4, 4, decode_only=True)
    np.testing.assert_array_equal(inputs.token_ids, [5, 5, 5, 0])
    np.testing.assert_array_equal(inputs.positions, [4, 4, 4, 0])
    np.testing.assert_array_equal(inputs.slot_mapping, [16, 20, 24, 0])
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(inputs.kv_lens, [5, 5, 5, 0])
    np.testing.assert_array_equal(inputs.logits_indices, [0, 1, 2, 0])
    np.testing.assert_array_equal(inputs.block_table[3], np.zeros(8))
    assert int(inputs.num_seqs) == 3 and inputs.num_seqs.shape == ()


def test_step_inputs_errors():
    with pytest.raises(ValueError, match="empty batch"):
        make_step_inputs(ScheduledBatch(rows=[]), table())
    short = row(request_with(list(range(9))), 0, 9, [1, 2])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        make_step_inputs(ScheduledBatch(rows=[short], num_prefill_rows=1), table())


def test_sampling_inputs_pad_with_neutral_rows():
    seeded = make_requests("s", [1, 2], SamplingParams(seed=5, n=2, temperature=0.8, top_k=3))
    plain = request_with([1], "p", temperature=0.0, top_p=0.5, min_p=0.1, repetition_penalty=1.2)
    penalised = request_with([1], "q", presence_penalty=0.5, frequency_penalty=-1.0)
    rows = [row(r, 0, 1, [1], generation_index=i) for i, r in enumerate([*seeded, plain, penalised])]
    inputs = make_sampling_inputs(ScheduledBatch(rows=rows, num_prefill_rows=4), num_rows=6)
    arrays = inputs.arrays()
    assert list(arrays) == [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "has_seed",
        "generation_index",
    ]
    np.testing.assert_allclose(inputs.temperature, [0.8, 0.8, 0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(inputs.top_k, [3, 3, 0, 0, 0, 0])
    np.testing.assert_allclose(inputs.top_p, [1, 1, 0.5, 1, 1, 1])
    np.testing.assert_allclose(inputs.min_p, [0, 0, 0.1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(inputs.repetition_penalty, [1, 1, 1.2, 1, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(inputs.presence_penalty, [0, 0, 0, 0.5, 0, 0])
    np.testing.assert_allclose(inputs.frequency_penalty, [0, 0, 0, -1.0, 0, 0])
    assert inputs.seed[0] == 5 and inputs.seed[1] != 5 and inputs.seed.dtype == np.uint32
    np.testing.assert_array_equal(inputs.has_seed, [True, True, False, False, False, False])
    np.testing.assert_array_equal(inputs.generation_index, [0, 1, 2, 3, 0, 0])
    assert inputs.temperature.dtype == np.float32 and inputs.top_k.dtype == np.int32


def test_carried_tokens_point_at_the_previous_sampling_row():
    batch = mixed_batch()
    d = batch.rows[3].request
    previous = ScheduledBatch(rows=[row(request_with([9], "x"), 0, 1, [1]), row(d, 1, 1, [6], prefill=False)])
    carried = carried_tokens(batch, previous, num_rows=4)
    np.testing.assert_array_equal(carried.mask, [False, False, False, True])
    np.testing.assert_array_equal(carried.source_row, [0, 0, 0, 1])
    with pytest.raises(ValueError, match="did not sample"):
        carried_tokens(batch, None, num_rows=4)


def test_token_history_holds_prompt_and_known_outputs():
    a = request_with([5, 6, 7], "a")
    a.token_ids += [8, 9]  # two outputs known on the host
    b = request_with([1, 2], "b")
    rows = [row(b, 0, 2, [1]), row(a, 4, 1, [2, 3], prefill=False), row(a, 5, 1, [2, 3], pending=True)]
    history = make_token_history(ScheduledBatch(rows=rows, num_prefill_rows=1), num_rows=4, history_len=8, pad_id=99)
    pad = 99
    np.testing.assert_array_equal(
        history.token_ids,
        [[1, 2] + [pad] * 6, [5, 6, 7, 8, 9] + [pad] * 3, [5, 6, 7, 8, 9] + [pad] * 3, [pad] * 8],
    )
    np.testing.assert_array_equal(history.num_prompt_tokens, [2, 3, 3, 0])
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        make_token_history(ScheduledBatch(rows=rows[1:2]), num_rows=1, history_len=4, pad_id=pad)

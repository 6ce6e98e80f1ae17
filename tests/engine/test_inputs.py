"""Bucket tables (TensorRT-LLM's batch size rules), step variants and their one enumeration, and StepInputs
against hand-built expectations."""

import dataclasses
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.buckets import (
    Bucket,
    BucketTable,
    default_token_buckets,
    filter_decode_batch_sizes,
    generate_decode_batch_sizes,
    kv_block_buckets,
)
from jaxserve.config import CompileConfig, EngineConfig, KvCacheConfig
from jaxserve.request import Request, make_requests
from jaxserve.sampling import SamplingParams
from jaxserve.scheduler import ScheduledBatch, ScheduledRow
from jaxserve.step_inputs import NO_TARGET, SamplingInputs, make_step_inputs, padding_inputs
from jaxserve.variants import MAX_BANNED_TOKENS, SamplerMode, StepConfig, StepVariant

VOCAB = 1000


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


def test_generate_decode_batch_sizes_is_coarse_with_padding_and_exact_without():
    powers = [1, 2, 4, 8, 16, 32, 64, 128]
    assert generate_decode_batch_sizes(128, True) == powers
    assert generate_decode_batch_sizes(256, True) == [*powers, 192, 256]
    assert generate_decode_batch_sizes(300, True) == [*powers, 192, 256, 300]
    assert generate_decode_batch_sizes(1024, True) == [*powers, 192, 256, 384, 512, 640, 768, 896, 1024]
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


def test_attention_widths_default_to_powers_of_two_on_the_xla_backend_only():
    assert kv_block_buckets(None, "xla", 8192, 16) == (16, 32, 64, 128, 256)  # 256 .. 4096 tokens
    assert kv_block_buckets(None, "xla", 512, 16) == (16,)
    assert kv_block_buckets(None, "xla", 256, 16) == ()  # max_seq_len is always the last width
    assert kv_block_buckets(None, "pallas", 8192, 16) == ()  # the kernels stop at each kv_len already
    # Given widths are rounded up to whole blocks; those that reach max_seq_len are the full width.
    assert kv_block_buckets((5, 8, 9, 32, 40), "pallas", 32, 4) == (2, 3)


def test_every_shape_is_compiled_at_every_width_and_a_step_takes_the_narrowest_that_holds_it():
    buckets = table(max_batch_size=2, max_num_tokens=8, max_seq_len=32, kv_len_buckets=(8, 12))
    assert (buckets.max_blocks_per_seq, buckets.kv_block_buckets) == (8, (2, 3))
    shapes = [Bucket(1, 1, True), Bucket(2, 2, True), Bucket(8, 2)]
    assert buckets.buckets == tuple(dataclasses.replace(b, kv_blocks=w) for b in shapes for w in (2, 3, None))
    assert buckets.lookup(2, 2, decode_only=True, max_kv_len=8) == Bucket(2, 2, True, kv_blocks=2)
    assert buckets.lookup(2, 2, decode_only=True, max_kv_len=9) == Bucket(2, 2, True, kv_blocks=3)
    assert buckets.lookup(5, 2, decode_only=False, max_kv_len=13) == Bucket(8, 2)  # the full width
    assert buckets.lookup(5, 2, decode_only=False) == Bucket(8, 2)
    assert buckets.table_width(Bucket(8, 2)) == 8 and buckets.table_width(Bucket(8, 2, kv_blocks=3)) == 3
    config = StepConfig(buckets, vocab_size=VOCAB, max_seq_len=32)
    assert config.largest_step()[0] == Bucket(8, 2)  # the widest table of the largest shape
    with pytest.raises(ValueError, match="kv_block_buckets must be sorted"):
        dataclasses.replace(buckets, kv_block_buckets=(3, 8))


def test_a_narrow_step_holds_the_same_block_table_columns_as_a_full_one():
    batch, previous = mixed_batch()  # kv_lens 9, 3, 7, 3: 3 blocks of 4 at most
    narrow = StepConfig(table(kv_len_buckets=(8, 12, 16)), vocab_size=VOCAB, max_seq_len=32)
    inputs, bucket, _ = make_step_inputs(batch, previous, narrow)
    full, full_bucket, _ = make_step_inputs(batch, previous, steps())
    assert bucket == dataclasses.replace(full_bucket, kv_blocks=3) and inputs.block_table.shape == (4, 3)
    np.testing.assert_array_equal(inputs.block_table, full.block_table[:, :3])
    assert not full.block_table[:, 3:].any()  # nothing is lost: the columns past the width are block 0
    for name in ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "logits_indices"):
        np.testing.assert_array_equal(getattr(inputs, name), getattr(full, name), err_msg=name)


# ---- step inputs --------------------------------------------------------------------------------


def steps(max_batch_size=4, max_seq_len=32, history_len=None, max_num_tokens=16, **variants) -> StepConfig:
    """A StepConfig over `table`; history_len: a token-history width other than max_seq_len."""
    buckets = table(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len)
    return StepConfig(buckets, vocab_size=VOCAB, max_seq_len=history_len or max_seq_len, **variants)


def request_with(prompt, request_id="r", **params):
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(**params))


def row(request, start, num_tokens, block_ids, *, pending=False, prefill=True, samples=True, generation_index=0):
    known_end = start + num_tokens - (1 if pending else 0)
    return ScheduledRow(
        request=request,
        start=start,
        num_tokens=num_tokens,
        token_ids=request.token_ids[start:known_end],
        block_ids=array("i", block_ids),
        samples=samples,
        input_pending=pending,
        generation_index=generation_index,
        epoch=0,
        is_prefill=prefill,
    )


def mixed_batch():
    """Four rows and the previous step that sampled the pending input of the last one."""
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
    previous = ScheduledBatch(rows=[row(request_with([9], "x"), 0, 1, [1]), row(d, 1, 1, [6], prefill=False)])
    return ScheduledBatch(rows=rows, num_prefill_rows=2), previous


def test_step_inputs_of_a_mixed_batch():
    batch, previous = mixed_batch()
    inputs, bucket, variant = make_step_inputs(batch, previous, steps())
    assert bucket == Bucket(16, 4) and variant == StepVariant()
    pad6 = [0] * 6
    expected = {
        "token_ids": [100 + p for p in range(4, 9)] + [200, 201, 202] + [306] + [0] + pad6,
        "positions": [4, 5, 6, 7, 8, 0, 1, 2, 6, 2] + pad6,
        # block_id * 4 + offset: a's positions 4..7 in block 3, 8 in block 9; b in block 5; c's 6 in
        # block 8; d's 2 in block 6; padding tokens in block 0.
        "slot_mapping": [[12, 13, 14, 15, 36, 20, 21, 22, 34, 26] + pad6],  # one row: one KV group
        "cu_q_lens": [0, 5, 8, 9, 10],
        "kv_lens": [9, 3, 7, 3],
        "block_table": [[7, 3, 9, 0, 0, 0, 0, 0], [5] + [0] * 7, [2, 8] + [0] * 6, [6] + [0] * 7],
        "logits_indices": [4, 7, 8, 9],
        "num_seqs": 4,
        # d's last input is what row 1 of the previous step samples.
        "carried_source": [0, 0, 0, 1],
        "banned_tokens": [[VOCAB] * MAX_BANNED_TOKENS] * 4,
    }
    for name, value in expected.items():
        array = getattr(inputs, name)
        assert array.dtype == np.int32, name
        np.testing.assert_array_equal(array, np.array(value, dtype=np.int32), err_msg=name)
    np.testing.assert_array_equal(inputs.carried_mask, [False, False, False, True])
    assert inputs.history is None and inputs.prompt_targets is None


def test_a_pending_input_the_previous_step_did_not_sample_is_an_error():
    batch, _ = mixed_batch()
    with pytest.raises(ValueError, match="did not sample"):
        make_step_inputs(batch, None, steps())


def test_prompt_targets_are_the_next_prompt_token_of_scoring_rows_only():
    a = request_with(list(range(100, 109)), "a", prompt_logprobs=2)  # last chunk: positions 4..8 of 9
    b = request_with(list(range(200, 220)), "b", prompt_logprobs=0)  # first chunk: positions 0..2 of 20
    c = request_with(list(range(300, 307)), "c")  # no prompt logprobs
    rows = [row(a, 4, 5, [7, 3, 9]), row(b, 0, 3, [5], samples=False), row(c, 0, 2, [2], samples=False)]
    batch = ScheduledBatch(rows=rows, num_prefill_rows=3)
    inputs, _, variant = make_step_inputs(batch, None, steps(prompt_logprob_variants=True))
    assert variant == StepVariant(SamplerMode.CANDIDATES, prompt_logprobs=True)  # a samples at temperature 1
    greedy_a = request_with(list(range(100, 109)), "a", prompt_logprobs=2, temperature=0.0)
    rows[0] = row(greedy_a, 4, 5, [7, 3, 9])  # b and c sample nothing this step: their temperature is moot
    _, _, variant = make_step_inputs(
        ScheduledBatch(rows=rows, num_prefill_rows=3), None, steps(prompt_logprob_variants=True)
    )
    assert variant == StepVariant(SamplerMode.GREEDY, prompt_logprobs=True)
    none = NO_TARGET
    # a: positions 4..7 score prompt tokens 5..8; position 8 is the last prompt token (it samples).
    expected = [105, 106, 107, 108, none] + [201, 202, 203] + [none, none] + [none] * 6
    np.testing.assert_array_equal(inputs.prompt_targets, np.array(expected, dtype=np.int32))


def test_padding_rows_of_a_decode_step_own_no_tokens_and_point_at_block_0():
    requests = [request_with([1, 2, 3, 4, 5], f"r{i}") for i in range(3)]
    rows = [row(r, 4, 1, [i + 1, i + 4], prefill=False) for i, r in enumerate(requests)]
    inputs, bucket, _ = make_step_inputs(ScheduledBatch(rows=rows), None, steps())
    assert bucket == Bucket(4, 4, decode_only=True)
    np.testing.assert_array_equal(inputs.token_ids, [5, 5, 5, 0])
    np.testing.assert_array_equal(inputs.positions, [4, 4, 4, 0])
    np.testing.assert_array_equal(inputs.slot_mapping, [[16, 20, 24, 0]])
    np.testing.assert_array_equal(inputs.cu_q_lens, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(inputs.kv_lens, [5, 5, 5, 0])
    np.testing.assert_array_equal(inputs.logits_indices, [0, 1, 2, 0])
    np.testing.assert_array_equal(inputs.block_table[3], np.zeros(8))
    assert int(inputs.num_seqs) == 3 and inputs.num_seqs.shape == ()


def test_step_inputs_errors():
    with pytest.raises(ValueError, match="empty batch"):
        make_step_inputs(ScheduledBatch(rows=[]), None, steps())
    short = row(request_with(list(range(9))), 0, 9, [1, 2])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        make_step_inputs(ScheduledBatch(rows=[short], num_prefill_rows=1), None, steps())


def test_sampling_inputs_pad_with_neutral_rows():
    seeded = make_requests("s", [1, 2], SamplingParams(seed=5, n=2, temperature=0.8, top_k=3, logprobs=1))
    plain = request_with([1], "p", temperature=0.0, top_p=0.5, min_p=0.1, repetition_penalty=1.2)
    penalised = request_with([1], "q", presence_penalty=0.5, frequency_penalty=-1.0)
    rows = [row(r, 0, 1, [1], generation_index=i) for i, r in enumerate([*seeded, plain, penalised])]
    batch = ScheduledBatch(rows=rows, num_prefill_rows=4)
    inputs, bucket, variant = make_step_inputs(batch, None, steps(max_batch_size=6, penalty_variants=True))
    # Sampling rows with a top-k of 3, a greedy one with logprobs: the CANDIDATES sampler, with penalties.
    assert bucket == Bucket(16, 6) and variant == StepVariant(SamplerMode.CANDIDATES, penalties=True)
    sampling = inputs.sampling
    assert [f.name for f in dataclasses.fields(sampling)] == [
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
    np.testing.assert_allclose(sampling.temperature, [0.8, 0.8, 0.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(sampling.top_k, [3, 3, 0, 0, 0, 0])
    np.testing.assert_allclose(sampling.top_p, [1, 1, 0.5, 1, 1, 1])
    np.testing.assert_allclose(sampling.min_p, [0, 0, 0.1, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(sampling.repetition_penalty, [1, 1, 1.2, 1, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(sampling.presence_penalty, [0, 0, 0, 0.5, 0, 0])
    np.testing.assert_allclose(sampling.frequency_penalty, [0, 0, 0, -1.0, 0, 0])
    assert sampling.seed[0] == 5 and sampling.seed[1] != 5 and sampling.seed.dtype == np.uint32
    np.testing.assert_array_equal(sampling.has_seed, [True, True, False, False, False, False])
    np.testing.assert_array_equal(sampling.generation_index, [0, 1, 2, 3, 0, 0])
    assert sampling.temperature.dtype == np.float32 and sampling.top_k.dtype == np.int32


def test_sampling_inputs_from_columns_cast_and_check():
    columns = {f.name: np.zeros(3) for f in dataclasses.fields(SamplingInputs)}
    inputs = SamplingInputs.from_columns(**{**columns, "top_k": [1, 2, 3], "seed": [0, 1, 2**32 - 1]})
    assert inputs.top_k.dtype == np.int32 and inputs.seed.dtype == np.uint32 and inputs.has_seed.dtype == np.bool_
    with pytest.raises(ValueError, match="column top_p has shape"):
        SamplingInputs.from_columns(**{**columns, "top_p": np.ones(2)})
    with pytest.raises(ValueError, match=r"missing columns \['min_p'\]"):
        SamplingInputs.from_columns(**{k: v for k, v in columns.items() if k != "min_p"})
    assert SamplingInputs.neutral(5).top_p.tolist() == [1.0] * 5


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    eos = frozenset({7})
    early = Request("e", [1, 2], SamplingParams(min_tokens=3, stop_token_ids=[9, 11]), eos_token_ids=eos)
    late = Request("l", [1, 2], SamplingParams(min_tokens=1), eos_token_ids=eos)
    rows = [row(early, 0, 2, [1], generation_index=2), row(late, 0, 2, [2], generation_index=1)]
    inputs, _, _ = make_step_inputs(ScheduledBatch(rows=rows, num_prefill_rows=2), None, steps())
    pad = [VOCAB] * (MAX_BANNED_TOKENS - 3)
    np.testing.assert_array_equal(inputs.banned_tokens[0], [7, 9, 11, *pad])
    np.testing.assert_array_equal(inputs.banned_tokens[1], [VOCAB] * MAX_BANNED_TOKENS)


def test_token_history_holds_prompt_and_known_outputs():
    a = request_with([5, 6, 7], "a", repetition_penalty=1.1)
    a.token_ids += [8, 9]  # two outputs known on the host
    b = request_with([1, 2], "b")
    c = request_with([3, 4], "c")
    c.token_ids += [5]  # one output known, the next one still on the device
    rows = [row(b, 0, 2, [1]), row(a, 4, 1, [2, 3], prefill=False), row(c, 3, 1, [4], pending=True, prefill=False)]
    previous = ScheduledBatch(rows=[row(c, 2, 1, [4], prefill=False)])
    batch = ScheduledBatch(rows=rows, num_prefill_rows=1)
    inputs, _, variant = make_step_inputs(batch, previous, steps(history_len=8, penalty_variants=True))
    assert variant == StepVariant(penalties=True)
    pad = VOCAB
    np.testing.assert_array_equal(
        inputs.history.token_ids,
        [[1, 2] + [pad] * 6, [5, 6, 7, 8, 9] + [pad] * 3, [3, 4, 5] + [pad] * 5, [pad] * 8],
    )
    np.testing.assert_array_equal(inputs.history.num_prompt_tokens, [2, 3, 2, 0])
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        make_step_inputs(ScheduledBatch(rows=rows[1:2]), None, steps(history_len=4, penalty_variants=True))


# ---- variants -----------------------------------------------------------------------------------


def test_forwards_samplers_and_the_steps_they_serve():
    config = steps(penalty_variants=True, prompt_logprob_variants=True)
    decode, token = Bucket(2, 2, decode_only=True), Bucket(16, 4)
    assert (decode, False) in config.forwards() and (decode, True) not in config.forwards()
    assert {(token, False), (token, True)} <= set(config.forwards())
    rows = sorted({b.num_seqs for b in config.buckets.buckets})
    # GREEDY without penalties is the forward's own sample: no sampler for it.
    expected = tuple((r, m, p) for r in rows for m in SamplerMode for p in (False, True))
    assert config.samplers() == tuple(s for s in expected if s[1:] != (SamplerMode.GREEDY, False))
    assert StepVariant(SamplerMode.GREEDY).greedy_in_forward
    assert not StepVariant(SamplerMode.GREEDY, penalties=True).greedy_in_forward
    assert not StepVariant(SamplerMode.CANDIDATES).greedy_in_forward
    assert len(config.variants(decode)) == 3 * 2 and len(config.variants(token)) == 3 * 2 * 2
    assert StepVariant(SamplerMode.SORTED, True, True) in config.variants(token)
    assert config.compiled_steps() == tuple((b, v) for b in config.buckets.buckets for v in config.variants(b))
    plain = steps()
    assert plain.forwards() == tuple((b, False) for b in plain.buckets.buckets)
    assert plain.variants(token) == tuple(StepVariant(mode) for mode in SamplerMode)
    # The probe runs the step with the largest activations: the largest token bucket, scoring, penalties,
    # the sorting sampler.
    assert config.largest_step() == (token, StepVariant(SamplerMode.SORTED, True, True))
    assert plain.largest_step() == (token, StepVariant(SamplerMode.SORTED))
    assert str(StepVariant(SamplerMode.SORTED, True, True)) == "sorted+penalties+prompt_logprobs"
    assert str(StepVariant(SamplerMode.GREEDY)) == "greedy"


def test_requests_that_need_an_uncompiled_variant_are_refused_by_name():
    config = steps()
    with pytest.raises(ValueError, match=r"CompileConfig\(prompt_logprobs=True\)"):
        config.check_supported(SamplingParams(prompt_logprobs=1), num_eos_tokens=1)
    with pytest.raises(ValueError, match=r"CompileConfig\(penalty_variants=True\)"):
        config.check_supported(SamplingParams(frequency_penalty=0.5), num_eos_tokens=1)
    with pytest.raises(ValueError, match=f"at most {MAX_BANNED_TOKENS}"):
        config.check_supported(SamplingParams(min_tokens=1, stop_token_ids=list(range(8))), num_eos_tokens=1)
    config.check_supported(SamplingParams(min_tokens=1, stop_token_ids=list(range(7))), num_eos_tokens=1)


_PARAMS = st.sampled_from(
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, prompt_logprobs=1),
        SamplingParams(temperature=0.5, presence_penalty=0.5, prompt_logprobs=0),
    ]
)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(_PARAMS, st.booleans(), st.integers(1, 4)), min_size=1, max_size=4))
def test_every_step_a_batch_can_ask_for_is_compiled_and_has_the_compiled_shapes(rows):
    """The engine never runs a (bucket, variant) that warmup did not compile, and its inputs have exactly
    the shapes and dtypes that step was compiled for (padding_inputs)."""
    config = steps(penalty_variants=True, prompt_logprob_variants=True)
    scheduled = []
    for i, (params, prefill, num_tokens) in enumerate(rows):
        request = Request(f"r{i}", list(range(1, 9)), params)
        length = num_tokens if prefill else 1
        scheduled.append(row(request, 0, length, [1, 2], prefill=prefill))
    scheduled.sort(key=lambda r: not r.is_prefill)  # prefill chunks first
    batch = ScheduledBatch(rows=scheduled, num_prefill_rows=sum(r.is_prefill for r in scheduled))

    inputs, bucket, variant = make_step_inputs(batch, None, config)

    assert (bucket, variant) in config.compiled_steps()
    padding = padding_inputs(bucket, variant, config)
    assert _layout(inputs) == _layout(padding)
    params = [r.request.sampling_params for r in scheduled]
    if all(p.is_greedy and p.logprobs is None for p in params):
        expected = SamplerMode.GREEDY
    elif any(not p.is_greedy and p.top_p < 1 and p.top_k is None for p in params):
        expected = SamplerMode.SORTED  # a top-p without a top-k needs the whole vocabulary's mass
    else:
        expected = SamplerMode.CANDIDATES
    assert variant.sampler is expected


def _layout(inputs) -> list:
    """(field path, shape, dtype) of every array of a StepInputs, None for an absent extra."""
    layout = []
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if value is None or isinstance(value, np.ndarray):
            layout.append((f.name, None if value is None else (value.shape, value.dtype)))
        else:
            layout += [(f"{f.name}.{name}", shape) for name, shape in _layout(value)]
    return layout


# ---- the vectorised fill against a row-by-row construction --------------------------------------

_RANDOM_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=3),
    SamplingParams(temperature=0.7, min_p=0.05, n=2, seed=11),
    SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[17, 19]),
    SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=-0.2),
    SamplingParams(temperature=0.0, prompt_logprobs=1, prompt_logprobs_start=3),
    SamplingParams(temperature=0.5, prompt_logprobs=0, logprobs=2),
]


def random_batch(rng: np.random.Generator, config: StepConfig) -> tuple[ScheduledBatch, ScheduledBatch]:
    """Prefill chunks, decode rows with a known or a pending (carried) last input, and the previous step
    that sampled the pending ones; block lists a random permutation, some holding a block more."""
    bs = config.buckets.block_size
    free_blocks = iter((1 + rng.permutation(400)).tolist())
    prefill, decode, previous = [], [], []
    for i in range(int(rng.integers(1, 9))):
        params = _RANDOM_PARAMS[int(rng.integers(len(_RANDOM_PARAMS)))]
        samples = make_requests(f"r{i}", rng.integers(1, VOCAB, int(rng.integers(2, 20))).tolist(), params)
        request = samples[int(rng.integers(len(samples)))]
        kind = rng.choice(["prefill", "known", "pending"])
        if kind == "prefill":
            request.token_ids += rng.integers(1, VOCAB, int(rng.integers(0, 3))).tolist()  # a recompute
            start = bs * int(rng.integers(0, (len(request.token_ids) - 1) // bs + 1))
            num_tokens = int(rng.integers(1, len(request.token_ids) - start + 1))
            known_end = start + num_tokens
        else:
            request.token_ids += rng.integers(1, VOCAB, int(rng.integers(1, 6))).tolist()
            start = len(request.token_ids) - (kind == "known")
            num_tokens, known_end = 1, len(request.token_ids)
        held = -(-(start + num_tokens) // bs) + int(rng.integers(0, 2))
        scheduled = ScheduledRow(
            request=request,
            start=start,
            num_tokens=num_tokens,
            token_ids=request.token_ids[start:known_end],
            block_ids=array("i", [next(free_blocks) for _ in range(held)]),
            samples=kind != "prefill" or known_end == len(request.token_ids),
            input_pending=kind == "pending",
            generation_index=int(rng.integers(0, 6)),
            epoch=0,
            is_prefill=kind == "prefill",
        )
        (prefill if kind == "prefill" else decode).append(scheduled)
        if kind == "pending" or rng.random() < 0.3:
            previous.append(dataclasses.replace(scheduled, start=start - 1, samples=kind == "pending"))
    order = rng.permutation(len(previous)).tolist()
    previous_batch = ScheduledBatch(rows=[previous[i] for i in order])
    return ScheduledBatch(rows=prefill + decode, num_prefill_rows=len(prefill)), previous_batch


def row_by_row_inputs(batch: ScheduledBatch, previous: ScheduledBatch, config: StepConfig, bucket, variant):
    """The step's inputs filled one row and one token at a time, the plainest construction."""
    expected = padding_inputs(bucket, variant, config)
    bs, sampling, history = config.buckets.block_size, expected.sampling, expected.history
    sources = {id(r.request): i for i, r in enumerate(previous.rows) if r.samples}
    offset = 0
    for b, scheduled in enumerate(batch.rows):
        request, params = scheduled.request, scheduled.request.sampling_params
        kv_len = scheduled.start + scheduled.num_tokens
        expected.block_table[b, : -(-kv_len // bs)] = scheduled.block_ids[: -(-kv_len // bs)]
        for j in range(scheduled.num_tokens):
            position = scheduled.start + j
            expected.positions[offset + j] = position
            expected.slot_mapping[0, offset + j] = scheduled.block_ids[position // bs] * bs + position % bs
            if j < len(scheduled.token_ids):
                expected.token_ids[offset + j] = scheduled.token_ids[j]
            scored = params.scored_prompt_start
            if variant.prompt_logprobs and scheduled.is_prefill and scored is not None:
                if scored <= position + 1 < request.num_prompt_tokens:
                    expected.prompt_targets[offset + j] = request.prompt_token_ids[position + 1]
        offset += scheduled.num_tokens
        expected.cu_q_lens[b + 1] = offset
        expected.kv_lens[b] = kv_len
        expected.logits_indices[b] = offset - 1
        if scheduled.input_pending:
            expected.carried_mask[b] = True
            expected.carried_source[b] = sources[id(request)]
        if scheduled.generation_index < params.min_tokens:
            banned = [*request.eos_token_ids, *params.stop_token_ids][:MAX_BANNED_TOKENS]
            expected.banned_tokens[b, : len(banned)] = banned
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            getattr(sampling, name)[b] = getattr(params, name)
        sampling.top_k[b] = params.top_k or 0
        sampling.seed[b] = request.seed or 0
        sampling.has_seed[b] = request.seed is not None
        sampling.generation_index[b] = scheduled.generation_index
        if history is not None:
            known = request.token_ids[: min(kv_len, len(request.token_ids))]
            history.token_ids[b, : len(known)] = known
            history.num_prompt_tokens[b] = request.num_prompt_tokens
            if scheduled.input_pending:
                history.carried_column[b] = kv_len - 1
    expected.cu_q_lens[len(batch.rows) + 1 :] = offset
    expected.num_seqs[()] = len(batch.rows)
    return expected


def _leaves(inputs, prefix: str = "") -> dict[str, np.ndarray | None]:
    leaves = {}
    for f in dataclasses.fields(inputs):
        value = getattr(inputs, f.name)
        if value is None or isinstance(value, np.ndarray):
            leaves[prefix + f.name] = value
        else:
            leaves.update(_leaves(value, f"{prefix}{f.name}."))
    return leaves


@pytest.mark.parametrize("seed", range(40))
def test_step_inputs_equal_a_row_by_row_construction_on_random_batches(seed):
    config = steps(max_batch_size=8, max_num_tokens=256, penalty_variants=True, prompt_logprob_variants=True)
    batch, previous = random_batch(np.random.default_rng(seed), config)
    inputs, bucket, variant = make_step_inputs(batch, previous, config)
    expected = row_by_row_inputs(batch, previous, config, bucket, variant)
    got, want = _leaves(inputs), _leaves(expected)
    assert got.keys() == want.keys()
    for name, wanted in want.items():
        if wanted is None:
            assert got[name] is None, name
        else:
            assert got[name].dtype == wanted.dtype, name
            np.testing.assert_array_equal(got[name], wanted, err_msg=name)


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_steady_decode_steps_built_from_the_previous_step_equal_steps_built_in_full(policy):
    """`make_step_inputs` builds a steady decode step from the previous step's inputs (`_advanced`): over a
    scheduler's steps with the engine's overlap (step N+1 scheduled before step N's tokens arrive), with
    admissions, finishes, preemptions (a small pool), forks (n=2), min_tokens bans and blocks filling up,
    every step it so builds equals the same batch built in full."""
    from jaxserve.block_manager import BlockManager
    from jaxserve.config import CapacityPolicy, SchedulerConfig
    from jaxserve.scheduler import Scheduler
    from jaxserve.step_inputs import BatchColumns, StepInputsCache, _advanced, _built

    config = EngineConfig(
        8,
        32,
        64,
        kv_cache=KvCacheConfig(block_size=4),
        scheduler=SchedulerConfig(capacity_policy=CapacityPolicy(policy)),
        compile=CompileConfig(decode_batch_sizes=(1, 2, 4, 8)),
        attention_backend="xla",
    )
    step_config = StepConfig.from_config(config, VOCAB)
    scheduler = Scheduler(config, BlockManager(48, 4))
    rng = np.random.default_rng(0)
    for i in range(24):
        params = SamplingParams(
            max_tokens=int(rng.integers(4, 30)),
            min_tokens=int(rng.integers(0, 4)),
            temperature=float(rng.choice([0.0, 0.8])),
            n=2 if i % 7 == 3 else 1,
            seed=i if i % 2 else None,
            ignore_eos=True,
        )
        prompt = rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist()
        for request in make_requests(str(i), prompt, params, eos_token_ids=(2,)):
            scheduler.add(request)
    in_flight, advanced, steps_built, cache = None, 0, 0, StepInputsCache()
    while scheduler.has_unfinished() or in_flight is not None:
        batch = scheduler.schedule()
        if not batch.is_empty:
            last = cache.last  # the step in flight, as built
            inputs, bucket, variant = make_step_inputs(batch, in_flight, step_config, cache)
            steps_built += 1
            if in_flight is not None and _advanced(batch, cache.last.columns, last, step_config):
                advanced += 1
                again = ScheduledBatch(batch.rows, batch.num_prefill_rows)
                columns = BatchColumns.read(again, StepInputsCache())
                want_inputs, want_bucket, want_variant = _built(again, columns, last.columns, step_config)
                assert (bucket, variant) == (want_bucket, want_variant)
                got, want = _leaves(inputs), _leaves(want_inputs)
                assert got.keys() == want.keys()
                for name, wanted in want.items():
                    if wanted is None:
                        assert got[name] is None, name
                    else:
                        assert got[name].dtype == wanted.dtype, name
                        np.testing.assert_array_equal(got[name], wanted, err_msg=name)
        if in_flight is not None:
            scheduler.update(in_flight, rng.integers(3, VOCAB, len(in_flight.rows)))
        in_flight = None if batch.is_empty else batch
    assert steps_built > 50 and advanced > steps_built // 4, (steps_built, advanced)

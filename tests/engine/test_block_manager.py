"""Block pool: reserved block 0, ref counts, prefix hashes, LRU reuse and eviction, fork, statistics."""

from array import array

import pytest

from jaxserve.block_manager import RESERVED_BLOCK, BlockManager, hash_block
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams

BS = 4


def make_request(tokens, request_id="r"):
    return Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def compute(manager, request, num_tokens):
    """What the scheduler does for a step: take blocks, advance the computed count."""
    assert manager.append_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens


def assert_pool_consistent(manager, requests):
    held = {}
    for request in requests:
        # Packed C ints: make_step_inputs joins the rows' arrays into the block table as bytes.
        assert isinstance(request.block_ids, array) and request.block_ids.typecode == "i"
        for block in request.block_ids:
            held[block] = held.get(block, 0) + 1
    assert RESERVED_BLOCK not in held
    for block in range(manager.num_blocks):
        assert manager.ref_count(block) == held.get(block, 0)
    assert manager.num_free_blocks + len(held) == manager.num_usable_blocks


def test_hash_is_stable_and_chained():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, (1, 2, 3, 4))
    assert first.hex() == hash_block(None, [1, 2, 3, 4]).hex()
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])


def test_block_zero_is_never_handed_out():
    manager = BlockManager(num_blocks=5, block_size=BS)
    request = make_request(range(16))
    manager.allocate(request)
    compute(manager, request, 16)
    assert sorted(request.block_ids) == [1, 2, 3, 4]
    assert not manager.append_slots(request, 1)  # pool exhausted: nothing taken, block 0 untouched
    assert len(request.block_ids) == 4
    assert_pool_consistent(manager, [request])


def test_allocate_append_free_and_ref_counts():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    request = make_request(range(6))
    assert manager.allocate(request) == 0
    assert manager.num_blocks_to_append(request, 6) == 2
    compute(manager, request, 6)
    assert len(request.block_ids) == 2 and manager.usage == pytest.approx(2 / 7)
    compute(manager, request, 2)  # fills the second block: no new one
    assert len(request.block_ids) == 2
    compute(manager, request, 1)
    assert len(request.block_ids) == 3
    assert_pool_consistent(manager, [request])
    manager.free(request)
    assert request.block_ids == array("i") and manager.num_free_blocks == 7 and manager.num_cached_free_blocks == 0
    assert_pool_consistent(manager, [])


def test_repeated_prompt_reuses_every_full_block_but_the_last_token_one():
    manager = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(100, 111))  # 11 tokens: blocks [0:4] [4:8] full, [8:11] partial
    first = make_request(prompt, "a")
    manager.allocate(first)
    compute(manager, first, 11)
    manager.cache_full_blocks(first)
    second = make_request(prompt, "b")
    assert manager.probe(second).num_cached_blocks == 2 and manager.probe(second).num_in_use == 2
    assert manager.allocate(second) == 8
    assert second.block_ids == first.block_ids[:2] and second.num_computed_tokens == 8
    assert manager.ref_count(first.block_ids[0]) == 2
    assert manager.stats.queried_tokens == 22 and manager.stats.hit_tokens == 8
    assert manager.stats.hit_rate == pytest.approx(8 / 22)
    assert_pool_consistent(manager, [first, second])


def test_prompt_of_whole_blocks_still_computes_its_last_block():
    manager = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(8))
    first = make_request(prompt, "a")
    manager.allocate(first)
    compute(manager, first, 8)
    manager.cache_full_blocks(first)
    second = make_request(prompt, "b")
    # Both blocks are cached, but the one holding the last token must be computed to sample from.
    assert manager.allocate(second) == 4


def test_blocks_are_registered_only_once_computed_and_known():
    manager = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))
    first = make_request(prompt, "a")
    manager.allocate(first)
    assert manager.append_slots(first, 12)  # taken but not computed: nothing to share yet
    manager.cache_full_blocks(first)
    assert manager.probe(make_request(prompt, "b")).num_cached_blocks == 0
    first.num_computed_tokens = 5
    manager.cache_full_blocks(first)
    assert manager.probe(make_request(prompt, "c")).num_cached_blocks == 1


def test_freed_blocks_stay_reusable_and_are_evicted_lru_only_when_needed():
    manager = BlockManager(num_blocks=7, block_size=BS)
    a = make_request(range(0, 9), "a")
    manager.allocate(a)
    compute(manager, a, 9)  # blocks 1, 2 full, 3 partial
    manager.free(a)
    assert manager.num_cached_free_blocks == 2 and manager.num_free_blocks == 6
    b = make_request(range(50, 59), "b")
    manager.allocate(b)
    compute(manager, b, 9)  # takes never-used blocks first: a's cached blocks survive
    assert manager.num_cached_free_blocks == 2
    assert manager.probe(make_request(range(0, 9), "a2")).num_cached_blocks == 2
    c = make_request(range(80, 88), "c")
    manager.allocate(c)
    compute(manager, c, 8)  # one never-used block left, then evicts the least recently freed (a's tail)
    probe = manager.probe(make_request(range(0, 9), "a3"))
    assert probe.num_cached_blocks == 1 and probe.num_in_use == 0
    assert_pool_consistent(manager, [b, c])


def test_cached_block_hit_leaves_the_lru_and_comes_back():
    manager = BlockManager(num_blocks=8, block_size=BS)
    a = make_request(range(9), "a")
    manager.allocate(a)
    compute(manager, a, 9)
    manager.free(a)
    b = make_request(range(9), "b")
    assert manager.allocate(b) == 8
    assert manager.num_cached_free_blocks == 0 and all(manager.ref_count(x) == 1 for x in b.block_ids)
    compute(manager, b, 1)
    assert_pool_consistent(manager, [b])
    manager.free(b)
    assert manager.num_cached_free_blocks == 2
    assert_pool_consistent(manager, [])


def test_a_request_asking_for_prompt_logprobs_reuses_nothing():
    manager = BlockManager(num_blocks=8, block_size=BS)
    a = make_request(range(9), "a")
    manager.allocate(a)
    compute(manager, a, 9)
    manager.cache_full_blocks(a)
    scoring = Request(
        request_id="s", prompt_token_ids=list(range(9)), sampling_params=SamplingParams(prompt_logprobs=0)
    )
    assert manager.probe(scoring).num_cached_blocks == 0 and manager.allocate(scoring) == 0


def test_prefix_caching_off_shares_nothing():
    manager = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request(range(9), "a")
    manager.allocate(a)
    compute(manager, a, 9)
    manager.free(a)
    assert manager.num_cached_free_blocks == 0
    assert manager.allocate(make_request(range(9), "b")) == 0


def test_fork_shares_full_prompt_blocks_and_recomputes_the_partial_one():
    manager = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    parent = make_request(range(10), "p")
    child = make_request(range(10), "p")
    manager.allocate(parent)
    compute(manager, parent, 10)
    assert manager.num_shareable_blocks(parent, child) == 2
    assert manager.fork(parent, child) == 8
    assert child.block_ids == parent.block_ids[:2]
    assert all(manager.ref_count(b) == 2 for b in child.block_ids)
    compute(manager, child, 2)  # the partial tail goes to a block of its own
    assert child.block_ids[2] != parent.block_ids[2]
    assert_pool_consistent(manager, [parent, child])
    manager.free(parent)
    assert all(manager.ref_count(b) == 1 for b in child.block_ids)
    manager.free(child)
    assert_pool_consistent(manager, [])


def test_fork_before_the_parent_computed_shares_only_computed_blocks():
    manager = BlockManager(num_blocks=10, block_size=BS)
    parent = make_request(range(10), "p")
    manager.allocate(parent)
    compute(manager, parent, 4)
    assert manager.num_shareable_blocks(parent, make_request(range(10), "p")) == 1


def test_misuse_is_an_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=BS)
    manager = BlockManager(num_blocks=4, block_size=BS)
    request = make_request(range(3))
    manager.allocate(request)
    compute(manager, request, 3)
    with pytest.raises(RuntimeError, match="already holds blocks"):
        manager.allocate(request)

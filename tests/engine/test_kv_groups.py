"""KV by layer group (jaxserve/kv_layout.py): the layouts of mixed models, the pages a long sequence holds in each
group as it runs, prefix hits and forks that respect each group's window, and the budget counting pages."""

from __future__ import annotations

import pytest

from jaxserve.block_manager import RESERVED_BLOCK, BlockManager
from jaxserve.kv_layout import KVLayout, kv_layout
from jaxserve.models import registry, shapes
from jaxserve.request import Request
from jaxserve.sampling import SamplingParams


def windows_of(name: str) -> list[int | None]:
    _, cfg = registry.resolve(shapes.shape(name))
    return [layer.sliding_window for layer in cfg.attention_layers]


def make_request(tokens, request_id: str = "r") -> Request:
    return Request(request_id=request_id, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def compute(manager: BlockManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does for a step: take pages (releasing what the windows left), advance."""
    assert manager.append_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens


def live(manager: BlockManager, request: Request, group: int) -> list[int]:
    """Logical blocks whose page group `group` holds."""
    ids, groups = request.block_ids, manager.num_groups
    return [i for i in range(len(ids) // groups) if ids[i * groups + group] != RESERVED_BLOCK]


def test_layouts_of_mixed_models():
    gemma3 = kv_layout(windows_of("gemma-3-12b"))
    # 8 full and 40 sliding layers: pages of 8 layers, one full group and five sliding ones.
    assert gemma3.layers_per_page == 8 and sorted(gemma3.windows, key=str) == [1024] * 5 + [None]
    assert gemma3.group_of[5] == gemma3.windows.index(None)  # every sixth layer is full
    gemma2 = kv_layout(windows_of("gemma-2-9b"))
    assert gemma2.windows == (4096, None) and gemma2.layers_per_page == 21
    llama = kv_layout(windows_of("llama-3.1-8b"))
    assert llama == KVLayout((None,), (0,) * 32, tuple(range(32)), 32) and not llama.releases
    # The switch off: one group of every layer that keeps every token, as a model without windows.
    assert kv_layout(windows_of("gemma-3-12b"), keep_window_only=False) == KVLayout(
        (None,), (0,) * 48, tuple(range(48)), 48
    )
    # Kinds whose layer counts do not divide: the last group of a kind has empty slots.
    uneven = kv_layout([4, 4, 4, None, None])
    assert uneven.windows == (4, 4, None) and uneven.layers_per_page == 2 and uneven.slot_of == (0, 1, 0, 0, 1)


def test_a_32k_sequence_holds_every_block_in_full_groups_and_its_window_in_sliding_ones():
    """Gemma-3-12B's layout, blocks of 16, a 32k-token prompt in chunks of 2048 then 64 decode steps."""
    layout = kv_layout(windows_of("gemma-3-12b"))
    block_size, chunk, window = 16, 2048, 1024
    manager = BlockManager(num_blocks=20_000, block_size=block_size, enable_prefix_caching=False, layout=layout)
    request = make_request(range(32768))
    manager.allocate(request)
    full = layout.windows.index(None)
    most_sliding = 0
    steps = [chunk] * (32768 // chunk) + [1] * 64
    for num_tokens in steps:
        compute(manager, request, num_tokens)
        end = request.num_computed_tokens
        assert live(manager, request, full) == list(range(-(-end // block_size)))  # full: every block
        step_blocks = -(-(window - 1 + num_tokens) // block_size) + 1  # the window plus one step's chunk
        for group in range(layout.num_groups):
            if group != full:
                held = live(manager, request, group)
                assert held == list(range(held[0], -(-end // block_size)))  # contiguous, up to the last block
                assert len(held) <= step_blocks, (end, len(held))
                most_sliding = max(most_sliding, len(held))
    assert most_sliding == (window + chunk) // block_size  # aligned chunks: one block under the bound
    # The pool holds exactly what the groups hold: 2052 full + 5 x 64 sliding pages, against 6 x 2052.
    held = manager.num_used_blocks
    assert held == manager.pages_held(request) == 2052 + 5 * 64
    assert 6 * 2052 / held > 5.0
    manager.free(request)
    assert manager.num_used_blocks == 0


def prefill_in_chunks(manager: BlockManager, tokens, chunk: int) -> Request:
    request = make_request(tokens)
    manager.allocate(request)
    while request.num_computed_tokens < len(tokens):
        compute(manager, request, min(chunk, len(tokens) - request.num_computed_tokens))
    return request


def test_prefix_hits_need_each_sliding_groups_window():
    layout = kv_layout([8, None])  # one sliding layer (window 8) and one full layer
    manager = BlockManager(num_blocks=64, block_size=4, layout=layout)
    first = prefill_in_chunks(manager, range(40), 8)
    assert live(manager, first, 0) == [6, 7, 8, 9]  # released before the last chunk: below its window (25..)
    manager.release_outside_window(first)
    assert live(manager, first, 0) == [8, 9]  # the window of position 40: 33..39
    manager.free(first)  # full computed pages stay cached, the released ones too (registered before release)
    again = make_request([*range(40), 99])
    assert manager.allocate(again) == 40
    # Reused: every full-group block, and the sliding group's blocks from its window of position 40 on.
    assert live(manager, again, 1) == list(range(10)) and live(manager, again, 0) == [8, 9]
    manager.free(again)
    # A prefix of 24 tokens: the full group has its 6 blocks, the sliding group its blocks 4 and 5.
    shorter = make_request([*range(24), 99])
    assert manager.allocate(shorter) == 24 and live(manager, shorter, 0) == [4, 5]


def test_a_prefix_is_cut_where_a_sliding_group_lost_its_window():
    layout = kv_layout([8, None])
    manager = BlockManager(num_blocks=64, block_size=4, layout=layout)
    first = prefill_in_chunks(manager, range(40), 8)
    manager.free(first)
    # LRU order of the cached pages: the sliding blocks released while running (1, 0, 3, 2, 5, 4), then the
    # rest as freed. A request taking 48 fresh pages (43 never used) evicts the five oldest: sliding 0..3, 5.
    filler = make_request(range(1000, 1096), "filler")
    manager.allocate(filler)
    compute(manager, filler, 96)
    again = make_request([*range(40), 99])
    assert manager.allocate(again) == 40  # its window at 40 (blocks 8, 9) survived
    # Every prefix below needs a sliding block among 0..5 for its window: no hit at all.
    cut = make_request([*range(28), 99], "cut")
    assert manager.allocate(cut) == 0
    for request in (filler, again, cut):
        manager.free(request)
    assert manager.num_used_blocks == 0


@pytest.mark.parametrize(("prompt_len", "shared"), [(17, 4), (20, 0)])
def test_a_fork_shares_only_what_each_group_still_holds(prompt_len: int, shared: int):
    layout = kv_layout([12, None])
    manager = BlockManager(num_blocks=64, block_size=4, layout=layout)
    parent = prefill_in_chunks(manager, range(prompt_len), 32)
    manager.release_outside_window(parent)
    child = make_request(range(prompt_len), "child")
    # 17 tokens: the parent keeps sliding blocks 1.. (window of position 17 starts at 6), the child computes from
    # 16, whose window needs blocks 1..3: all four full blocks are shared. 20 tokens: the parent keeps blocks 2..;
    # every shorter prefix's window needs a lower block, so the child shares nothing.
    assert manager.num_shareable_blocks(parent, child) == shared
    assert manager.fork(parent, child) == shared * 4
    assert live(manager, child, 1) == list(range(shared))
    for request in (parent, child):
        manager.free(request)
    assert manager.num_used_blocks == 0


@pytest.mark.parametrize("keep_window_only", [True, False])
def test_budget_counts_pages_of_one_full_length_sequence(keep_window_only):
    layout = kv_layout(windows_of("gemma-3-12b"), keep_window_only=keep_window_only)
    pages = layout.max_live_blocks(32768, 2048, 16)
    assert pages == (2048 + 5 * 193 if keep_window_only else 2048)


def test_the_scheduler_reserves_a_decoding_sequence_its_window_not_its_prompt_chunk():
    """GUARANTEED_NO_EVICT reserves each running sequence the most pages it will hold from now on: after its
    prompt, a sliding group's window plus one token, so more sequences run at once than their prompt chunks'
    peak would allow, and none ever misses a page it was promised."""
    from jaxserve.config import CapacityPolicy, EngineConfig, KvCacheConfig, SchedulerConfig
    from jaxserve.scheduler import Scheduler

    layout = kv_layout([16] * 5 + [None])  # Gemma 3's pattern, window 16
    block_size, max_len, chunk, num_pages = 4, 127, 64, 600
    config = EngineConfig(
        max_batch_size=16,
        max_num_tokens=chunk,
        max_seq_len=128,
        kv_cache=KvCacheConfig(block_size=block_size, enable_prefix_caching=False),
        scheduler=SchedulerConfig(capacity_policy=CapacityPolicy.GUARANTEED_NO_EVICT, bucket_aware_admission=False),
    )
    manager = BlockManager(num_pages, block_size, False, layout=layout)
    scheduler = Scheduler(config, manager, clock=lambda: 0.0)
    requests = [
        Request(request_id=str(i), prompt_token_ids=[1 + i] * 64, sampling_params=SamplingParams(max_tokens=64))
        for i in range(12)
    ]
    for request in requests:
        scheduler.add(request)
    prefill_peak, decode_peak = layout.max_live_blocks(max_len, chunk, 4), layout.max_live_blocks(max_len, 1, 4)
    assert (prefill_peak, decode_peak) == (137, 57)
    most_running = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        most_running = max(most_running, len(scheduler.running))
        assert manager.num_used_blocks <= num_pages
        scheduler.update(batch, [2] * len(batch.rows))
    # Reserving every sequence its prompt chunk's peak would run 600 // 137 = 4 at once; one prefilling
    # sequence beside decoding ones fits (600 - 137) // 57 + 1 = 9.
    assert most_running == (num_pages - prefill_peak) // decode_peak + 1 == 9
    assert scheduler.num_preemptions == 0
    assert all(len(r.output_token_ids) == 64 for r in requests)
    assert manager.num_used_blocks == 0

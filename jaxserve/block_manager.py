"""The KV block pool: which block holds which sequence's tokens, shared blocks, and the prefix cache.

- Block 0 is reserved: padding tokens of a step write there, so it is never handed out.
- Blocks are reference counted: a block is shared by the samples of one request (fork) and by
  requests whose prompts start with the same tokens (prefix cache hits).
- Prefix caching: a full, computed block is identified by a hash chained over its tokens and its
  parent block's hash. When its last user frees it, it keeps its KV and its hash and waits in LRU
  order; a later request whose prefix hashes the same takes it back instead of recomputing it. Such a
  block is evicted (its hash forgotten) only when a fresh block is needed and no never-used block is
  left.
- Only full blocks are ever shared; the block holding a sequence's last known token is never
  reused, so every admitted sequence computes at least one token (the one whose logits it samples).
  A fork therefore needs no copy-on-write: the child shares the parent's full prompt blocks and
  recomputes the partial tail (at most block_size tokens) into blocks of its own.
- A request that asks for prompt logprobs takes prefix-cache hits only below the position it is scored
  from (`SamplingParams.prompt_logprobs_start`): scoring position p needs the logits computed at p - 1.

A block's hash is registered once the tokens it holds are known on the host and its KV has been
written by a step already dispatched (`cache_full_blocks`, called on update and before a free), so a
step never reads a cached block that the same step writes.

Layer groups (`jaxserve/kv_layout.py`): every logical block of a sequence has one page per group, interleaved in
`Request.block_ids` (entry `block * num_groups + group`); all groups draw pages from one free list. A sliding
group's pages below its window of the sequence's next query are released as the sequence runs (the entry
becomes 0). The prefix cache keys pages by (group, block hash); a prefix of n blocks is a hit only where every
full group holds all n blocks and every sliding group the blocks its window at position n * block_size needs.
Sizes and counts below are in pages; `blocks_for` and prefix lengths in logical blocks.

Host policy: no jax here.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.kv_layout import KVLayout, kv_layout
from jaxserve.request import Request

RESERVED_BLOCK = 0


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable hash of one full block: its tokens (as little-endian int32) chained to its parent's hash.

    hashlib rather than Python's hash(): the same prefix hashes the same in every process.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash if parent_hash is not None else b"root")
    digest.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return digest.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache at admission, and how many were found."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True, slots=True)
class PrefixProbe:
    """What admitting a request would reuse, without taking anything.

    num_cached_blocks: leading full (logical) blocks the request would reuse.
    num_in_use: of the pages that reuse takes, those other sequences hold now (they take no free page).
    next_block_hash: the hash of the first reusable full block the cache lacks (None: none lacking).
    """

    num_cached_blocks: int
    num_in_use: int
    next_block_hash: bytes | None = None


class BlockManager:
    """Block pool with ref counts and a prefix cache; see the module docstring for the rules.

    num_blocks counts block 0, so `num_blocks - 1` pages can hold tokens. layout: the model's KV groups
    (None: one group that keeps every token).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, layout: KVLayout | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout if layout is not None else kv_layout([None])
        self.num_groups = self.layout.num_groups
        self.stats = PrefixCacheStats()
        self._empty_pool()

    def _empty_pool(self) -> None:
        num_blocks = self.num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[tuple[int, bytes] | None] = [None] * num_blocks  # page -> (group, block hash)
        self._hash_to_block: dict[tuple[int, bytes], int] = {}
        # Never-used (or evicted) blocks; popped from the end, so low ids go first.
        self._free: list[int] = list(range(num_blocks - 1, RESERVED_BLOCK, -1))
        # Unreferenced blocks that keep a hash, oldest first: evicted from the front.
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()

    # ---- sizes ---------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: never-used ones plus evictable cached ones."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Share of usable blocks held by running sequences."""
        return self.num_used_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def live_pages(self, start: int, end: int) -> int:
        """Pages a sequence holds over its groups while it computes positions [start, end)."""
        return self.layout.live_blocks(start, end, self.block_size)

    def lifetime_pages(self, max_len: int, max_chunk: int) -> int:
        """The most pages a sequence of up to max_len tokens, max_chunk of them a step, holds at once."""
        return self.layout.max_live_blocks(max_len, max_chunk, self.block_size)

    def pages_held(self, request: Request) -> int:
        """Pages the request holds now (released entries are 0)."""
        ids = request.block_ids
        return len(ids) - ids.count(RESERVED_BLOCK) if self.layout.releases else len(ids)

    def num_logical_blocks(self, request: Request) -> int:
        """Logical blocks the request has pages for (released ones included)."""
        return len(request.block_ids) // self.num_groups

    # ---- prefix lookup and admission -----------------------------------------------------------

    def _max_reusable_blocks(self, request: Request) -> int:
        # Never the block of the last known token: its logits must be computed to sample from. Nor, when
        # the prompt is scored from position s, the block of token s - 1, whose logits score position s.
        last_needed = len(request.token_ids) - 1
        scored_start = request.sampling_params.scored_prompt_start
        if scored_start is not None:
            last_needed = min(last_needed, scored_start - 1)
        return last_needed // self.block_size

    def _prefix(self, request: Request) -> tuple[int, list[bytes]]:
        """(n, hashes): the most leading reusable blocks n whose pages every group holds where it needs them,
        and the hashes of the blocks looked at (at least n; one more when the cache lacks block n)."""
        if not self.enable_prefix_caching:
            return 0, []
        layout, cached = self.layout, self._hash_to_block
        full = [g for g, window in enumerate(layout.windows) if window is None]
        sliding = [g for g, window in enumerate(layout.windows) if window is not None]
        hashes: list[bytes] = []
        parent = request.cache_root  # a LoRA adapter's blocks hash apart from the base model's and each other's
        tokens = request.token_ids
        longest = 0  # blocks every full group holds (any number when there is no full group)
        for i in range(self._max_reusable_blocks(request)):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
            if not all((g, parent) in cached for g in full):
                break
            longest = i + 1
        if not sliding:
            return longest, hashes
        for n in range(longest, 0, -1):
            if all(
                (g, hashes[i]) in cached
                for g in sliding
                for i in range(layout.first_live_block(g, n * self.block_size, self.block_size), n)
            ):
                return n, hashes
        return 0, hashes

    def _prefix_pages(self, n: int, hashes: list[bytes]) -> list[tuple[int, int]]:
        """(entry of block_ids, page) of each page a prefix of n blocks reuses."""
        pages = []
        for g in range(self.num_groups):
            for i in range(self.layout.first_live_block(g, n * self.block_size, self.block_size), n):
                pages.append((i * self.num_groups + g, self._hash_to_block[(g, hashes[i])]))
        return pages

    def probe(self, request: Request) -> PrefixProbe:
        """Prefix hits admitting `request` would get; changes nothing."""
        n, hashes = self._prefix(request)
        in_use = sum(1 for _, page in self._prefix_pages(n, hashes) if self._ref_counts[page] > 0)
        next_hash = hashes[n] if len(hashes) > n else None
        return PrefixProbe(num_cached_blocks=n, num_in_use=in_use, next_block_hash=next_hash)

    def uncached_prompt_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full prompt blocks not registered yet: the blocks it is computing (or
        will), which a request with the same prefix can take once they are registered."""
        if not self.enable_prefix_caching:
            return []
        hashes: list[bytes] = []
        parent = request.block_hashes[-1] if request.block_hashes else request.cache_root
        tokens = request.token_ids
        for i in range(len(request.block_hashes), request.num_prompt_tokens // self.block_size):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def allocate(self, request: Request) -> int:
        """Takes the cached pages of the request's prefix; returns the number of tokens it covers.

        The request must hold no blocks. It gets exactly the hit pages (a sliding group's entries below its
        window are 0; later tokens get pages through `append_slots`), and its num_computed_tokens starts after
        the prefix.
        """
        if request.block_ids or request.num_computed_tokens:
            raise RuntimeError(f"request {request.request_id}[{request.index}] already holds blocks")
        n, hashes = self._prefix(request)
        ids = array("i", bytes(4 * n * self.num_groups))  # zeros
        for entry, page in self._prefix_pages(n, hashes):
            self._take(page)
            ids[entry] = page
        request.block_ids = ids
        request.block_hashes = hashes[:n]
        cached_tokens = n * self.block_size
        request.num_computed_tokens = cached_tokens
        request.num_cached_tokens = cached_tokens
        self.stats.queried_tokens += len(request.token_ids)
        self.stats.hit_tokens += cached_tokens
        return cached_tokens

    def num_shareable_blocks(self, parent: Request, child: Request) -> int:
        """Full prompt blocks a fork of `parent` would give `child`: the parent's computed ones, as far as every
        group of the parent still holds the pages the child's window there needs."""
        last_token_block = (min(len(parent.token_ids), len(child.token_ids)) - 1) // self.block_size
        computed = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
        shared = max(0, min(last_token_block, computed, self.num_logical_blocks(parent)))
        if self.layout.releases:
            while shared and any(parent.block_ids[entry] == RESERVED_BLOCK for entry in self._entries(shared)):
                shared -= 1
        return shared

    def _entries(self, n: int) -> list[int]:
        """The block_ids entries a sequence whose first n blocks are computed needs (each group's live ones)."""
        groups = self.num_groups
        return [
            i * groups + g
            for g in range(groups)
            for i in range(self.layout.first_live_block(g, n * self.block_size, self.block_size), n)
        ]

    def fork(self, parent: Request, child: Request) -> int:
        """Shares the parent's full computed prompt blocks with `child`; returns the tokens they hold.

        The child recomputes the rest of the prompt (the partial last block) into blocks of its own,
        so no block is ever written by two sequences.
        """
        if child.block_ids or child.num_computed_tokens:
            raise RuntimeError(f"request {child.request_id}[{child.index}] already holds blocks")
        shared = self.num_shareable_blocks(parent, child)
        ids = array("i", bytes(4 * shared * self.num_groups))
        for entry in self._entries(shared):
            page = parent.block_ids[entry]
            self._ref_counts[page] += 1
            ids[entry] = page
        child.block_ids = ids
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = shared * self.block_size
        child.num_cached_tokens = child.num_computed_tokens
        return child.num_computed_tokens

    # ---- growth and release --------------------------------------------------------------------

    def num_blocks_to_append(self, request: Request, num_new_tokens: int) -> int:
        """Fresh pages needed to compute num_new_tokens more tokens of `request` (after its releases)."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - self.num_logical_blocks(request)) * self.num_groups

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Releases the pages the request's sliding groups no longer need, then gives it the pages its next
        num_new_tokens tokens need; False (nothing taken) if short."""
        if self.layout.releases:
            self.release_outside_window(request)
        missing = self.num_blocks_to_append(request, num_new_tokens)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            request.block_ids.append(self._take_fresh())
        return True

    def release_outside_window(self, request: Request) -> None:
        """Frees each sliding group's pages wholly below the window of the request's next query (at
        num_computed_tokens); a full, hashed page stays cached. Steps already dispatched may still read them:
        a later step that writes a reused page runs after them on the device."""
        layout, groups, ids = self.layout, self.num_groups, request.block_ids
        self.cache_full_blocks(request)
        for g, window in enumerate(layout.windows):
            if window is None:
                continue
            below = min(layout.first_live_block(g, request.num_computed_tokens, self.block_size), len(ids) // groups)
            for i in range(below - 1, -1, -1):  # the newest first: stop at the first one already released
                entry = i * groups + g
                if ids[entry] == RESERVED_BLOCK:
                    break
                self._release(ids[entry])
                ids[entry] = RESERVED_BLOCK

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the hashes of the request's full blocks whose tokens are known and computed (every group's
        page of such a block that it still holds)."""
        if not self.enable_prefix_caching:
            return
        tokens = request.token_ids
        groups = self.num_groups
        num_full = min(request.num_computed_tokens, len(tokens)) // self.block_size
        num_full = min(num_full, len(request.block_ids) // groups)
        parent = request.block_hashes[-1] if request.block_hashes else request.cache_root
        for i in range(len(request.block_hashes), num_full):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            request.block_hashes.append(parent)
            for g in range(groups):
                page = request.block_ids[i * groups + g]
                key = (g, parent)
                # A page already known under this hash (computed twice concurrently) stays unregistered.
                if page != RESERVED_BLOCK and self._block_hash[page] is None and key not in self._hash_to_block:
                    self._block_hash[page] = key
                    self._hash_to_block[key] = page

    def free(self, request: Request) -> None:
        """Releases the request's pages; full computed ones stay cached for reuse (tail ones evicted first)."""
        self.cache_full_blocks(request)
        # Freed in reverse so the tail of a sequence is evicted before its (more shareable) prefix.
        for page in reversed(request.block_ids):
            if page != RESERVED_BLOCK:
                self._release(page)
        request.block_ids = array("i")
        request.block_hashes = []

    def _release(self, page: int) -> None:
        self._ref_counts[page] -= 1
        if self._ref_counts[page] < 0:
            raise RuntimeError(f"block {page} freed more often than taken")
        if self._ref_counts[page] == 0:
            if self._block_hash[page] is not None:
                self._cached_free[page] = None
            else:
                self._free.append(page)

    def reset(self, requests: Iterable[Request]) -> None:
        """Every block free and no prefix cached; `requests` (every one that held blocks) hold none.

        The way back to a known state after a step failed or was interrupted, whatever the pool's
        bookkeeping then was: the KV contents are no longer trusted, so no cached prefix survives.
        """
        self._empty_pool()
        for request in requests:
            request.block_ids = array("i")
            request.block_hashes = []
            request.num_cached_tokens = 0

    # ---- internals -----------------------------------------------------------------------------

    def _take(self, block: int) -> None:
        """References a cached block (a prefix hit); an unreferenced one leaves the LRU."""
        if self._ref_counts[block] == 0:
            del self._cached_free[block]
        self._ref_counts[block] += 1

    def _take_fresh(self) -> int:
        """A block for new tokens: a never-used one, else the least recently freed cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached_free.popitem(last=False)
            key = self._block_hash[block]
            if key is not None and self._hash_to_block.get(key) == block:
                del self._hash_to_block[key]
            self._block_hash[block] = None
        if block == RESERVED_BLOCK or self._ref_counts[block] != 0:
            raise RuntimeError(f"block {block} handed out while reserved or referenced")
        self._ref_counts[block] = 1
        return block

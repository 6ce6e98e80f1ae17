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

Host policy: no jax here.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

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

    num_cached_blocks: leading full blocks found in the cache.
    num_in_use: of those, blocks other sequences hold now (reusing them takes no free block).
    next_block_hash: the hash of the first reusable full block the cache lacks (None: none lacking).
    """

    num_cached_blocks: int
    num_in_use: int
    next_block_hash: bytes | None = None


class BlockManager:
    """Block pool with ref counts and a prefix cache; see the module docstring for the rules.

    num_blocks counts block 0, so `num_blocks - 1` blocks can hold tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self._empty_pool()

    def _empty_pool(self) -> None:
        num_blocks = self.num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
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
        """Blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and admission -----------------------------------------------------------

    def _max_reusable_blocks(self, request: Request) -> int:
        # Never the block of the last known token: its logits must be computed to sample from. Nor, when
        # the prompt is scored from position s, the block of token s - 1, whose logits score position s.
        last_needed = len(request.token_ids) - 1
        scored_start = request.sampling_params.scored_prompt_start
        if scored_start is not None:
            last_needed = min(last_needed, scored_start - 1)
        return last_needed // self.block_size

    def _lookup(self, request: Request) -> list[tuple[int, bytes]]:
        """(block, hash) of the leading cached full blocks of the request's known tokens (those before
        the position its prompt is scored from, when it asks for prompt logprobs)."""
        if not self.enable_prefix_caching:
            return []
        return [(block, block_hash) for block, block_hash in self._leading_blocks(request) if block is not None]

    def _leading_blocks(self, request: Request) -> Iterator[tuple[int | None, bytes]]:
        """(cached block, hash) of each reusable full block of the request, up to and including the first
        that the cache lacks (block None)."""
        parent: bytes | None = None
        tokens = request.token_ids
        for i in range(self._max_reusable_blocks(request)):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self._hash_to_block.get(parent)
            yield block, parent
            if block is None:
                return

    def probe(self, request: Request) -> PrefixProbe:
        """Prefix hits admitting `request` would get; changes nothing."""
        if not self.enable_prefix_caching:
            return PrefixProbe(num_cached_blocks=0, num_in_use=0)
        leading = list(self._leading_blocks(request))
        found = [block for block, _ in leading if block is not None]
        in_use = sum(1 for block in found if self._ref_counts[block] > 0)
        next_hash = leading[-1][1] if leading and leading[-1][0] is None else None
        return PrefixProbe(num_cached_blocks=len(found), num_in_use=in_use, next_block_hash=next_hash)

    def uncached_prompt_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full prompt blocks not registered yet: the blocks it is computing (or
        will), which a request with the same prefix can take once they are registered."""
        if not self.enable_prefix_caching:
            return []
        hashes: list[bytes] = []
        parent = request.block_hashes[-1] if request.block_hashes else None
        tokens = request.token_ids
        for i in range(len(request.block_hashes), request.num_prompt_tokens // self.block_size):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def allocate(self, request: Request) -> int:
        """Takes the cached blocks of the request's prefix; returns the number of tokens they hold.

        The request must hold no blocks. It gets exactly the hit blocks (later tokens get blocks
        through `append_slots`), and its num_computed_tokens starts after them.
        """
        if request.block_ids or request.num_computed_tokens:
            raise RuntimeError(f"request {request.request_id}[{request.index}] already holds blocks")
        found = self._lookup(request)
        for block, _ in found:
            self._take(block)
        request.block_ids = array("i", [block for block, _ in found])
        request.block_hashes = [block_hash for _, block_hash in found]
        cached_tokens = len(found) * self.block_size
        request.num_computed_tokens = cached_tokens
        request.num_cached_tokens = cached_tokens
        self.stats.queried_tokens += len(request.token_ids)
        self.stats.hit_tokens += cached_tokens
        return cached_tokens

    def num_shareable_blocks(self, parent: Request, child: Request) -> int:
        """Full prompt blocks a fork of `parent` would give `child` (parent's computed ones only)."""
        last_token_block = (min(len(parent.token_ids), len(child.token_ids)) - 1) // self.block_size
        computed = min(parent.num_computed_tokens, parent.num_prompt_tokens) // self.block_size
        return max(0, min(last_token_block, computed, len(parent.block_ids)))

    def fork(self, parent: Request, child: Request) -> int:
        """Shares the parent's full computed prompt blocks with `child`; returns the tokens they hold.

        The child recomputes the rest of the prompt (the partial last block) into blocks of its own,
        so no block is ever written by two sequences.
        """
        if child.block_ids or child.num_computed_tokens:
            raise RuntimeError(f"request {child.request_id}[{child.index}] already holds blocks")
        shared = self.num_shareable_blocks(parent, child)
        for block in parent.block_ids[:shared]:
            self._ref_counts[block] += 1
        child.block_ids = parent.block_ids[:shared]  # a slice of an array is a copy
        child.block_hashes = list(parent.block_hashes[:shared])
        child.num_computed_tokens = shared * self.block_size
        child.num_cached_tokens = child.num_computed_tokens
        return child.num_computed_tokens

    # ---- growth and release --------------------------------------------------------------------

    def num_blocks_to_append(self, request: Request, num_new_tokens: int) -> int:
        """Fresh blocks needed to compute num_new_tokens more tokens of `request`."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_ids))

    def append_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Gives `request` the blocks its next num_new_tokens tokens need; False (nothing taken) if short."""
        missing = self.num_blocks_to_append(request, num_new_tokens)
        if missing > self.num_free_blocks:
            return False
        for _ in range(missing):
            request.block_ids.append(self._take_fresh())
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the hashes of the request's full blocks whose tokens are known and computed."""
        if not self.enable_prefix_caching:
            return
        tokens = request.token_ids
        num_full = min(request.num_computed_tokens, len(tokens)) // self.block_size
        num_full = min(num_full, len(request.block_ids))
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            parent = hash_block(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            request.block_hashes.append(parent)
            block = request.block_ids[i]
            # A block already known under this hash (computed twice concurrently) stays unregistered.
            if self._block_hash[block] is None and parent not in self._hash_to_block:
                self._block_hash[block] = parent
                self._hash_to_block[parent] = block

    def free(self, request: Request) -> None:
        """Releases the request's blocks; full computed ones stay cached for reuse (tail ones evicted first)."""
        self.cache_full_blocks(request)
        # Freed in reverse so the tail of a sequence is evicted before its (more shareable) prefix.
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is not None:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)
        request.block_ids = array("i")
        request.block_hashes = []

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
            block_hash = self._block_hash[block]
            if block_hash is not None and self._hash_to_block.get(block_hash) == block:
                del self._hash_to_block[block_hash]
            self._block_hash[block] = None
        if block == RESERVED_BLOCK or self._ref_counts[block] != 0:
            raise RuntimeError(f"block {block} handed out while reserved or referenced")
        self._ref_counts[block] = 1
        return block

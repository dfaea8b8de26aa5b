"""Which KV blocks each request holds, prefix-cache look-ups, and slot allocation.

A request holds one block table per KV cache group (kv_cache_groups.py; one group unless the
model mixes sliding-window and full attention). Position p lives in block p // block_size of
every group's table; a sliding-window group hands back the blocks its window has left behind
and names the null block in their place (the kernels mask those positions anyway).
"""

from __future__ import annotations

from shardlm.core.block_pool import BlockPool, KVCacheBlock
from shardlm.core.request import Request
from shardlm.kv_cache_groups import KVCacheGroups
from shardlm.utils import cdiv

ONE_GROUP = KVCacheGroups((None,), ((),))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, groups: KVCacheGroups = ONE_GROUP):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = groups
        self.windowed = [g for g, w in enumerate(groups.windows) if w is not None]
        self.pool = BlockPool(num_blocks, enable_caching)
        self.null_block = self.pool.null_block
        self.req_blocks: dict[str, list[list[KVCacheBlock]]] = {}       # per request, per group
        self._num_cached_blocks: dict[str, int] = {}
        self._freed_upto: dict[str, list[int]] = {}     # per request, per group: blocks before it are freed
        # prefix cache statistics, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def null_block_id(self) -> int:
        return self.null_block.block_id

    def usage(self) -> float:
        return self.pool.usage()

    def _key(self, group: int, block_hash: bytes):
        """The prefix-cache key of a block of `group`: the same tokens are other memory in each group."""
        return block_hash if group == 0 else (group, block_hash)

    def _cached(self, group: int, block_hash: bytes) -> KVCacheBlock | None:
        return self.pool.get_cached_block(self._key(group, block_hash))

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Longest cached prefix of full blocks, as each group's blocks (a window group's: only
        those its window reaches from the prefix's end, null blocks before); at least one prompt
        token is left to compute (its logits are needed). Requests that want prompt logprobs
        compute everything."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.groups.windows], 0
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        for g, window in enumerate(self.groups.windows):
            if window is None:
                n = next((i for i in range(n) if self._cached(g, hashes[i]) is None), n)
        while n > 0 and not all(self._cached(g, h) is not None for g in self.windowed
                                for h in hashes[self._first_kept(g, n * self.block_size):n]):
            n -= 1
        hits = []
        for g in range(self.groups.num_groups):
            first = self._first_kept(g, n * self.block_size)
            hits.append([self.null_block] * first + [self._cached(g, h) for h in hashes[first:n]])
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        return hits, n * self.block_size

    def _first_kept(self, group: int, first_query_pos: int) -> int:
        return self.groups.first_kept_block(group, first_query_pos, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVCacheBlock]] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of `request` (after the prefix-cache hits
        new_computed_blocks, per group, for a request just admitted); False if the pool is short."""
        req_id = request.request_id
        tables = self.req_blocks.get(req_id)
        hits = new_computed_blocks or [[] for _ in self.groups.windows]
        start = request.num_computed_tokens + len(hits[0]) * self.block_size
        num_total = start + num_new_tokens
        if tables is not None:
            self._free_behind_windows(req_id, tables, start)
        held = tables or [[] for _ in self.groups.windows]
        num_needed = [max(0, cdiv(num_total, self.block_size) - len(t) - len(h)) for t, h in zip(held, hits)]
        # cached blocks nobody holds sit in the free queue; taking them shrinks it
        num_reclaimed = sum(1 for h in hits for b in h if b.ref_cnt == 0)
        if sum(num_needed) > self.pool.num_free_blocks - num_reclaimed:
            return False
        if tables is None:
            tables = self.req_blocks[req_id] = held
            self._freed_upto[req_id] = [0] * len(tables)
        if hits[0]:
            for g, (table, h) in enumerate(zip(tables, hits)):
                self.pool.touch([b for b in h if b is not self.null_block])
                table.extend(h)
                self._freed_upto[req_id][g] = self._first_kept(g, start)
            self._num_cached_blocks[req_id] = len(hits[0])
        for table, n in zip(tables, num_needed):
            if n > 0:
                table.extend(self.pool.allocate(n))
        if self.enable_caching:
            self._cache_full_blocks(request, tables, num_total)
        return True

    def _free_behind_windows(self, req_id: str, tables: list[list[KVCacheBlock]], first_query_pos: int) -> None:
        """Each window group's blocks wholly before the window of the next query go back to the pool."""
        freed_upto = self._freed_upto[req_id]
        for g in self.windowed:
            table, freed = tables[g], []
            first = min(self._first_kept(g, first_query_pos), len(table))
            for i in range(freed_upto[g], first):
                if table[i] is not self.null_block:
                    freed.append(table[i])
                    table[i] = self.null_block
            freed_upto[g] = max(freed_upto[g], first)
            self.pool.free(reversed(freed))

    def _cache_full_blocks(self, request: Request, tables: list[list[KVCacheBlock]], num_tokens: int) -> None:
        # Blocks are registered when their tokens are scheduled: the forward pass writes a
        # layer's K/V for the whole batch before any attention reads, so a request scheduled
        # in the same step may already share them.
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for g, table in enumerate(tables):
            for i in range(start, end):
                if table[i] is not self.null_block:
                    self.pool.cache(table[i], self._key(g, request.block_hashes[i]))
        self._num_cached_blocks[request.request_id] = max(start, end)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table of each group."""
        tables = self.req_blocks.get(request_id)
        return [[b.block_id for b in t] for t in tables] if tables else [[] for _ in self.groups.windows]

    def free(self, request: Request) -> None:
        tables = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._freed_upto.pop(request.request_id, None)
        for table in tables:
            self.pool.free(b for b in reversed(table) if b is not self.null_block)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

"""Which KV blocks each request holds, prefix-cache look-ups, and slot allocation."""

from __future__ import annotations

from shardlm.core.block_pool import BlockPool, KVCacheBlock
from shardlm.core.request import Request
from shardlm.utils import cdiv


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # prefix cache statistics, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def null_block_id(self) -> int:
        return self.pool.null_block.block_id

    def usage(self) -> float:
        return self.pool.usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; at least one prompt token is left to compute
        (its logits are needed). Requests that want prompt logprobs compute everything."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is short."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # cached blocks nobody holds sit in the free queue; taking them shrinks it
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Blocks are registered when their tokens are scheduled: the forward pass writes a
        # layer's K/V for the whole batch before any attention reads, so a request scheduled
        # in the same step may already share them.
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

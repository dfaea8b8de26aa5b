"""The pool of KV cache blocks: reference counts, the prefix-cache index and LRU eviction.

A block is *free* when no request references it (ref_cnt == 0). Free blocks keep their
cached contents (and hash) until they are reused, so a later request with the same prefix
can take them back: that is automatic prefix caching. A freed block that caches nothing (prefix
caching off, or a block never filled) is reused first: its memory is already faulted in and
likely still in the CPU's caches, where a never-used block costs page faults on first write
(about 0.5-1 ms a block of the default model in float32). Cached blocks are reused least
recently freed first. Block 0 is the null block: never handed out, used for padding in attention.
"""

from __future__ import annotations

from collections import OrderedDict


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self):
        key = self.block_hash.hex()[:8] if isinstance(self.block_hash, bytes) else self.block_hash
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={key})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # The front is reused first: freed blocks that cache nothing, then never-used blocks in
        # increasing id order (the CPU runner faults memory in above a high-water mark), then
        # cached blocks, least recently freed first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cached: dict[int, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise RuntimeError(f"Asked for {n} blocks with only {len(self._free)} free.")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no request holds blocks."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
        self._cached.clear()
        return True

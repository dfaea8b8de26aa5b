import pytest

from shardlm.core.block_pool import BlockPool
from shardlm.core.kv_cache_manager import KVCacheManager
from shardlm.core.request import Request, hash_block_tokens
from shardlm.sampling_params import SamplingParams


def make_request(rid, tokens, block_size=4, **sp):
    return Request(rid, tokens, SamplingParams(**{"max_tokens": 8, **sp}), [2], 1000, block_size)


def test_null_block_is_never_handed_out():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    assert 0 not in [b.block_id for b in blocks]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_cached_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(5, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, 1)
    pool.cache(c, 3)
    pool.free([c, a])           # c freed first, then a
    assert pool.num_free_blocks == 2
    assert [x.block_id for x in pool.allocate(2)] == [c.block_id, a.block_id]


@pytest.mark.parametrize("enable_caching", [True, False])
def test_blocks_that_cache_nothing_are_reused_before_fresh_and_cached_ones(enable_caching):
    """A freed block holding no prefix is taken again before a never-used block (whose memory is
    still to be faulted in) and before any cached block; never-used blocks go in id order."""
    pool = BlockPool(8, enable_caching=enable_caching)
    a, b, c = pool.allocate(3)
    if enable_caching:
        pool.cache(a, 1)
    pool.free([c, b, a])
    first = [x.block_id for x in pool.allocate(2 if enable_caching else 3)]
    assert sorted(first) == sorted([b.block_id, c.block_id] + ([] if enable_caching else [a.block_id]))
    assert [x.block_id for x in pool.allocate(4)] == [4, 5, 6, 7]
    if enable_caching:
        assert pool.allocate(1) == [a] and a.block_hash is None


def test_sharing_keeps_block_until_last_reference():
    pool = BlockPool(3, enable_caching=True)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 123)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert pool.num_free_blocks == 1     # still held by one
    pool.free([blk])
    assert pool.num_free_blocks == 2
    assert pool.get_cached_block(123) is blk   # free but still cached


def test_eviction_drops_the_hash_when_reused():
    pool = BlockPool(2, enable_caching=True)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 7)
    pool.free([blk])
    (again,) = pool.allocate(1)
    assert again is blk and blk.block_hash is None and pool.get_cached_block(7) is None


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3, enable_caching=True)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 9)
    pool.free([blk])
    assert pool.num_free_blocks == 2
    pool.touch([pool.get_cached_block(9)])
    assert pool.num_free_blocks == 1 and blk.ref_cnt == 1


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(3, enable_caching=True)
    (blk,) = pool.allocate(1)
    pool.cache(blk, 5)
    assert not pool.reset_prefix_cache()
    pool.free([blk])
    assert pool.reset_prefix_cache() and pool.get_cached_block(5) is None


def test_block_hashes_chain_over_full_blocks():
    r = make_request("a", list(range(10)))
    assert len(r.block_hashes) == 2
    assert r.block_hashes[0] == hash_block_tokens(None, (0, 1, 2, 3))
    assert r.block_hashes[1] == hash_block_tokens(r.block_hashes[0], (4, 5, 6, 7))
    other = make_request("b", [9, 1, 2, 3, 4, 5, 6, 7])
    assert other.block_hashes[1] != r.block_hashes[1]    # same tokens, different prefix
    r.append_output_token(10)
    r.append_output_token(11)
    assert len(r.block_hashes) == 3


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = make_request("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and len(hits[0]) == 2        # the last block is recomputed: a prompt token must remain
    assert kv.allocate_slots(b, 4, hits)
    [a_table], [b_table] = kv.block_ids("a"), kv.block_ids("b")
    assert a_table[:2] == b_table[:2] and a_table[2] != b_table[2]
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 9


def test_no_hits_without_caching_or_with_prompt_logprobs():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    assert kv.allocate_slots(make_request("a", list(range(12))), 12)
    assert kv.get_computed_blocks(make_request("b", list(range(12)), prompt_logprobs=1)) == ([[]], 0)
    off = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    assert off.allocate_slots(make_request("a", list(range(12))), 12)
    assert off.get_computed_blocks(make_request("b", list(range(12)))) == ([[]], 0)


def test_allocation_fails_cleanly_when_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    r = make_request("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)      # needs 5 blocks, 3 usable
    assert kv.pool.num_free_blocks == 3 and kv.block_ids("a") == [[]]


@pytest.mark.slow
def test_prefix_keys_are_keyed_per_process():
    """A client cannot compute the cache keys (vLLM CVE-2025-25183): they are keyed with a secret
    drawn per process, so the same tokens give another key in another process."""
    import subprocess
    import sys
    code = "from shardlm.core.request import hash_block_tokens as h; print(h(None, (1, 2, 3, 4)).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    here = hash_block_tokens(None, (1, 2, 3, 4))
    assert len(here) == 16 and other != here.hex()
    assert hash_block_tokens(None, (1, 2, 3, 4)) == here

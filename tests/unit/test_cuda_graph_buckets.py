"""The shapes CUDA graphs are captured at (worker/cuda_graphs.py): every decode step fits one."""

from shardlm.worker.cuda_graphs import batch_bucket, blocks_bucket


def test_batch_buckets_cover_every_batch_size_with_little_padding():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 255)] == [1, 2, 4, 4, 8, 8, 16, 16, 24, 256]
    for n in range(1, 600):
        assert n <= batch_bucket(n) <= max(4, n + 7)
    assert len({batch_bucket(n) for n in range(1, 257)}) == 35      # graphs at most, for 256 sequences


def test_blocks_buckets_are_powers_of_two_up_to_the_longest_sequence():
    assert [blocks_bucket(n, 512) for n in (1, 2, 3, 5, 16, 17, 300, 512)] == [1, 2, 4, 8, 16, 32, 512, 512]
    assert blocks_bucket(300, 300) == 300          # max_model_len / block_size need not be a power of two
    for n in range(1, 513):
        assert n <= blocks_bucket(n, 512) < 2 * n

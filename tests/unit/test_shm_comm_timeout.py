"""A shared-memory collective whose peer never arrives fails after its timeout, naming the peer,
instead of spinning forever."""

import time

import pytest
import torch

from shardlm.distributed.shm_comm import ShmCommunicator


class _LoneRank:
    """Rank 0 of a two-rank group whose other rank never shows up."""
    rank_in_group, world_size, ranks = 0, 2, [4, 5]

    def broadcast_object(self, obj):
        return obj

    def barrier(self):
        pass


def test_a_missing_peer_times_out_naming_it():
    comm = ShmCommunicator(_LoneRank(), slot_bytes=1 << 12, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) 5 .*--execute-model-timeout"):
            comm.all_reduce(torch.ones(8))
        assert time.monotonic() - t0 >= 0.5       # it waited its timeout first
    finally:
        comm.close()

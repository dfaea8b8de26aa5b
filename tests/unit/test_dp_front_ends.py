"""The head server's door for the other servers of a hybrid load balancing deployment of expert
parallel replicas (engine/dp_front_ends.py), over real sockets and no engine: who it takes, what
it answers, the waves it relays both ways, a new world after a restart, and the loss of a server."""

import dataclasses
import queue
import threading

import pytest

from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.dp_front_ends import HeadFrontEnd, PeerFrontEnd, front_ends_of
from shardlm.engine.dp_remote import join_head
from tests.helpers import free_port


def _config(path, rank, port, **kw):
    return EngineArgs(model=path, data_parallel_size=3, data_parallel_rank=rank, enable_expert_parallel=True,
                      data_parallel_rpc_port=port, distributed_init_timeout=5, **kw).create_engine_config()


def test_the_head_takes_each_other_server_once_relays_waves_and_names_a_lost_one(tiny_model_dir):
    path, port = tiny_model_dir("mixtral"), free_port()
    head, second = (_config(path, rank, port) for rank in (0, 1))
    head = front_ends_of(head)
    assert isinstance(head, HeadFrontEnd)
    lost, waves = queue.Queue(), queue.Queue()
    head.on_lost = lost.put
    try:
        # a server that joins before the head's world exists waits for it, then gets its store
        peer = front_ends_of(second)
        assert isinstance(peer, PeerFrontEnd) and peer.node_address == "127.0.0.1"
        peer_waves = queue.Queue()
        joined = []
        joiner = threading.Thread(target=lambda: joined.append(peer.new_world()))
        joiner.start()
        joiner.join(0.5)
        assert not joined, "answered before the head's world exists"
        store = head.new_world()
        joiner.join(5)
        assert joined == [store]

        # what it refuses, saying why
        with pytest.raises(RuntimeError, match=r"replica\(s\) 1 have already joined"):
            join_head(_saying(second, 1), 5)
        with pytest.raises(RuntimeError, match="it runs something else: architecture"):
            join_head(_saying(_config(tiny_model_dir("qwen2-moe"), 2, port), 2), 5)
        with pytest.raises(RuntimeError, match=r"replica\(s\) 0 are not ones this head waits for \(1, 2\)"):
            join_head(_saying(second, 0), 5)

        # waves: from the head's replicas to the others', and from theirs to the head's
        head.serve_waves(waves.put)
        peer.serve_waves(peer_waves.put)
        head.send_wave(3)
        assert peer_waves.get(timeout=5) == 3
        peer.send_wave(4)
        assert waves.get(timeout=5) == 4

        # the head's engine starts again: the others are told, and join its next world
        peer_lost = queue.Queue()
        peer.on_lost = peer_lost.put
        store = head.new_world()
        assert "left the world" in peer_lost.get(timeout=5)
        assert peer.new_world() == store

        peer.close()             # that server went away: the head's engine is told which
        reason = lost.get(timeout=5)
        assert "replica(s) 1 on" in reason and "went away" in reason, reason
    finally:
        head.close()


def _saying(config, rank):
    """config, joining as replica `rank` (as PeerFrontEnd joins with its first)."""
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank))


def test_waves_before_the_cores_are_ready_wait_for_them(tiny_model_dir):
    head = front_ends_of(_config(tiny_model_dir("mixtral"), 0, free_port()))
    try:
        head._wave_arrived(2)
        head._wave_arrived(5)
        got = []
        head.serve_waves(got.append)
        assert got == [5], "the latest wave only: it is the one running"
        head._wave_arrived(6)
        assert got == [5, 6]
        head.new_world()            # a new world: its cores are not ready yet
        head._wave_arrived(1)
        assert got == [5, 6]
    finally:
        head.close()


"""The shared-memory broadcast queue: order, wrap-around, messages larger than a slot, many
readers in other processes, close() waking waiters."""

import multiprocessing
import threading

import pytest

from shardlm.distributed.shm_queue import QueueClosed, ShmQueue


def _messages(n):
    # sizes from empty to several slots (slot_bytes=256 below), so chunks wrap the ring
    return [bytes([i % 251]) * ((i * 97) % 1500) for i in range(n)]


def _read_all(queue, reader, n, replies):
    q = queue.attach_reader(reader)
    got = [q.get(timeout=30) for _ in range(n)]
    replies.put((reader, [len(m) for m in got], all(m == e for m, e in zip(got, _messages(n)))))


def test_order_wraparound_and_large_messages_in_one_process():
    q = ShmQueue(num_readers=1, slot_bytes=256, num_slots=4)
    reader = ShmQueue.__new__(ShmQueue)
    reader.__setstate__(q.__getstate__())
    reader.attach_reader(0)
    try:
        msgs = _messages(40)
        received = []
        t = threading.Thread(target=lambda: received.extend(reader.get(timeout=10) for _ in msgs))
        t.start()
        for m in msgs:
            q.put(m, timeout=10)
        t.join(20)
        assert received == msgs
    finally:
        reader.destroy()
        q.destroy()


@pytest.mark.slow
def test_many_readers_in_other_processes_see_every_message_in_order():
    ctx = multiprocessing.get_context("spawn")
    n_readers, n = 3, 60
    q = ShmQueue(num_readers=n_readers, slot_bytes=256, num_slots=4, ctx=ctx)
    replies = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(q, r, n, replies)) for r in range(n_readers)]
    for p in procs:
        p.start()
    try:
        for m in _messages(n):
            q.put(m, timeout=30)
        results = sorted(replies.get(timeout=60) for _ in procs)
        expected = [len(m) for m in _messages(n)]
        assert results == [(r, expected, True) for r in range(n_readers)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        q.destroy()


def test_writer_waits_for_slow_reader_then_times_out():
    q = ShmQueue(num_readers=1, slot_bytes=64, num_slots=2)
    try:
        q.put(b"a")
        q.put(b"b")
        with pytest.raises(TimeoutError):
            q.put(b"c", timeout=0.2)       # both slots unread
    finally:
        q.destroy()


def test_close_wakes_a_waiting_reader_and_a_blocked_writer():
    q = ShmQueue(num_readers=1, slot_bytes=64, num_slots=2)
    q.attach_reader(0)
    try:
        threading.Timer(0.2, q.close).start()
        with pytest.raises(QueueClosed):
            q.get()
    finally:
        q.destroy()
    q = ShmQueue(num_readers=1, slot_bytes=64, num_slots=2)
    try:
        q.put(b"a")
        q.put(b"b")
        threading.Timer(0.2, q.close).start()
        with pytest.raises(QueueClosed):
            q.put(b"c")                    # no free slot until the close
    finally:
        q.destroy()

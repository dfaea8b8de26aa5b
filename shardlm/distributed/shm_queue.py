"""A one-writer / many-reader message queue in shared memory, for processes on one node.

The engine core broadcasts each step to every worker through one of these (one copy of the
bytes, no socket, no pickle), and each worker answers through its own (one reader).

Layout: a ring of `num_slots` slots. Slot i has one "read" flag per reader, then the data.
A message is written into the next free slot; one larger than a slot continues in the slots
after it (each chunk says the message's total length), so any size goes through while readers
consume. The writer may reuse a slot once every reader has set its flag. Waking is by one
semaphore per reader, released once per written slot, so an idle reader sleeps in the kernel
instead of spinning on the CPU the workers need.

close() marks the queue closed and wakes everyone; waits then raise QueueClosed. The executor
closes its queues when a worker dies, so nobody waits on a peer that is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time
from multiprocessing import shared_memory

_HEADER = 8                       # byte 0: closed flag
_CHUNK = struct.Struct("<QI")     # message length, this chunk's length
_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier (taking a lock is one), between writing data and publishing it."""
    with _fence_lock:
        pass


class QueueClosed(RuntimeError):
    pass


class ShmQueue:
    def __init__(self, num_readers: int, slot_bytes: int = 1 << 18, num_slots: int = 8, ctx=None):
        """Create the queue (writer side). Hand it to reader processes as a spawn argument; each
        calls attach_reader(i) once."""
        ctx = ctx or multiprocessing.get_context("spawn")
        self.num_readers, self.slot_bytes, self.num_slots = num_readers, slot_bytes, num_slots
        self._meta_bytes = -(-num_readers // 8) * 8
        size = _HEADER + num_slots * (self._meta_bytes + slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self._owner_pid = os.getpid()        # a forked reader holds this object too, but does not own it
        self.buf = self.shm.buf
        for slot in range(num_slots):      # every slot starts out read by everyone: free
            off = self._meta(slot)
            self.buf[off:off + num_readers] = b"\x01" * num_readers
        self.buf[0] = 0
        self.wakeups = [ctx.Semaphore(0) for _ in range(num_readers)]
        self.reader = None
        self.next_slot = 0

    # ---- sharing with other processes ----
    def __getstate__(self):
        return {"name": self.shm.name, "num_readers": self.num_readers, "slot_bytes": self.slot_bytes,
                "num_slots": self.num_slots, "wakeups": self.wakeups}

    def __setstate__(self, state):
        self.num_readers, self.slot_bytes = state["num_readers"], state["slot_bytes"]
        self.num_slots, self.wakeups = state["num_slots"], state["wakeups"]
        self._meta_bytes = -(-self.num_readers // 8) * 8
        self.shm = attach_segment(state["name"])
        self._owner_pid = None
        self.buf = self.shm.buf
        self.reader = None
        self.next_slot = 0

    def attach_reader(self, reader: int) -> ShmQueue:
        self.reader = reader
        return self

    # ---- layout ----
    def _meta(self, slot: int) -> int:
        return _HEADER + slot * (self._meta_bytes + self.slot_bytes)

    def _data(self, slot: int) -> int:
        return self._meta(slot) + self._meta_bytes

    @property
    def closed(self) -> bool:
        return self.buf[0] == 1

    def close(self) -> None:
        """Mark closed and wake every waiter (any process may call this)."""
        if self.buf is not None and not self.closed:
            self.buf[0] = 1
            for sem in self.wakeups:
                sem.release()

    # ---- writer ----
    def put(self, data: bytes, timeout: float | None = None) -> None:
        payload = self.slot_bytes - _CHUNK.size
        view, total, sent = memoryview(data), len(data), 0
        while True:
            chunk = view[sent:sent + payload]
            slot = self.next_slot
            self._wait_slot_free(slot, timeout)
            meta, off = self._meta(slot), self._data(slot)
            _CHUNK.pack_into(self.buf, off, total, len(chunk))
            self.buf[off + _CHUNK.size:off + _CHUNK.size + len(chunk)] = chunk
            self.buf[meta:meta + self.num_readers] = b"\x00" * self.num_readers
            memory_fence()
            for sem in self.wakeups:
                sem.release()
            self.next_slot = (slot + 1) % self.num_slots
            sent += len(chunk)
            if sent >= total:
                return

    def _wait_slot_free(self, slot: int, timeout: float | None) -> None:
        meta = self._meta(slot)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0
        while self.buf[meta:meta + self.num_readers] != b"\x01" * self.num_readers:
            if self.closed:
                raise QueueClosed("the queue was closed")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("no reader freed a slot of the queue in time")
            time.sleep(pause)
            pause = min(0.001, pause + 0.00005)

    # ---- reader ----
    def get(self, timeout: float | None = None) -> bytes:
        """The next message; TimeoutError after `timeout` seconds with nothing new."""
        first = self._read_chunk(timeout)
        total, parts, got = first[0], [first[1]], len(first[1])
        while got < total:
            _, chunk = self._read_chunk(None)
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read_chunk(self, timeout: float | None) -> tuple[int, bytes]:
        sem = self.wakeups[self.reader]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not sem.acquire(timeout=0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
            if self.closed:
                raise QueueClosed("the queue was closed")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("no message arrived in time")
        if self.closed:
            raise QueueClosed("the queue was closed")
        memory_fence()
        slot = self.next_slot
        off = self._data(slot)
        total, n = _CHUNK.unpack_from(self.buf, off)
        data = bytes(self.buf[off + _CHUNK.size:off + _CHUNK.size + n])
        memory_fence()
        self.buf[self._meta(slot) + self.reader] = 1
        self.next_slot = (slot + 1) % self.num_slots
        return total, data

    def destroy(self) -> None:
        """Release this process's mapping; the creator also removes the segment."""
        if self.buf is None:
            return
        self.buf.release()
        self.buf = None
        self.shm.close()
        if self._owner_pid == os.getpid():
            self.shm.unlink()


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without registering it with this process's resource tracker
    (which would unlink it when this process exits, under its creator's feet)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)    # Python >= 3.13
    except TypeError:
        from multiprocessing import resource_tracker
        register = resource_tracker.register
        resource_tracker.register = lambda *args: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register

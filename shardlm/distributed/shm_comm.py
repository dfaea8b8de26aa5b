"""All-reduce and gather through shared memory, for CPU ranks of one group on one node.

gloo over loopback TCP costs 1.2-2 ms per all-reduce on a small VM, whatever the size; a
tensor parallel step makes two per layer, so gloo alone would cost more than the model. Here
each rank copies its tensor into its own slot of a shared segment, raises its flag, waits
for every other flag, and reads the slots it needs: a few microseconds plus the copies.

Every rank sums the slots in rank order, in float32, so all ranks get bit-identical results.
Slots are double-buffered by call parity: a rank may start call k+1 (writing the other set)
while a slower rank still reads call k's set, and it cannot get to call k+2 (this set again)
before every rank has arrived at k+1, i.e. finished reading k.
"""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

import torch

from shardlm.distributed.shm_queue import attach_segment, memory_fence

_FLAG_STRIDE = 64 // 8          # one cache line per rank's flag (int64 units)


class ShmCommunicator:
    def __init__(self, group, slot_bytes: int = 8 << 20, timeout_s: float = 300.0):
        """`group`: the GroupCoordinator (its cpu_group carries the segment's name at start).
        timeout_s: how long to wait for a peer before failing with TimeoutError naming it."""
        self.rank, self.world_size = group.rank_in_group, group.world_size
        self.ranks, self.timeout_s = group.ranks, timeout_s
        self.slot_bytes = slot_bytes
        flags_bytes = 64 * self.world_size
        size = flags_bytes + 2 * self.world_size * slot_bytes
        if self.rank == 0:
            shm = shared_memory.SharedMemory(create=True, size=size)
            shm.buf[:flags_bytes] = bytes(flags_bytes)
            group.broadcast_object(shm.name)
        else:
            shm = attach_segment(group.broadcast_object(None))
        group.barrier()
        if self.rank == 0:
            shm.unlink()        # every rank has it mapped; nothing is left behind if a rank dies
        self.shm = shm
        self.flags = shm.buf[:flags_bytes].cast("q")
        self.data = torch.frombuffer(shm.buf, dtype=torch.uint8, offset=flags_bytes,
                                     count=2 * self.world_size * slot_bytes)
        self.calls = 0

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = (parity * self.world_size + rank) * self.slot_bytes
        return self.data[start:start + numel * dtype.itemsize].view(dtype)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Publish x (flat, fits a slot); every rank's x once all have arrived."""
        self.calls += 1
        parity = self.calls % 2
        self._slot(parity, self.rank, x.dtype, x.numel()).copy_(x)
        memory_fence()
        self.flags[self.rank * _FLAG_STRIDE] = self.calls
        for r in range(self.world_size):
            spins, deadline = 0, None
            while self.flags[r * _FLAG_STRIDE] < self.calls:
                spins += 1
                if spins > 64:          # more ranks than free cores: let the others run
                    os.sched_yield()
                    if spins % 4096 == 0:
                        deadline = self._check_deadline(deadline)
        memory_fence()
        return [self._slot(parity, r, x.dtype, x.numel()) for r in range(self.world_size)]

    def _check_deadline(self, deadline: float | None) -> float:
        now = time.monotonic()
        if deadline is None:
            return now + self.timeout_s
        if now > deadline:
            missing = [self.ranks[r] for r in range(self.world_size) if self.flags[r * _FLAG_STRIDE] < self.calls]
            raise TimeoutError(f"A shared-memory collective waited {self.timeout_s:.0f} s for rank(s) "
                               f"{', '.join(map(str, missing))} (--execute-model-timeout): they hang or are stopped.")
        return deadline

    def _chunks(self, x: torch.Tensor):
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            yield flat[start:start + step]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        target = x if x.is_contiguous() else x.contiguous()
        for chunk in self._chunks(target):
            parts = self._exchange(chunk)
            acc = parts[0].to(torch.float32, copy=True)
            for p in parts[1:]:
                acc.add_(p)
            chunk.copy_(acc)
        if target is not x:
            x.copy_(target)
        return x

    def gather(self, x: torch.Tensor, dst: int | None, dim: int) -> torch.Tensor | None:
        """Concatenation of every rank's x along dim on rank dst (every rank if dst is None);
        None elsewhere."""
        x = x.contiguous()
        pieces = [[] for _ in range(self.world_size)]
        chunks = list(self._chunks(x))
        for chunk in chunks:
            parts = self._exchange(chunk)
            if dst is None or self.rank == dst:
                for r, p in enumerate(parts):
                    pieces[r].append(p if len(chunks) == 1 else p.clone())
        if dst is not None and self.rank != dst:
            return None
        return torch.cat([torch.cat(p).view(x.shape) for p in pieces], dim=dim)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return self.gather(x, None, dim)

    def close(self) -> None:
        del self.data
        self.flags.release()
        self.shm.close()

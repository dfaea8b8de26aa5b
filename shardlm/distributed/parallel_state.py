"""The process groups of one engine: world init, the rank grid, and GroupCoordinator.

World ranks are laid out DP x PP x TP with TP fastest, so the ranks of one TP group are
adjacent (one node, the fastest links) and PP groups cut across them:

    world = 8, dp=1, pp=2, tp=4          torch.arange(8).reshape(dp, pp, tp)

                  tp rank:  0   1   2   3
        pp stage 0:       [ 0   1   2   3 ]   <- TP group {0,1,2,3}
        pp stage 1:       [ 4   5   6   7 ]   <- TP group {4,5,6,7}
                            |   |   |   |
                     PP groups {0,4} {1,5} {2,6} {3,7}

Context parallel adds two groups. Decode context parallel (dcp) groups are runs of adjacent
ranks inside a TP group ({0,1} {2,3} ... at dcp=2): ranks that hold the same KV heads, each one
share of every sequence's positions. Prefill context parallel (pcp) is a grid dimension between
PP and TP, DP x PP x PCP x TP: pcp TP groups per stage, each computing its own share of the
tokens; the pcp group joins the ranks of one TP rank across them. The cp group is every rank
holding a share of the same KV heads: a DCP group across the PCP groups (the attention's
partial outputs are merged over it).

Every group gets a GroupCoordinator with two process groups: a device group for tensors
(NCCL on CUDA, gloo on CPU) and a gloo CPU group for small objects and barriers. Layers never
call torch.distributed on the world; they ask get_tp_group() / get_pp_group(). With one rank a
coordinator has no process groups at all and its collectives return their input.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from shardlm.distributed.shm_comm import ShmCommunicator
from shardlm.distributed.shm_queue import ShmQueue
from shardlm.logger import init_logger

logger = init_logger(__name__)


def rank_grid(world_size: int, tp: int, pp: int = 1, dp: int = 1, dcp: int = 1,
              pcp: int = 1) -> dict[str, list[list[int]]]:
    """The ranks of every TP, PP, DP, EP, DCP, PCP and CP group (each group a list of world ranks)."""
    if tp * pp * dp * pcp != world_size:
        raise ValueError(f"world size {world_size} is not dp x pp x pcp x tp = {dp} x {pp} x {pcp} x {tp}.")
    grid = torch.arange(world_size).reshape(dp, pp, pcp, tp)
    return {
        "tp": grid.reshape(-1, tp).tolist(),
        "dcp": grid.reshape(-1, dcp).tolist(),      # tp % dcp == 0: runs of adjacent TP ranks
        "pcp": grid.permute(0, 1, 3, 2).reshape(-1, pcp).tolist(),
        # (pcp rank, dcp rank) of one DCP group's place, pcp-major
        "cp": grid.reshape(dp, pp, pcp, tp // dcp, dcp).permute(0, 1, 3, 2, 4).reshape(-1, pcp * dcp).tolist(),
        "pp": grid.permute(0, 2, 3, 1).reshape(-1, pp).tolist(),
        "dp": grid.permute(1, 2, 3, 0).reshape(-1, dp).tolist(),
        # expert parallel: every DP x TP rank of one pipeline stage (replica-major, as vLLM)
        "ep": grid.permute(1, 2, 0, 3).reshape(pp * pcp, -1).tolist(),
    }


class GroupCoordinator:
    """One group of ranks that this rank belongs to, and the collectives over it."""

    def __init__(self, name: str, ranks: list[int], rank: int, device_group=None, cpu_group=None):
        self.name = name
        self.ranks = ranks
        self.rank = rank                                # world rank
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.shm: ShmCommunicator | None = None        # CPU ranks on one node: collectives in shared memory
        self.shm_links: tuple[ShmQueue | None, ShmQueue | None] = (None, None)

    @classmethod
    def create(cls, name: str, all_groups: list[list[int]], rank: int, backend: str,
               shared_memory: bool = False, timeout_s: float = 300.0) -> GroupCoordinator:
        """Every rank must call this with the same `all_groups` (new_group is collective).
        shared_memory: run all_reduce/gather through shared memory when the group is CPU ranks
        on one host (the TP group: two all-reduces per layer). Groups of one rank need no
        process group (every rank sees the same sizes, so all skip alike)."""
        if all(len(ranks) == 1 for ranks in all_groups):
            return cls(name, [rank], rank)
        mine = None
        for ranks in all_groups:
            device_group = dist.new_group(ranks, backend=backend)
            cpu_group = dist.new_group(ranks, backend="gloo") if backend != "gloo" else device_group
            if rank in ranks:
                mine = cls(name, ranks, rank, device_group, cpu_group)
        if shared_memory and backend == "gloo" and mine.world_size > 1 and mine._on_one_host():
            mine.shm = ShmCommunicator(mine, timeout_s=timeout_s)
        return mine

    def _on_one_host(self) -> bool:
        return len(set(self.hosts())) == 1

    def hosts(self) -> list[str]:
        """Each rank's host name, in group order (every rank of the group calls it together)."""
        if self.world_size == 1:
            return [socket.gethostname()]
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.cpu_group)
        return hosts

    def node_count(self) -> int:
        """The nodes the group spans, where each holds an equal run of consecutive ranks (as the
        rank grid lays them out); 1 where they do not (callers then treat the group as one node)."""
        return nodes_in_runs(self.hosts())

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.shm is not None:
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        if self.shm is not None:
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenation of every rank's `x` along dim on rank `dst` of the group; None elsewhere."""
        if self.world_size == 1:
            return x
        if self.shm is not None:
            return self.shm.gather(x, dst, dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(x, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def broadcast_object(self, obj=None, src: int = 0):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def set_shm_links(self, to_next: ShmQueue | None, from_previous: ShmQueue | None) -> None:
        """CPU ranks on one node: send to the next rank / receive from the previous one through
        these shared-memory queues instead of gloo's TCP (1-2 ms per message on a small VM)."""
        self.shm_links = (to_next, from_previous)

    def send_tensors(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Send tensors to rank `dst` of this group: a small int64 header with their dtypes and
        shapes first (no pickle on the wire), then the data."""
        header = [len(tensors)]
        for t in tensors:
            header += [_DTYPE_CODES.index(t.dtype), t.dim(), *t.shape]
        header = torch.tensor(header + [0] * (_HEADER_LEN - len(header)), dtype=torch.int64)
        link = self.shm_links[0]
        if link is not None and dst == self.rank_in_group + 1:
            link.put(b"".join(_as_bytes(t) for t in [header, *tensors]))
            return
        dist.send(header, dst=self.ranks[dst], group=self.cpu_group)
        for t in tensors:
            dist.send(t.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv_tensors(self, src: int, device: torch.device) -> list[torch.Tensor]:
        link = self.shm_links[1]
        if link is not None and src == self.rank_in_group - 1:
            data = bytearray(link.get())
            header = torch.frombuffer(data, dtype=torch.int64, count=_HEADER_LEN)
            offset = _HEADER_LEN * 8
            out = []
            for dtype, shape in _parse_header(header.tolist()):
                numel = math.prod(shape)
                # (frombuffer refuses a count of 0: a prefill context parallel group may have no tokens)
                out.append(torch.frombuffer(data, dtype=dtype, count=numel, offset=offset).view(shape) if numel
                           else torch.empty(shape, dtype=dtype))
                offset += numel * dtype.itemsize
            return out
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.recv(header, src=self.ranks[src], group=self.cpu_group)
        out = []
        for dtype, shape in _parse_header(header.tolist()):
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, src=self.ranks[src], group=self.device_group)
            out.append(t)
        return out


_DTYPE_CODES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_HEADER_LEN = 32


def _parse_header(h: list[int]) -> list[tuple[torch.dtype, list[int]]]:
    out, pos = [], 1
    for _ in range(h[0]):
        ndim = h[pos + 1]
        out.append((_DTYPE_CODES[h[pos]], h[pos + 2:pos + 2 + ndim]))
        pos += 2 + ndim
    return out


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


# Every group this rank belongs to, by name (GROUP_NAMES), once initialize_model_parallel ran.
GROUP_NAMES = ("world", "tp", "pp", "dp", "ep", "dcp", "pcp", "cp")
_groups: dict[str, GroupCoordinator] = {}
_expert_parallel = [False]
_alone: dict[str, GroupCoordinator] = {}       # this rank as its own groups (alone())


def init_distributed_environment(world_size: int, rank: int, store_host: str, store_port: int,
                                 backend: str, timeout_s: float) -> None:
    """Join the world through the TCP store the executor hosts (see wait_for_ranks)."""
    if world_size == 1:
        return
    store = connect_store(store_host, store_port, world_size, timeout_s)
    store.set(f"arrived/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def listen_for_rendezvous(host: str) -> socket.socket:
    """A listening socket on a free port of `host` (never a fixed port), for host_store. Opening it
    starts no thread, so processes may be forked after it; they connect once the store serves it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError as e:
        sock.close()
        raise ValueError(f"Cannot open a rendezvous port on {host} ({e.strerror}): it is not an address of this "
                         "node. Set SHARDLM_HOST_IP to one of its addresses.") from None
    sock.listen(256)
    return sock


def host_store(host: str, world_size: int, timeout_s: float, listener: socket.socket | None = None) -> dist.TCPStore:
    """The rendezvous store, hosted by the executor on a free port of `host`. It listens on that
    address only (TCPStore alone would listen on every interface): it takes over `listener`, or a
    new one from listen_for_rendezvous."""
    sock = listener or listen_for_rendezvous(host)
    port = sock.getsockname()[1]
    # the store takes the listening socket over (detach: Python must not close it)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=sock.detach())


def connect_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A client of a store hosted elsewhere (a replica's executor, of the DP client's store)."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def missing_ranks(store: dist.TCPStore, ranks: int | Iterable[int]) -> list[int]:
    """Which of `ranks` (or of range(ranks)) have not joined yet."""
    return [r for r in (range(ranks) if isinstance(ranks, int) else ranks) if not store.check([f"arrived/{r}"])]


def wait_for_ranks(store: dist.TCPStore, ranks: int | Iterable[int], timeout_s: float, alive=lambda: True) -> None:
    """Block until every rank of `ranks` (or of range(ranks)) has joined; after timeout_s, an
    error naming the ranks that did not."""
    ranks = list(range(ranks) if isinstance(ranks, int) else ranks)
    deadline = time.monotonic() + timeout_s
    while missing := missing_ranks(store, ranks):
        if not alive():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Distributed init timed out after {timeout_s:.0f} s: rank(s) "
                               f"{', '.join(map(str, missing))} of {len(ranks)} did not join. Check that those "
                               "workers started (their log) and can reach the rendezvous address; raise "
                               "--distributed-init-timeout for slow starts.")
        time.sleep(0.05)


def initialize_model_parallel(tp: int, pp: int = 1, dp: int = 1, rank: int = 0, backend: str = "gloo",
                              timeout_s: float = 300.0, expert_parallel: bool = False, dcp: int = 1,
                              pcp: int = 1) -> None:
    """Build every group of the rank grid; each rank calls this with the same sizes. timeout_s:
    how long a shared-memory collective waits for a peer before it fails naming it.
    expert_parallel: MoE layers place whole experts on the ranks of the EP group (DP x TP of a
    stage) instead of slicing every expert across TP; the DP and EP groups then carry tokens
    every layer, so they get shared-memory collectives too. dcp: decode context parallel ranks
    per TP group (their attention gathers queries and merges partial outputs every layer); pcp:
    prefill context parallel TP groups per stage."""
    world_size = tp * pp * dp * pcp
    _expert_parallel[0] = expert_parallel
    if world_size == 1:
        _groups.update({name: GroupCoordinator(name, [0], 0) for name in GROUP_NAMES})
        return
    grid = rank_grid(world_size, tp, pp, dp, dcp, pcp)

    def create(name: str, **kw) -> None:
        _groups[name] = GroupCoordinator.create(name, grid[name], rank, backend, timeout_s=timeout_s, **kw)
    _groups["world"] = GroupCoordinator.create("world", [list(range(world_size))], rank, backend)
    create("tp", shared_memory=True)
    create("pp")
    create("dp", shared_memory=expert_parallel)
    create("ep", shared_memory=expert_parallel)
    create("dcp", shared_memory=True)
    create("pcp", shared_memory=True)
    # the cp group is the DCP group without PCP, the PCP group without DCP
    if pcp == 1 or dcp == 1:
        _groups["cp"] = _groups["dcp" if pcp == 1 else "pcp"]
    else:
        create("cp", shared_memory=True)
    if rank == 0:
        logger.info("Successfully initialized distributed environment: world=%d, tp=%d, pp=%d, dp=%d, dcp=%d, pcp=%d, "
                    "expert parallel=%s, backend=%s", world_size, tp, pp, dp, dcp, pcp, expert_parallel, backend)


def get_group(name: str) -> GroupCoordinator:
    """This rank's group `name` (one of GROUP_NAMES)."""
    group = _groups.get(name)
    if group is None:
        if name not in GROUP_NAMES:
            raise ValueError(f"There is no process group {name!r}; the groups are {', '.join(GROUP_NAMES)}.")
        raise RuntimeError(f"The {name!r} process group was used before initialize_model_parallel ran in this "
                           "process. An engine's workers call it; a model or layer built outside an engine (a "
                           "test, a tool) calls parallel_state.initialize_model_parallel(1) first.")
    return group


def get_world_group() -> GroupCoordinator:
    return get_group("world")


def get_tp_group() -> GroupCoordinator:
    return get_group("tp")


def get_pp_group() -> GroupCoordinator:
    return get_group("pp")


def get_dp_group() -> GroupCoordinator:
    return get_group("dp")


def get_ep_group() -> GroupCoordinator:
    """The ranks whole experts are spread over (DP x TP of this stage) under expert parallel."""
    return get_group("ep")


def get_dcp_group() -> GroupCoordinator:
    """The decode context parallel ranks this rank shares its KV heads with (within its TP group)."""
    return get_group("dcp")


def get_pcp_group() -> GroupCoordinator:
    """This TP rank's counterparts in the other prefill context parallel groups of its stage."""
    return get_group("pcp")


def get_cp_group() -> GroupCoordinator:
    """Every rank holding a share of this rank's KV heads' positions (DCP x PCP), pcp-major."""
    return get_group("cp")


def expert_parallel_enabled() -> bool:
    return _expert_parallel[0]


@contextlib.contextmanager
def _groups_restored():
    """Within: change the groups at will; after: the groups and expert-parallel flag of before."""
    saved, saved_ep = dict(_groups), _expert_parallel[0]
    try:
        yield
    finally:
        _groups.clear()
        _groups.update(saved)
        _expert_parallel[0] = saved_ep


@contextlib.contextmanager
def single_rank():
    """Within: a world of one rank, for a model or layer built outside an engine (a tool, a test);
    the groups there before come back after."""
    with _groups_restored():
        initialize_model_parallel(1)
        yield


@contextlib.contextmanager
def alone():
    """Within: this rank is its own group of every kind but the world, so a model built and run
    here is whole on this rank and calls no collective (a speculative draft model beside the target)."""
    rank = get_world_group().rank
    if not _alone or _alone["tp"].rank != rank:
        _alone.clear()
        _alone.update({name: GroupCoordinator(name, [rank], rank) for name in GROUP_NAMES if name != "world"})
    with _groups_restored():
        _groups.update(_alone)
        _expert_parallel[0] = False
        yield


def destroy_model_parallel() -> None:
    for group in {id(g): g for g in _groups.values()}.values():
        if group.shm is not None:
            group.shm.close()
    _groups.clear()
    _expert_parallel[0] = False
    if dist.is_initialized():
        dist.destroy_process_group()


def nodes_in_runs(hosts: list[str]) -> int:
    """How many nodes ranks on these hosts (in rank order) span, where each node holds an equal run
    of consecutive ranks; 1 where they do not."""
    nodes = len(set(hosts))
    per_node = len(hosts) // nodes
    runs = [hosts[i:i + per_node] for i in range(0, len(hosts), per_node)]
    even = per_node * nodes == len(hosts) and all(len(set(run)) == 1 for run in runs)
    return nodes if even and len({run[0] for run in runs}) == nodes else 1

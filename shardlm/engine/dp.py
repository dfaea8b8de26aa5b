"""Data parallel: N engine-core replicas behind one client (core_client.MPClient).

Each replica is its own engine core (process, scheduler, KV cache) with its own TP x PP workers;
their ranks are rows of one DP x PP x TP grid (world rank = replica * tp * pp + rank), joined
through one rendezvous store that the client hosts, so get_dp_group() spans the replicas.

The LoadBalancer sends each new request to the replica with the least load, as vLLM's
coordinator does: score = 4 x waiting + running, from the counts each replica reports with its
step outputs and the requests sent to it since. A replica that already holds a request's
prompt prefix (recently sent there) gets a bonus of PREFIX_BLOCK_WEIGHT per matching 16-token
block: 8 such blocks (128 tokens of prefill saved) weigh as much as one running request. Ties
go round-robin.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict

from shardlm.config import EngineConfig, RayBundles
from shardlm.messages import EngineCoreOutputs
from shardlm.spec_decode.stats import SpecDecodingStats

WAITING_WEIGHT = 4             # a waiting request delays every later one more than a running one
PREFIX_BLOCK_WEIGHT = 0.125    # per prompt block a replica probably holds in its prefix cache
_PREFIX_BLOCKS_TRACKED = 4096  # per replica: recent prompt-block hashes (an LRU, not its real cache)
_PREFIX_BLOCKS_LOOKED_AT = 64  # leading blocks of a prompt that count


def replica_configs(config: EngineConfig, master: tuple[str, int] | None,
                    ray_bundles: list[RayBundles] | None = None) -> list[EngineConfig]:
    """One config per replica this node runs: its DP rank, the store every rank meets at, and
    (with the ray executor) where its ranks run."""
    par = config.parallel
    if par.data_parallel_size == 1:
        return [config]
    return [dataclasses.replace(config, parallel=dataclasses.replace(
                par, data_parallel_rank=rank, data_parallel_master=master,
                ray_bundles=None if ray_bundles is None else ray_bundles[rank]))
            for rank in par.local_dp_ranks]


class LoadBalancer:
    """Which replica serves each request, and each replica's load. Called from the caller's
    thread (assign, forget) and from each replica's reader thread (on_outputs), hence the lock."""

    def __init__(self, num_engines: int, block_size: int, prefix_affinity: bool = True):
        self.num_engines = num_engines
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity and num_engines > 1
        self.owner: dict[str, int] = {}                      # request id -> replica
        self.in_flight = [0] * num_engines
        self.reported_running = [0] * num_engines
        self.assigned_total = [0] * num_engines               # requests ever sent to each replica
        self.dead: dict[int, str] = {}                        # replica -> why it died
        self._prefixes = [OrderedDict() for _ in range(num_engines)]
        self._next = itertools.count()
        self._lock = threading.Lock()

    # ---- load ----
    def running(self, k: int) -> int:
        return min(self.reported_running[k], self.in_flight[k])

    def waiting(self, k: int) -> int:
        return self.in_flight[k] - self.running(k)

    def score(self, k: int) -> float:
        return WAITING_WEIGHT * self.waiting(k) + self.running(k)

    @property
    def num_running(self) -> int:
        return sum(self.running(k) for k in range(self.num_engines))

    # ---- routing ----
    def assign(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Pick the replica for a new request and count it there."""
        hashes = self._block_hashes(prompt_token_ids) if self.prefix_affinity else []
        with self._lock:
            live = [k for k in range(self.num_engines) if k not in self.dead]
            if not live:
                raise RuntimeError("every data parallel replica is dead")
            start = next(self._next)          # round-robin among equals
            order = sorted(live, key=lambda k: (k - start) % self.num_engines)
            best = min(order, key=lambda k: self.score(k) - PREFIX_BLOCK_WEIGHT * self._matched(k, hashes))
            self.owner[request_id] = best
            self.in_flight[best] += 1
            self.assigned_total[best] += 1
            self._remember(best, hashes)
            return best

    def owner_of(self, request_id: str) -> int | None:
        return self.owner.get(request_id)

    def forget(self, request_ids) -> dict[int, list[str]]:
        """Requests that ended or were aborted; returns them grouped by replica."""
        by_engine: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                k = self.owner.pop(rid, None)
                if k is not None:
                    self.in_flight[k] -= 1
                    by_engine.setdefault(k, []).append(rid)
        return by_engine

    def on_outputs(self, k: int, outputs: EngineCoreOutputs) -> None:
        self.reported_running[k] = outputs.num_running
        done = [o.req_id for o in outputs.outputs if o.finish_reason is not None]
        if done:
            self.forget(done)

    def mark_dead(self, k: int, reason: str) -> list[str]:
        """Take replica k out of routing; returns the requests it was serving."""
        with self._lock:
            self.dead[k] = reason
            lost = [rid for rid, owner in self.owner.items() if owner == k]
        self.forget(lost)
        return lost

    def revive(self, engines) -> None:
        """These replicas serve again (started anew: empty, their prefix cache too)."""
        with self._lock:
            for k in engines:
                self.dead.pop(k, None)
                self.reported_running[k] = 0
                self._prefixes[k].clear()

    # ---- prefix affinity ----
    def _block_hashes(self, token_ids: list[int]) -> list[int]:
        bs, out, h = self.block_size, [], 0
        for i in range(min(len(token_ids) // bs, _PREFIX_BLOCKS_LOOKED_AT)):
            h = hash((h, *token_ids[i * bs:(i + 1) * bs]))
            out.append(h)
        return out

    def _matched(self, k: int, hashes: list[int]) -> int:
        seen, n = self._prefixes[k], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def _remember(self, k: int, hashes: list[int]) -> None:
        seen = self._prefixes[k]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > _PREFIX_BLOCKS_TRACKED:
            seen.popitem(last=False)

    def stats(self) -> list[dict]:
        return [{"engine": k, "in_flight": self.in_flight[k], "assigned_total": self.assigned_total[k],
                 "dead": self.dead.get(k)} for k in range(self.num_engines)]


def combine_utility(method: str, results: dict[int, object]) -> object:
    """One answer from the live replicas' answers to a utility call (replica -> its answer)."""
    if method == "collective_rpc":             # one result per rank, in world-rank order
        return [r for _, per_engine in sorted(results.items()) for r in per_engine]
    if method == "reset_prefix_cache":
        return all(results.values())
    if method in ("sleep", "wake_up"):
        return None
    if method == "is_sleeping":
        return any(results.values())
    if method == "stats":
        return combine_stats([{**s, "engine": k} for k, s in sorted(results.items())])
    raise ValueError(f"no way to combine {method!r} across replicas")


def combine_stats(per_engine: list[dict]) -> dict:
    """The totals over replicas, with each replica's own stats under "engines"."""
    total = {key: sum(s[key] for s in per_engine)
             for key in ("num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
                         "num_preemptions", "num_aborted", "prompt_tokens", "generation_tokens",
                         "iteration_tokens_sum")}
    total["iteration_buckets"] = [sum(c) for c in zip(*(s["iteration_buckets"] for s in per_engine))]
    total["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in per_engine) / len(per_engine)
    queries = total["prefix_cache_queries"]
    total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
    if "max_lora" in per_engine[0]:               # LoRA: the adapters in use on any replica
        total["max_lora"] = per_engine[0]["max_lora"]
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            total[key] = sorted({name for s in per_engine for name in s[key]})
    if "spec_num_drafts" in per_engine[0]:        # speculative decoding counters: summed
        total.update(SpecDecodingStats.total([SpecDecodingStats.from_dict(s) for s in per_engine]).as_dict())
    if "expert_load" in per_engine[0]:            # tokens per expert, per MoE layer: summed over replicas
        total["expert_load"] = {layer: [sum(c) for c in zip(*(s["expert_load"][layer] for s in per_engine))]
                                for layer in per_engine[0]["expert_load"]}
    total["engines"] = per_engine
    return total

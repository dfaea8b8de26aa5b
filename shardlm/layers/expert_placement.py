"""Where experts go under expert parallel load balancing (EPLB, vLLM's --enable-eplb).

The EP group has E + R physical expert slots, (E + R) / N on each of its N ranks (rank r holds
slots r*S .. r*S + S - 1). Each slot holds one logical expert; a hot expert gets several (the R
redundant slots), and a token routed to it goes to one of them (its token index decides, so the
copies share the expert's tokens evenly). The placement comes from the tokens each expert got
over a window of recent steps, as DeepSeek's EPLB does it: the R copies go one at a time to the
expert with the most tokens per copy, then the copies, heaviest first, each to the least loaded
rank with a free slot (a rank holds at most one copy of an expert while another rank has room).
Balancedness: mean over max of the tokens per rank (1: even).
"""

from __future__ import annotations


def place_experts(load: list[float], num_ranks: int, num_redundant: int) -> list[int]:
    """-> the logical expert of each physical slot, rank by rank."""
    num_experts = len(load)
    per_rank = (num_experts + num_redundant) // num_ranks
    copies = [1] * num_experts
    for _ in range(num_redundant):
        hottest = max(range(num_experts), key=lambda e: (load[e] / copies[e], -e))
        copies[hottest] += 1
    pieces = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                    key=lambda p: (-p[0], p[1]))
    rank_load, slots = [0.0] * num_ranks, [[] for _ in range(num_ranks)]
    for weight, expert in pieces:
        free = [r for r in range(num_ranks) if len(slots[r]) < per_rank]
        fresh = [r for r in free if expert not in slots[r]] or free
        rank = min(fresh, key=lambda r: (rank_load[r], r))
        slots[rank].append(expert)
        rank_load[rank] += weight
    return [e for rank_slots in slots for e in sorted(rank_slots)]


def balancedness(load: list[float], placement: list[int], num_ranks: int) -> float:
    """Mean over max of the tokens per rank with this placement (a copy takes its share)."""
    copies = {e: placement.count(e) for e in set(placement)}
    per_rank = len(placement) // num_ranks
    totals = [sum(load[e] / copies[e] for e in placement[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]
    return sum(totals) / num_ranks / max(totals) if max(totals) > 0 else 1.0


def default_placement(num_experts: int, num_redundant: int) -> list[int]:
    """Before any load is known: expert e at slot e, the redundant slots copies of the first R."""
    return list(range(num_experts)) + [e % num_experts for e in range(num_redundant)]

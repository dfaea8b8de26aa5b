"""Where experts go under expert parallel load balancing (EPLB, vLLM's --enable-eplb).

The EP group has E + R physical expert slots, (E + R) / N on each of its N ranks (rank r holds
slots r*S .. r*S + S - 1). Each slot holds one logical expert; a hot expert gets several (the R
redundant slots), and a token routed to it goes to one of them (its token index decides, so the
copies share the expert's tokens evenly). The placement comes from the tokens each expert got
over a window of recent steps, as DeepSeek's EPLB does it: the R copies go one at a time to the
expert with the most tokens per copy, then the copies, heaviest first, each to the least loaded
rank with a free slot (a rank holds at most one copy of an expert while another rank has room).
Balancedness: mean over max of the tokens per rank (1: even).

Where the EP group spans several nodes and the model routes by expert groups (DeepSeek's n_group,
each token's experts drawn from its topk_group best groups), placement is hierarchical, as
DeepSeek's EPLB does it: whole groups go to nodes first (heaviest first, to the least loaded node
with room), then each node places its groups' experts and its share of the redundant slots on its
own ranks as above. A token's experts then sit on few nodes, and a copy never crosses a node.
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


def place_experts_hierarchical(load: list[float], num_ranks: int, num_redundant: int, num_groups: int,
                               num_nodes: int) -> list[int]:
    """place_experts with whole expert groups per node (ranks node by node, num_ranks / num_nodes
    each); the flat placement where groups, ranks or redundant slots do not divide among the nodes."""
    num_experts = len(load)
    if (num_nodes <= 1 or num_groups % num_nodes or num_experts % num_groups or num_ranks % num_nodes
            or num_redundant % num_nodes):
        return place_experts(load, num_ranks, num_redundant)
    size = num_experts // num_groups
    group_load = [sum(load[g * size:(g + 1) * size]) for g in range(num_groups)]
    node_load, node_groups = [0.0] * num_nodes, [[] for _ in range(num_nodes)]
    for g in sorted(range(num_groups), key=lambda g: (-group_load[g], g)):
        node = min((n for n in range(num_nodes) if len(node_groups[n]) < num_groups // num_nodes),
                   key=lambda n: (node_load[n], n))
        node_groups[node].append(g)
        node_load[node] += group_load[g]
    placement = []
    for groups in node_groups:
        experts = [e for g in sorted(groups) for e in range(g * size, (g + 1) * size)]
        local = place_experts([load[e] for e in experts], num_ranks // num_nodes, num_redundant // num_nodes)
        placement += [experts[i] for i in local]
    return placement


def balancedness(load: list[float], placement: list[int], num_ranks: int) -> float:
    """Mean over max of the tokens per rank with this placement (a copy takes its share)."""
    copies = {e: placement.count(e) for e in set(placement)}
    per_rank = len(placement) // num_ranks
    totals = [sum(load[e] / copies[e] for e in placement[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]
    return sum(totals) / num_ranks / max(totals) if max(totals) > 0 else 1.0


def default_placement(num_experts: int, num_redundant: int) -> list[int]:
    """Before any load is known: expert e at slot e, the redundant slots copies of the first R."""
    return list(range(num_experts)) + [e % num_experts for e in range(num_redundant)]

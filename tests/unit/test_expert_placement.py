"""EPLB's placement (layers/expert_placement.py): every slot filled, every expert placed, hot
experts copied, and the ranks' loads evened out; over several nodes, whole expert groups per node."""

import random

from shardlm.distributed.parallel_state import nodes_in_runs
from shardlm.layers.expert_placement import balancedness, default_placement, place_experts, place_experts_hierarchical


def test_two_hot_experts_on_one_rank_are_split_and_copied():
    load = [100.0, 90.0, 5.0, 5.0]
    start = default_placement(4, 0)                    # experts 0, 1 on rank 0: it does nearly all
    assert balancedness(load, start, 2) < 0.6
    moved = place_experts(load, 2, 0)
    assert sorted(moved) == [0, 1, 2, 3] and set(moved[:2]) != {0, 1}
    assert balancedness(load, moved, 2) > 0.9
    copied = place_experts(load, 2, 2)                 # 6 slots: the two hot ones twice, one per rank
    assert len(copied) == 6 and copied.count(0) == 2 and copied.count(1) == 2
    assert {0, 1} <= set(copied[:3]) and {0, 1} <= set(copied[3:])
    assert balancedness(load, copied, 2) > 0.95


def test_random_loads_keep_every_expert_and_stay_within_one_piece_of_even():
    """Greedy packing's bound: no rank carries more than the mean plus the heaviest copy's share."""
    rng = random.Random(0)
    for _ in range(200):
        experts, ranks = rng.choice([(8, 2), (8, 4), (16, 4), (6, 3)])
        redundant = rng.choice([0, ranks, 2 * ranks])
        load = [rng.expovariate(1.0) * (20 if rng.random() < 0.2 else 1) for _ in range(experts)]
        placed = place_experts(load, ranks, redundant)
        assert len(placed) == experts + redundant and set(placed) == set(range(experts))
        share = [load[e] / placed.count(e) for e in range(experts)]
        per_rank = len(placed) // ranks
        totals = [sum(share[e] for e in placed[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
        assert max(totals) <= sum(load) / ranks + max(share) + 1e-9


def test_over_several_nodes_each_keeps_whole_expert_groups_and_its_own_copies():
    """Hierarchical placement (DeepSeek's EPLB): 32 experts in 8 groups over 8 ranks on 2 nodes,
    8 redundant slots; two hot groups land on different nodes and every copy stays on its node."""
    rng = random.Random(1)
    load = [rng.random() * (30 if e // 4 in (1, 2) else 1) for e in range(32)]
    placed = place_experts_hierarchical(load, num_ranks=8, num_redundant=8, num_groups=8, num_nodes=2)
    assert len(placed) == 40 and set(placed) == set(range(32))
    nodes = [placed[:20], placed[20:]]                      # 4 ranks of 5 slots each
    groups = [{e // 4 for e in node} for node in nodes]
    assert len(groups[0]) == len(groups[1]) == 4 and not groups[0] & groups[1]
    assert all(sorted(e for e in node if e // 4 == g) == sorted(e for e in placed if e // 4 == g)
               for node, node_groups in zip(nodes, groups) for g in node_groups)   # copies too
    assert ({1, 2} & groups[0]) and ({1, 2} & groups[1])     # the hot groups split between the nodes
    assert balancedness(load, placed, 8) > 0.7 > balancedness(load, default_placement(32, 8), 8)


def test_groups_or_ranks_that_do_not_divide_among_the_nodes_place_flat():
    load = [float(e % 5 + 1) for e in range(12)]
    assert place_experts_hierarchical(load, 6, 0, 3, 2) == place_experts(load, 6, 0)      # 3 groups, 2 nodes
    assert place_experts_hierarchical(load, 6, 0, 4, 1) == place_experts(load, 6, 0)      # one node


def test_a_group_spans_as_many_nodes_as_runs_of_hosts():
    assert nodes_in_runs(["a", "a", "b", "b"]) == 2
    assert nodes_in_runs(["a", "b", "a", "b"]) == 1         # interleaved: not node by node
    assert nodes_in_runs(["a", "a", "a", "b"]) == 1         # unequal
    assert nodes_in_runs(["a", "a"]) == 1

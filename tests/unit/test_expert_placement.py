"""EPLB's placement (layers/expert_placement.py): every slot filled, every expert placed, hot
experts copied, and the ranks' loads evened out."""

import random

from shardlm.layers.expert_placement import balancedness, default_placement, place_experts


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

"""Expert parallel load balancing (EPLB) on a worker: counts the tokens each expert of this
rank's MoE layers got in each forward pass, and every step_interval passes places the experts
anew (layers/expert_placement.py) from the last window_size passes, the counts summed over the EP
group so every rank places alike, and moves the weights (FusedMoE.rebalance). Every rank of an EP
group runs the same forward passes (DP + EP replicas in lock-step, dummy passes included), so
they all rebalance at the same pass, between two steps: no request waits for more than that."""

from __future__ import annotations

from collections import deque

import torch

from shardlm.config import EPLBConfig
from shardlm.distributed.parallel_state import get_ep_group
from shardlm.layers.moe import FusedMoE
from shardlm.logger import init_logger

logger = init_logger(__name__)


class ExpertBalancer:
    def __init__(self, moe_layers: dict[int, FusedMoE], config: EPLBConfig):
        self.layers, self.config = moe_layers, config
        self.group = get_ep_group()
        # several nodes: each keeps whole expert groups (layers/expert_placement.py)
        self.num_nodes = self.group.node_count()
        if self.num_nodes > 1 and self.group.rank_in_group == 0:
            logger.info("EPLB: the EP group spans %d nodes; experts are placed hierarchically (whole expert groups "
                        "per node, where the model routes by groups and they divide among the nodes)", self.num_nodes)
        self.window: deque[torch.Tensor] = deque(maxlen=config.window_size)
        self.counted = self._counts()
        self.passes = self.rebalances = 0
        self.balancedness: tuple[float, float] | None = None     # before and after the last placement
        self.first_balancedness: float | None = None               # before the first one (the start's)

    def _counts(self) -> torch.Tensor:
        return torch.stack([m.expert_load for m in self.layers.values()])

    def after_forward(self) -> None:
        counts = self._counts()
        self.window.append(counts - self.counted)
        self.counted = counts
        self.passes += 1
        if self.passes % self.config.step_interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        load = self.group.all_reduce(torch.stack(list(self.window)).sum(dim=0).double())
        results = [moe.rebalance(layer_load.tolist(), self.num_nodes)
                   for moe, layer_load in zip(self.layers.values(), load)]
        before, after = (sum(r[i] for r in results) / len(results) for i in (0, 1))
        moved = sum(1 for b, a in results if a != b)
        self.rebalances += 1
        self.balancedness = (before, after)
        if self.first_balancedness is None:
            self.first_balancedness = before
        if self.group.rank_in_group == 0 and (moved or self.config.log_balancedness):
            logger.info("EPLB: experts of %d of %d MoE layers placed anew after %d forward passes; balancedness "
                        "(mean/max tokens per EP rank, last %d passes) %.3f -> %.3f", moved, len(results), self.passes,
                        len(self.window), before, after)

    def state(self) -> dict:
        before, after = self.balancedness or (None, None)
        return {"rebalances": self.rebalances, "balancedness_at_start": self.first_balancedness,
                "balancedness_before": before, "balancedness_after": after}

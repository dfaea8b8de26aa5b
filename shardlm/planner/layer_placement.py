"""Which pipeline stage holds which decoder layers: the one rule the planner, the engine and the
workers all follow."""

from __future__ import annotations

from shardlm.planner.model_shape import ModelShape


def pp_layer_partition(num_layers: int, pp: int, explicit: list[int] | None = None,
                       head_layers: float = 0.0) -> list[tuple[int, int]]:
    """(start, end) layer range of each pipeline stage.

    By default the stages' work is balanced: the last stage also runs the LM head, which costs
    `head_layers` decoder layers per token (ModelShape.lm_head_layers), so it gets that many
    layers fewer; the others split the rest evenly, the remainder to the first stages. With
    head_layers 0 this is the even split (the remainder to the stages before the last one).
    """
    if explicit is not None:
        if len(explicit) != pp or sum(explicit) != num_layers or min(explicit) < 1:
            raise ValueError(f"The layer partition {explicit} must have {pp} entries of at least 1 layer "
                             f"summing to {num_layers} (it has {len(explicit)} summing to {sum(explicit)}).")
        sizes = list(explicit)
    else:
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {num_layers} layers.")
        sizes = _balanced_sizes(num_layers, pp, head_layers)
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n))
        start += n
    return ranges


def _balanced_sizes(num_layers: int, pp: int, head_layers: float) -> list[int]:
    """Layers per stage making the busiest stage least busy, then the idlest the least idle, then
    the last stage the smallest."""
    def sizes(last: int) -> list[int]:
        base, extra = divmod(num_layers - last, pp - 1)
        return [base + (1 if i < extra else 0) for i in range(pp - 1)] + [last]

    def work(last: int) -> tuple[float, float]:
        costs = sizes(last)[:-1] + [last + head_layers]
        return max(costs), -min(costs)
    return [num_layers] if pp == 1 else sizes(min(range(1, num_layers - pp + 2), key=work))


def stage_layers(model, parallel) -> list[tuple[int, int]]:
    """The layer ranges of this engine's pipeline stages (ModelConfig, ParallelConfig): the
    explicit --pp-layer-partition, else balanced with the LM head counted on the last stage.
    Everything that places layers asks here, so workers and the engine agree."""
    head = ModelShape.from_config("model", model.hf_config.to_dict()).lm_head_layers()
    return pp_layer_partition(model.num_layers, parallel.pipeline_parallel_size, parallel.pp_layer_partition, head)


def describe_partition(ranges: list[tuple[int, int]]) -> str:
    """'stage 0: layers 0-15 (embed), stage 1: layers 16-29 (norm, lm_head)'"""
    parts = []
    for stage, (start, end) in enumerate(ranges):
        holds = (["embed"] if stage == 0 else []) + (["norm", "lm_head"] if stage == len(ranges) - 1 else [])
        parts.append(f"stage {stage}: layers {start}-{end - 1}" + (f" ({', '.join(holds)})" if holds else ""))
    return ", ".join(parts)

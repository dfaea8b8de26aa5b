"""Small helpers for distributed layouts."""

from __future__ import annotations


def pp_layer_partition(num_layers: int, pp: int, explicit: list[int] | None = None) -> list[tuple[int, int]]:
    """(start, end) layer range of each pipeline stage.

    Even split by default; the remainder goes to the stages before the last one (the last
    stage also carries the final norm and the LM head), first stage first.
    """
    if explicit is not None:
        if len(explicit) != pp or sum(explicit) != num_layers or min(explicit) < 1:
            raise ValueError(f"The layer partition {explicit} must have {pp} entries of at least 1 layer "
                             f"summing to {num_layers} (it has {len(explicit)} summing to {sum(explicit)}).")
        sizes = list(explicit)
    else:
        if pp > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {num_layers} layers.")
        base, extra = divmod(num_layers, pp)
        sizes = [base + (1 if i < extra and i < pp - 1 else 0) for i in range(pp)]
        sizes[-1] += num_layers - sum(sizes)
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n))
        start += n
    return ranges


def describe_partition(ranges: list[tuple[int, int]]) -> str:
    """'stage 0: layers 0-15 (embed), stage 1: layers 16-29 (norm, lm_head)'"""
    parts = []
    for stage, (start, end) in enumerate(ranges):
        holds = (["embed"] if stage == 0 else []) + (["norm", "lm_head"] if stage == len(ranges) - 1 else [])
        parts.append(f"stage {stage}: layers {start}-{end - 1}" + (f" ({', '.join(holds)})" if holds else ""))
    return ", ".join(parts)

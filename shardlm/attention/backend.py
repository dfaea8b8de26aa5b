"""The attention backend interface: how one step's attention metadata is built and how a
layer attends with it. One backend is chosen per engine (selector.py) and shared by every
layer; the model code never branches on the device.

A backend owns three decisions:
  - the KV cache layout (kv_cache_shape), since kernels want different ones;
  - the metadata of a step (build_metadata), built once per step from the scheduled chunks
    and read by every layer;
  - the attention itself (forward): write this step's K/V into the cache, attend; optionally
    with the rotary embedding fused in (rotary_and_attend, CPU decode steps).
A backend that can be captured in a CUDA graph keeps its metadata in preallocated device
tensors and says so (supports_graph_capture); worker/cuda_graphs.py captures its decode steps.

A model whose KV cache is in several groups (kv_cache_groups.py: sliding-window layers apart)
has one backend and one metadata per group, passed to the model as KVGroupsMetadata; each
layer reads its group's (metadata_of).

Under context parallel the runner gives the backend this rank's ContextShard
(context_parallel.py) and a sink slot for the positions other ranks own; the layer then calls
forward_partial (output and log-sum-exp over this rank's positions) instead of forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from shardlm.attention.context_parallel import ContextShard


class AttentionBackend(ABC):
    name: str = "?"
    supports_graph_capture: bool = False

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.shard: ContextShard | None = None    # context parallel: this rank's positions
        self.sink_slot = 0                         # ... and where the others' K/V are written (never read)

    def kv_cache_shape(self, num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) cache. Default: head-major [Hkv, num_blocks, block_size, D]."""
        return (num_kv_heads, num_blocks, self.block_size, head_dim)

    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src[i] to dst[i] of one layer's K or V cache (in kv_cache_shape's layout)."""
        cache.index_copy_(1, dst, cache.index_select(1, src))

    @abstractmethod
    def build_metadata(self, query_lens: list[int], start_positions: list[int],
                       block_tables: list[list[int]], pcp=None) -> Any:
        """One step's metadata: sequence i computes query_lens[i] tokens from start_positions[i],
        its context in the blocks block_tables[i]. pcp: under prefill context parallel, the
        ContextParallelStep (torch_paged.py) of this rank."""

    def build_rows_metadata(self, start_positions: list[int], block_tables: list[list[int]],
                            prompt: list[bool]) -> Any | None:
        """The metadata of some of a step's rows attended on their own (the model's last layer
        finishing only the rows whose logits are needed: LastLayerRows): one query each, at
        start_positions[i]; a row that ends a prompt chunk (prompt[i]) attended by the kernel
        that attends prompt chunks, the others as decodes, so each row's numbers are those it
        has among the whole step's. None: this backend cannot (the last layer finishes every row)."""
        return None

    def write_kv(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None:
        """Writes k, v [T, Hkv, D] of the step's tokens into the layer's cache, attending nothing
        (backends whose build_rows_metadata gives metadata)."""
        raise NotImplementedError(f"the {self.name} attention backend cannot write K/V alone")

    @abstractmethod
    def forward(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """layer: the calling layers.attention.Attention (its heads, scale and KV cache).
        q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H * D]. Writes k, v into the layer's cache first."""

    @abstractmethod
    def forward_partial(self, layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the k, v this rank owns, attends q [T, Hq, D] over this rank's positions -> (output
        [T, Hq, D] float32, log-sum-exp [T, Hq] float32). Context parallel (q: the cp group's
        gathered queries), and layers with attention sinks (layers/attention.py)."""

    def rotary_and_attend(self, layer: nn.Module, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                          meta: Any) -> torch.Tensor | None:
        """A fused path for a whole step, where the backend has one: from the fresh projection
        qkv [T, (H + 2 Hkv) * D], the rotary embedding on q and k, K/V into the cache, attention
        -> [T, H * D]. None: the layer does those steps itself, then calls forward."""
        return None

    def prepare_graph_capture(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """Allocate what a captured decode step reads (backends with supports_graph_capture)."""


class LastLayerRows:
    """The rows the model's last layer finishes when no one reads the others' final hidden states
    (model_runner: _last_layer_rows): every row's K/V goes into the cache, and only these rows
    attend (meta: build_rows_metadata's) and go on through the rest of the layer."""
    __slots__ = ("rows", "meta")

    def __init__(self, rows: torch.Tensor, meta: Any):
        self.rows, self.meta = rows, meta


class KVGroupsMetadata:
    """One step's attention metadata per KV cache group."""
    __slots__ = ("per_group",)

    def __init__(self, per_group: list):
        self.per_group = per_group


def metadata_of(layer: nn.Module, meta):
    """The metadata `layer` attends with: its KV cache group's, where there are several."""
    return meta.per_group[layer.kv_group] if isinstance(meta, KVGroupsMetadata) else meta

"""Decode steps replayed from CUDA graphs (what vLLM's --enforce-eager turns off).

A decode step of a small model on a GPU is mostly launch overhead: the GPU's kernels are a
small part of it, the rest is Python and the launch path of some 600 kernels a step. A captured
graph replays a step's kernels in one launch.

A graph reads fixed addresses with fixed shapes. The attention metadata already lives in the
CUDA backend's preallocated buffers (attention/cuda.py); token ids and positions are copied into
buffers held here. Shapes are padded to buckets: the batch to 1, 2, 4, then multiples of 8; the
blocks per sequence to a power of two. Each (batch, blocks) bucket gets its graph at its first
use, all graphs sharing one memory pool. Padding rows write their K/V into block 0 (the null
block, never read unmasked) and attend to one position of it.

Graphs apply where a decode step is this rank's whole model with nothing decided on the host
inside: one GPU per replica (TP = PP = 1), dense unquantized layers (MoE routing and the
quantized paths choose shapes on the host), no DP lock-step. Elsewhere steps run eagerly.
"""

from __future__ import annotations

import torch

from shardlm.attention.cuda import CudaAttention, CudaDecodeMetadata
from shardlm.logger import init_logger

logger = init_logger(__name__)

MAX_CAPTURED_BATCH = 512


def batch_bucket(n: int) -> int:
    """The padded batch size of a decode step of n sequences: 1, 2, 4, then multiples of 8."""
    return n if n <= 2 else 4 if n <= 4 else -(-n // 8) * 8


def blocks_bucket(n: int, max_blocks: int) -> int:
    """The padded blocks per sequence: the next power of two, at most max_blocks."""
    return min(1 << max(0, n - 1).bit_length(), max_blocks)


def graphs_unavailable_reason(runner) -> str | None:
    """Why this runner's decode steps cannot be captured, or None when they can."""
    if not isinstance(runner.attn_backend, CudaAttention):
        return "not a CUDA device"
    if runner.config.model.pooler is not None:
        return "a pooling model (its steps are whole prompts, never decodes)"
    if runner.tp.world_size > 1 or runner.pp.world_size > 1:
        return "tensor or pipeline parallel (collectives inside the step)"
    if runner.dp_lockstep:
        return "data parallel lock-step"
    if runner.moe_layers():
        return "mixture-of-experts layers"
    if any(getattr(m, "quant", None) is not None for m in runner.model.modules()):
        return "quantized layers"
    if runner.kv_groups.num_groups > 1:
        return "sliding-window layers keep their own block tables (--disable-hybrid-kv-cache-manager: captured)"
    if runner.lora is not None:
        return "LoRA adapters"
    if runner.config.model.model_impl == "transformers":
        return "the Transformers backend runs transformers' modeling code as it is"
    if getattr(runner.model.model, "aux_layers", ()):
        return "an EAGLE-3 head reads the hidden states of inner layers"
    return None


class CudaGraphs:
    def __init__(self, model: torch.nn.Module, backend: CudaAttention):
        self.model, self.backend = model, backend
        self.max_batch = min(backend.max_num_seqs, MAX_CAPTURED_BATCH)
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=backend.device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=backend.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.steps = 0          # decode steps replayed from a graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """The step's final hidden states from a graph; None for a step that is not a decode step
        of at most max_batch sequences (the caller runs it eagerly)."""
        if not isinstance(meta, CudaDecodeMetadata) or len(input_ids) > self.max_batch:
            return None
        B, N = meta.block_table.shape
        padded_b, padded_n = batch_bucket(B), blocks_bucket(N, self.backend.max_blocks)
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.input_ids[B:padded_b].zero_()
        self.positions[B:padded_b].zero_()
        meta = self.backend.padded_decode_metadata(B, padded_b, N, padded_n)
        key = (padded_b, padded_n)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded_b, meta)
        graph, hidden = self.graphs[key]
        graph.replay()
        self.steps += 1
        return hidden[:B]

    def _capture(self, batch: int, meta) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self.input_ids[:batch], self.positions[:batch]
        # one eager run first, on a side stream as torch asks (lazy initialisations happen
        # outside the capture); it computes this step's K/V, which the replay writes again
        side = torch.cuda.Stream(self.backend.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model(ids, pos, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden = self.model(ids, pos, meta)
        if self.pool is None:
            self.pool = graph.pool()
        logger.debug("Captured a CUDA graph for decode steps of %d sequences x %d blocks", batch,
                     meta.block_table.shape[1])
        return graph, hidden

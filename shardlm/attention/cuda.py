"""The CUDA attention backend: torch scaled-dot-product attention over the paged cache, with
the metadata of decode steps in preallocated device tensors.

Decode steps (one query per sequence) are the ones worth capturing in a CUDA graph, and a
captured graph reads fixed addresses: so their slot mapping, block tables and context lengths
are copied each step into buffers allocated once (prepare_graph_capture, sized by
max_num_seqs and max_model_len), and the masks are derived from them on the device. Steps
with prompt chunks use the torch path's per-step metadata (they are not captured).

FlashAttention / FlashInfer kernels would slot in here (their paged layouts differ:
kv_cache_shape is the backend's to choose); they are not used yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.attention.torch_paged import TorchPagedAttention, decode_attention, widened, write_slots


@dataclass
class CudaDecodeMetadata:
    """Views of the preallocated buffers for this step's B sequences and N blocks each."""
    slot_mapping: torch.Tensor   # [B]
    block_table: torch.Tensor    # [B, N] int64
    context_lens: torch.Tensor   # [B] int64
    positions: torch.Tensor      # [N * block_size] 0, 1, 2, ... (a view of one arange)


class CudaAttention(TorchPagedAttention):
    name = "cuda-sdpa"
    supports_graph_capture = True

    def __init__(self, block_size: int, device: torch.device, max_num_seqs: int, max_model_len: int):
        super().__init__(block_size, device)
        self.prepare_graph_capture(max_num_seqs, -(-max_model_len // block_size))

    def prepare_graph_capture(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        dev = self.device
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks_per_seq
        self.slot_mapping = torch.zeros(max_num_seqs, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(max_num_seqs, dtype=torch.long, device=dev)
        self.positions = torch.arange(max_blocks_per_seq * self.block_size, device=dev)
        # staging on the host, pinned so the copies run asynchronously
        self._host = torch.zeros(max_num_seqs, 2 + max_blocks_per_seq, dtype=torch.long, pin_memory=True)
        self._copied = torch.cuda.Event()        # the last step's copies out of _host are done
        self._copied.record()

    def build_metadata(self, query_lens, start_positions, block_tables, pcp=None):
        B = len(query_lens)
        if B > self.max_num_seqs or any(q != 1 for q in query_lens) or self.shard is not None:
            return super().build_metadata(query_lens, start_positions, block_tables, pcp)
        N = max(len(t) for t in block_tables)
        bs = self.block_size
        rows = [[t[p // bs] * bs + p % bs, p + 1, *t, *[0] * (N - len(t))]     # slot, context, blocks (0: null)
                for p, t in zip(start_positions, block_tables)]
        self._copied.synchronize()                   # the previous step may still be reading _host
        host = self._host[:B, :2 + N]
        host.copy_(torch.tensor(rows, dtype=torch.long))
        self.slot_mapping[:B].copy_(host[:, 0], non_blocking=True)
        self.context_lens[:B].copy_(host[:, 1], non_blocking=True)
        self.block_tables[:B, :N].copy_(host[:, 2:2 + N], non_blocking=True)
        self._copied.record()
        return CudaDecodeMetadata(self.slot_mapping[:B], self.block_tables[:B, :N], self.context_lens[:B],
                                  self.positions[:N * self.block_size])

    def padded_decode_metadata(self, num_seqs: int, padded_seqs: int, num_blocks: int,
                               padded_blocks: int) -> CudaDecodeMetadata:
        """This step's decode metadata (build_metadata ran, num_blocks wide) widened to fixed bucket
        shapes for a captured graph: rows past num_seqs write to slot 0 of the null block and attend
        to it; columns past num_blocks lie beyond every context length, so they are masked, but they
        are still read: they name the null block, not what an earlier step left there (a draft
        model's scratch blocks lie past the target's cache)."""
        self.slot_mapping[num_seqs:padded_seqs].zero_()
        self.context_lens[num_seqs:padded_seqs].fill_(1)
        self.block_tables[num_seqs:padded_seqs].zero_()
        self.block_tables[:num_seqs, num_blocks:padded_blocks].zero_()
        return CudaDecodeMetadata(self.slot_mapping[:padded_seqs], self.block_tables[:padded_seqs, :padded_blocks],
                                  self.context_lens[:padded_seqs], self.positions[:padded_blocks * self.block_size])

    def forward(self, layer, q, k, v, meta):
        if not isinstance(meta, CudaDecodeMetadata):
            return super().forward(layer, q, k, v, meta)
        return self._decode(layer, q, k, v, meta).view(q.shape[0], -1)

    def forward_partial(self, layer, q, k, v, meta):
        """(out float32, log-sum-exp) for a layer with sinks, on the preallocated decode metadata too."""
        if not isinstance(meta, CudaDecodeMetadata):
            return super().forward_partial(layer, q, k, v, meta)
        return self._decode(layer, q, k, v, meta, with_lse=True)

    def _decode(self, layer, q, k, v, meta: CudaDecodeMetadata, with_lse: bool = False):
        Hkv, D = layer.num_kv_heads, layer.head_dim
        write_slots(layer.k_cache, meta.slot_mapping, k, layer.k_scale)
        if not layer.values_in_keys:
            write_slots(layer.v_cache, meta.slot_mapping, v, layer.v_scale)
        B, N = meta.block_table.shape
        blocks = meta.block_table.flatten()
        kb = widened(layer.k_cache.index_select(1, blocks).view(Hkv, B, -1, D), q.dtype, layer.k_scale)
        vb = (kb[..., :layer.v_head_dim] if layer.values_in_keys
              else widened(layer.v_cache.index_select(1, blocks).view(Hkv, B, -1, D), q.dtype, layer.v_scale))
        masked_out = meta.positions[None, :] >= meta.context_lens[:, None]
        if layer.sliding_window is not None:       # the query is at context_lens - 1
            masked_out |= meta.positions[None, :] < meta.context_lens[:, None] - layer.sliding_window
        masked_out = masked_out.view(1, B, 1, -1)
        return decode_attention(layer, q, kb, vb, masked_out, with_lse=with_lse)

"""KV cache groups: how a model whose layers mix sliding-window and full attention keeps only
the KV its layers read (what vLLM's hybrid KV cache manager does).

A layer with a window of W reads the W - 1 positions before each query and no older ones, so
the blocks wholly before that can go back to the pool. The layers are split into groups of
one kind each (full attention, or one window size); each group has its own block table per
request, and a window group's table names the null block where its blocks were freed.

All groups draw from one pool of block ids. Every group has at most `layers_per_block` layers,
and a block id's memory is that many layers' worth: layer j of each group (on each pipeline
stage) reads and writes the same tensor, at the block ids its group owns. So a block freed by
a window group can be taken by any group, and the capacity follows what requests really hold.
Each kind of layer is dealt to its groups in turn (layer i of a kind to group i mod n), so the
groups spread over the depth and every pipeline stage needs about the same tensors.

A model with one kind of layer and no window shorter than max_model_len is one group: the
engine as it was, with nothing to free. (Imports nothing of shardlm: the config plans the groups.)
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sliding_window(config, layer_idx: int) -> int | None:
    """The attention window of a layer, as transformers reads the config: config.layer_types names
    the layers with "sliding_attention" (Qwen2, SmolLM3, Gemma 2/3, GPT-OSS); without it, every
    layer has config.sliding_window where one is set (Mistral v0.1) and not switched off."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    return window if types is None or types[layer_idx] == "sliding_attention" else None


@dataclass(frozen=True)
class KVCacheGroups:
    windows: tuple[int | None, ...]          # per group: its layers' window (None: full attention)
    layers: tuple[tuple[int, ...], ...]      # per group: its decoder layers, in order

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_block(self) -> int:
        """Layers a block id holds memory for: the largest group."""
        return max(len(g) for g in self.layers)

    def group_of_layer(self, layer_idx: int) -> int:
        for g, layers in enumerate(self.layers):
            if layer_idx in layers:
                return g
        raise ValueError(f"Layer {layer_idx} is in no KV cache group.")

    def first_kept_block(self, group: int, first_query_pos: int, block_size: int) -> int:
        """The first block a group still reads when the earliest query to come is at
        first_query_pos: a window of W reaches back to first_query_pos - W + 1; blocks before it
        can be freed (a full-attention group keeps them all: 0)."""
        window = self.windows[group]
        return 0 if window is None else max(0, first_query_pos - window + 1) // block_size

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """The most block ids one request of up to num_tokens holds across the groups while it
        computes `chunk` tokens at a time (1: decoding). A window group holds the window's
        W - 1 positions before the chunk and the chunk's: W + chunk - 1 positions, which straddle
        one more block than they fill unless they start at a block's first position."""
        total = cdiv(num_tokens, block_size)
        return sum(total if w is None else min(total, cdiv(w + chunk - 2, block_size) + 1) for w in self.windows)

    def max_tokens(self, num_blocks: int, block_size: int, chunk: int = 1) -> int:
        """The longest request num_blocks block ids hold (blocks_held's inverse)."""
        lo, hi = 0, num_blocks * block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_held(mid, block_size, min(chunk, mid)) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tokens_held(self, num_blocks: int, block_size: int, max_model_len: int) -> int:
        """The context num_blocks block ids hold: every position of their tokens with full attention
        alone; with windows, that of as many requests of max_model_len as fit while decoding."""
        if self.windows == (None,):
            return num_blocks * block_size
        return int(num_blocks / self.blocks_held(max_model_len, block_size) * max_model_len)

    def describe(self) -> str:
        kinds: dict = {}
        for window, layers in zip(self.windows, self.layers):
            kinds.setdefault(window, []).append(len(layers))
        parts = [f"{len(sizes)} {'full attention' if w is None else f'sliding window {w}'}"
                 for w, sizes in kinds.items()]
        plural = "s" if self.num_groups > 1 else ""
        return f"{self.num_groups} group{plural} of up to {self.layers_per_block} layers ({', '.join(parts)})"


def one_group(num_layers: int) -> KVCacheGroups:
    return KVCacheGroups((None,), (tuple(range(num_layers)),))


def plan_kv_cache_groups(windows: list[int | None], max_model_len: int) -> KVCacheGroups:
    """The groups for layers with these windows (None: full attention). Windows that cover
    max_model_len count as full attention: they never free anything."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(None if w is None or w >= max_model_len else w, []).append(i)
    if list(kinds) == [None]:
        return one_group(len(windows))
    per_group = min(len(layers) for layers in kinds.values())
    group_windows, group_layers = [], []
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):     # full attention first
        layers = kinds[window]
        n = cdiv(len(layers), per_group)
        for j in range(n):
            group_windows.append(window)
            group_layers.append(tuple(layers[j::n]))
    return KVCacheGroups(tuple(group_windows), tuple(group_layers))

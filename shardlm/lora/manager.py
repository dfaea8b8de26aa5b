"""A worker's LoRA adapters: read from disk (or the hub) into a CPU cache of max_cpu_loras, and
swapped into the device slots (max_loras) of its layers when a step needs them.

Every rank of a replica sees the same steps, so all make the same choices; each holds its own
slice (tensor parallel) of its own layers (pipeline parallel). The scheduler never puts more
than max_loras adapters in a step, so the step's adapters always fit in the slots.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch

from shardlm.config import LoRAConfig
from shardlm.logger import init_logger
from shardlm.lora.layers import LoRASlots
from shardlm.lora.peft import LoRAAdapter, read_lora_request
from shardlm.lora.request import LoRARequest

logger = init_logger(__name__)

_ADAPTED = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.qkv_proj|self_attn\.o_proj|mlp\.gate_up_proj|"
                      r"mlp\.down_proj)$")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, hf_config, dtype: torch.dtype,
                 device: torch.device, download_dir: str | None = None):
        """download_dir: where adapters named by hub id are fetched (None: the hub's cache)."""
        from shardlm.layers.linear import Linear
        self.config, self.hf_config, self.download_dir = config, hf_config, download_dir
        # the Transformers backend: adapters name its own modules; shardlm's models: merged ones
        self.own_modules = model.lora_modules() if hasattr(model, "lora_modules") else None
        adapted = (self.own_modules.linears if self.own_modules is not None else
                   {name: m for name, m in model.named_modules() if _ADAPTED.match(name) and isinstance(m, Linear)})
        self.layers: dict[str, LoRASlots] = {}          # module name -> its slots
        for name, module in adapted.items():
            module.lora = LoRASlots(module, config.max_loras, config.max_lora_rank, dtype, device)
            self.layers[name] = module.lora
        self.requests: dict[int, LoRARequest] = {}          # every adapter named to this worker, by id
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()     # least recently used first
        self.slots: list[int | None] = [None] * config.max_loras    # the adapter id in each slot
        self.unreadable: dict[int, str] = {}       # adapters the last step could not read: why
        self._slot_order: OrderedDict[int, None] = OrderedDict()    # slots by last use
        logger.info("LoRA: %d slots of rank %d in %d layers (%.1f MiB)", config.max_loras, config.max_lora_rank,
                    len(self.layers), sum(s.nbytes() for s in self.layers.values()) / 2**20)

    # ---- adapters named, added, removed ----
    def register(self, request: LoRARequest) -> None:
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self._forget(request.lora_int_id)     # the id now names another adapter
        self.requests[request.lora_int_id] = request

    def add_lora(self, request: LoRARequest) -> bool:
        """Read the adapter into the CPU cache ahead of its first request."""
        self.register(request)
        self._adapter(request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter's weights from memory. Its name and path stay known: a request still
        running on it (the server unloads an adapter while its last requests finish) reads it again."""
        held = lora_id in self.cpu or lora_id in self.slots
        self._forget(lora_id)
        return held

    def list_loras(self) -> list[int]:
        return sorted(self.cpu)

    def _forget(self, lora_id: int) -> None:
        self.cpu.pop(lora_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot] = None
                for layer in self.layers.values():
                    layer.clear(slot)

    # ---- one step ----
    def slots_of(self, lora_ids: list[int]) -> list[int]:
        """Each chunk's slot (lora_ids: each chunk's adapter, 0 = base -> -1), with every adapter
        of the step swapped into a slot."""
        needed = {i for i in lora_ids if i}
        self.unreadable, slot_of = {}, {}
        for lora_id in sorted(needed):
            try:
                slot_of[lora_id] = self._slot(lora_id, needed)
            except (OSError, ValueError) as e:     # its files are gone or spoilt since it was checked
                self.unreadable[lora_id] = f"LoRA adapter {self.requests[lora_id].lora_name!r} could not be read: {e}"
                slot_of[lora_id] = -1     # its rows run on the base model (every rank alike); its requests fail
        return [slot_of[i] if i else -1 for i in lora_ids]

    def failed_requests(self, lora_ids: dict[str, int]) -> dict[str, str]:
        """Of these requests (id -> adapter id), those whose adapter this step could not read: why."""
        return {rid: self.unreadable[i] for rid, i in lora_ids.items() if i in self.unreadable}

    def _slot(self, lora_id: int, needed: set[int]) -> int:
        """The slot holding `lora_id`, swapping it in from the CPU cache (into a free slot, else the
        least recently used one no adapter of this step holds)."""
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None]
            victims = free or [s for s in self._slot_order if self.slots[s] not in needed]
            if not victims:
                raise RuntimeError(f"A step has more than max_loras={self.config.max_loras} adapters; the scheduler "
                                   "bounds them, so this is a bug in shardlm.")
            slot = victims[0]
            adapter = self._adapter(lora_id)
            for key, layer in self.layers.items():
                parts = adapter.weights.get(key)
                if parts:
                    layer.set(slot, parts)
                else:
                    layer.clear(slot)
            self.slots[slot] = lora_id
        self._slot_order.pop(slot, None)
        self._slot_order[slot] = None
        return slot

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        """The adapter from the CPU cache, read (this rank's layers only) where it is not there."""
        if lora_id in self.cpu:
            self.cpu.move_to_end(lora_id)
            return self.cpu[lora_id]
        request = self.requests.get(lora_id)
        if request is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} was never named to this worker; a bug in shardlm.")
        adapter = read_lora_request(request, self.hf_config, self.config.max_lora_rank, self.download_dir,
                                    self.own_modules)
        adapter.weights = {key: parts for key, parts in adapter.weights.items() if key in self.layers}
        while len(self.cpu) >= self.config.max_cpu_loras:
            evicted, _ = self.cpu.popitem(last=False)
            logger.debug("LoRA adapter %d left the CPU cache (max_cpu_loras=%d)", evicted, self.config.max_cpu_loras)
        self.cpu[lora_id] = adapter
        return adapter

"""LoRARequest: the adapter a request runs with, as vLLM names it. It crosses process boundaries
with the request (msgspec), so it holds only names: each process resolves lora_path itself (a
directory, or a hub id fetched into that node's cache)."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int           # unique per adapter while the engine runs; 0 is the base model
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id={self.lora_int_id!r} must be an integer "
                             ">= 1 (0 stands for the base model).")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r} needs lora_path: a PEFT adapter directory or hub id.")

    @property
    def cache_salt(self) -> bytes:
        """Mixed into the prefix-cache keys of its requests: KV computed under one adapter is
        never reused under another, nor by the base model."""
        return f"lora:{self.lora_int_id}:{self.lora_name}".encode()

"""The server's LoRA adapters: the names a request's `model` may give, each with its LoRARequest.

`--lora-modules name=path` (or vLLM's JSON form, '{"name": ..., "path": ..., "base_model_name": ...}')
names them at start-up; with SHARDLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's opt-in, as
VLLM_ALLOW_RUNTIME_LORA_UPDATING) POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and
remove them while the server runs. Ids are given out in order and never reused, so KV cached under
an unloaded adapter can never serve another one of the same name.
"""

from __future__ import annotations

import itertools
import json

from shardlm.lora.request import LoRARequest


def parse_lora_module(text: str) -> LoRARequest:
    """One --lora-modules value: name=path, or a JSON object with name and path (and base_model_name)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or not spec.get("name") or not spec.get("path"):
            raise ValueError(f"--lora-modules {text!r}: the JSON form needs \"name\" and \"path\".")
        return LoRARequest(spec["name"], 1, spec["path"], spec.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: write name=path (or the JSON form "
                         "'{\"name\": ..., \"path\": ...}').")
    return LoRARequest(name, 1, path)


class LoRAModules:
    """Adapter names -> LoRARequests, with ids given out in order."""

    def __init__(self, base_model: str):
        self.base_model = base_model
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """A LoRARequest for an adapter not yet served (ValueError if the name is taken)."""
        if name in self.adapters or name == self.base_model:
            raise ValueError(f"The name {name!r} is already served; unload it first or choose another name.")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def add(self, request: LoRARequest) -> None:
        if request.lora_name in self.adapters:        # two loads of one name at once: the first one wins
            raise ValueError(f"The name {request.lora_name!r} is already served; unload it first or choose another "
                             "name.")
        self.adapters[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)

    def cards(self, max_model_len: int) -> list[dict]:
        """/v1/models entries of the adapters, their base model as parent (as vLLM lists them)."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "shardlm", "root": r.lora_path,
                 "parent": r.base_model_name or self.base_model, "max_model_len": max_model_len}
                for name, r in self.adapters.items()]

"""LoRA adapters served beside their base model (vLLM's --enable-lora).

    request.py   LoRARequest: which adapter a request runs with
    peft.py      reading and checking a PEFT adapter (adapter_config.json + safetensors)
    layers.py    a linear layer's adapter slots and the per-step grouped product
    batch.py     which tokens of a step run on which slot
    manager.py   a worker's adapters: a CPU cache (max_cpu_loras) and device slots (max_loras)

The delta x A^T B^T (B scaled by alpha / r) is added to the base layer's output, per adapter group
of the step's tokens; weights are never merged, so base and adapter requests share a step.
"""

from shardlm.lora.request import LoRARequest

__all__ = ["LoRARequest"]

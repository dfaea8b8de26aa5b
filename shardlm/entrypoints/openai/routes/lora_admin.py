"""Loading and unloading LoRA adapters at run time (vLLM's routes; mounted only where
SHARDLM_ALLOW_RUNTIME_LORA_UPDATING is set, as VLLM_ALLOW_RUNTIME_LORA_UPDATING does there)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from shardlm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, OpenAIError, UnloadLoRAAdapterRequest
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, state: ServerState = Depends(server_state)):
    if state.llm.config.lora is None:
        raise OpenAIError("LoRA is off: start the server with --enable-lora.", 400, "lora_name")
    loras = state.serving.loras
    try:
        lora = loras.new(req.lora_name, req.lora_path, req.base_model_name)
        await state.llm.add_lora(lora)
        loras.add(lora)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "lora_path") from e
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, state: ServerState = Depends(server_state)):
    lora = state.serving.loras.remove(req.lora_name)
    if lora is None:
        raise OpenAIError(f"The LoRA adapter '{req.lora_name}' is not loaded.", 404, "lora_name", "NotFoundError")
    await state.llm.remove_lora(lora.lora_int_id)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

"""/tokenize and /detokenize, as vLLM serves them."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from shardlm.entrypoints.openai import tools
from shardlm.entrypoints.openai.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from shardlm.entrypoints.openai.serving import check_encodable
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: ServerState = Depends(server_state)):
    serving = state.serving
    serving.check_model(req.model)
    serving.need_tokenizer("/tokenize", "prompt")
    tok = state.llm.tokenizer
    if req.messages is not None:
        text = serving.render_chat(req.messages, tools.template_tools(req), req.add_generation_prompt,
                                   req.chat_template_kwargs)
        ids = tok(text, add_special_tokens=False).input_ids
    elif req.prompt is not None:
        check_encodable(req.prompt, "prompt")
        ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
    else:
        raise OpenAIError("Give a prompt or messages.", 400, "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: ServerState = Depends(server_state)):
    state.serving.check_model(req.model)
    state.serving.need_tokenizer("/detokenize", "tokens")
    llm = state.llm
    bad = [t for t in req.tokens if not 0 <= t < llm.config.model.vocab_size]
    if bad:
        raise OpenAIError(f"Token ids {bad[:5]} are outside the vocabulary.", 400, "tokens")
    return {"prompt": llm.tokenizer.decode(req.tokens)}

"""/tokenize, /detokenize and (with --enable-tokenizer-info-endpoint) /tokenizer_info, as vLLM serves them."""

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
    if req.messages is not None:       # as the chat route gives them to the engine (images' placeholders expanded)
        text = serving.render_chat(req.messages, tools.template_tools(req), req.add_generation_prompt,
                                   req.chat_template_kwargs)
        ids, _ = await serving.chat_tokens(req, text, add_special_tokens=False)
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


@router.get("/tokenizer_info")
async def tokenizer_info(state: ServerState = Depends(server_state)):
    """The tokenizer's configuration (its files' paths left out), class and chat template."""
    serving = state.serving
    if not serving.options.enable_tokenizer_info_endpoint:
        raise OpenAIError("/tokenizer_info is off: start the server with --enable-tokenizer-info-endpoint.", 404,
                          type_="NotFoundError")
    serving.need_tokenizer("/tokenizer_info", "tokenizer")
    tok = state.llm.tokenizer
    info = {k: _json_safe(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    template = serving.chat_template or getattr(tok, "chat_template", None)
    return {**info, "tokenizer_class": type(tok).__name__, **({"chat_template": template} if template else {})}


def _json_safe(value):
    """Added tokens as their text; containers through; anything else JSON cannot hold as its str()."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)

"""Prompts with given embeddings, for the server: a chat's images (image_url parts) for a
vision-language model, read, then through the model's processor with the rendered conversation;
and /v1/completions' prompt_embeds (multimodal/). Every fault is the client's: a 400."""

from __future__ import annotations

import asyncio

from shardlm.entrypoints.openai.protocol import OpenAIError
from shardlm.multimodal.media import load_image


def image_placeholder(llm) -> str | None:
    """The text that marks an image for the model's chat template (None: a text model)."""
    return llm.processor.given_embeddings.images.placeholder if llm.config.model.multimodal is not None else None


async def with_images(llm, req, text: str, pool, add_special_tokens: bool) -> tuple[list[int], list]:
    """-> the rendered chat's token ids, each image's placeholder expanded, and its images' items.
    Images are fetched on threads of their own (a slow URL holds no one else's tokenizing)."""
    urls = [url for m in req.messages for url in m.image_urls()]
    try:
        processor = llm.processor.given_embeddings.images            # a text model: ValueError
        if getattr(req, "use_beam_search", False):
            raise ValueError("Beam search is not run on prompts with images: leave out use_beam_search.")
        mm = llm.config.model.multimodal
        images = await asyncio.gather(*(asyncio.to_thread(load_image, url, mm) for url in urls))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: processor.process(text, list(images), add_special_tokens))
    except ValueError as e:
        raise OpenAIError(str(e), 400, "messages") from None


def embeds_prompts(req, model) -> list[tuple[list[int], object]]:
    """/v1/completions' prompt_embeds -> per prompt (its placeholder token ids, its tensor), checked
    (the input processor makes its item)."""
    from shardlm.multimodal.prompt_embeds import PLACEHOLDER_ID, checked, decode_base64
    values = [req.prompt_embeds] if isinstance(req.prompt_embeds, str) else list(req.prompt_embeds)
    try:
        if not model.enable_prompt_embeds:
            raise ValueError("prompt_embeds need a server started with --enable-prompt-embeds.")
        for field, given in (("echo", req.echo), ("use_beam_search", req.use_beam_search),
                             ("prompt_logprobs", req.prompt_logprobs is not None),
                             ("truncate_prompt_tokens", req.truncate_prompt_tokens is not None)):
            if given:
                raise ValueError(f"{field} needs the prompt's tokens, which prompt_embeds do not have: leave it out.")
        tensors = [checked(decode_base64(v), model.hf_config.hidden_size) for v in values]
        return [([PLACEHOLDER_ID] * len(t), t) for t in tensors]
    except ValueError as e:
        raise OpenAIError(str(e), 400, "prompt_embeds") from None

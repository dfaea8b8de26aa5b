"""A prompt's given embeddings, read by the front end's input processor (engine/processor.py):
images (vLLM's multi_modal_data, or this engine's chat paths' items) through the model's
processor, and prompt embeddings (--enable-prompt-embeds). Each becomes the token ids the engine
schedules and the items (messages.MultiModalItem) that carry the embeddings' source to the workers."""

from __future__ import annotations

from shardlm.config import EngineConfig
from shardlm.messages import MultiModalItem
from shardlm.sampling_params import SamplingParams


class GivenEmbeddings:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self._images = None            # a vision-language model's processor, made at first use

    @staticmethod
    def given(prompt) -> bool:
        return isinstance(prompt, dict) and any(k in prompt for k in ("prompt_embeds", "multi_modal_data", "mm_items"))

    def read(self, prompt: dict, text: str | None, ids: list[int] | None,
             params) -> tuple[list[int], list[MultiModalItem]]:
        """-> the prompt's token ids and its items."""
        if "prompt_embeds" in prompt:
            return self._prompt_embeds(prompt, params)
        return self._images_of(prompt, text, ids)

    @property
    def images(self):
        """The model's image processor (multimodal/processing.py): a ValueError for a text model."""
        mm = self.config.model.multimodal
        if mm is None:
            from shardlm.models.registry import TEXT_MODEL_OF_MULTIMODAL
            what = ("runs as its text model here (its images are not read)"
                    if self.config.model.architecture in TEXT_MODEL_OF_MULTIMODAL else "is a text model")
            raise ValueError(f"{self.config.model.served_model_name} {what}: it takes no images. Serve a "
                             "vision-language model (LLaVA-1.5, LLaVA-NeXT, Idefics3 / SmolVLM) for prompts with "
                             "images.")
        if self._images is None:
            if self.tokenizer is None:
                raise ValueError("A prompt with images needs the tokenizer, and this engine runs without one "
                                 "(--skip-tokenizer-init).")
            from shardlm.multimodal.processing import ImagePrompts
            self._images = ImagePrompts(self.config.model)
        return self._images

    def _prompt_embeds(self, prompt: dict, params) -> tuple[list[int], list]:
        """vLLM's {"prompt_embeds": tensor [tokens, hidden]} -> (placeholder ids, its one item)."""
        m = self.config.model
        if not m.enable_prompt_embeds:
            raise ValueError("Prompts as embeddings (prompt_embeds) need --enable-prompt-embeds "
                             "(LLM(..., enable_prompt_embeds=True)).")
        if set(prompt) - {"prompt_embeds", "cache_salt"}:
            raise ValueError(f"A prompt_embeds prompt takes no {sorted(set(prompt) - {'prompt_embeds', 'cache_salt'})}:"
                             " its embeddings are the whole prompt.")
        if isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need the prompt's tokens, which a prompt_embeds prompt does not have.")
        from shardlm.multimodal.prompt_embeds import prompt_embeds_item
        ids, item = prompt_embeds_item(prompt["prompt_embeds"], m.hf_config.hidden_size, m.dtype)
        return ids, [item]

    def _images_of(self, prompt: dict, text: str | None, ids: list[int] | None):
        """A prompt dict's images: vLLM's "multi_modal_data" ({"image": a PIL image or a list}) with
        its text, which marks each image with the model's placeholder; or, from this engine's own
        chat paths, token ids already expanded with their "mm_items". -> (token ids, items)."""
        if "mm_items" in prompt:
            self.images    # (a text model refuses)
            items = list(prompt["mm_items"])
            check_items(items, ids, self.config.model.multimodal)
            return ids, items
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"multi_modal_data takes images: {{\"image\": image or [images]}}, not "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}.")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
        if not isinstance(text, str):
            raise ValueError("A prompt with images needs its text (\"prompt\"), which marks where each image goes: "
                             f"{self.images.placeholder!r} once per image.")
        from shardlm.multimodal.media import as_images
        images = as_images(images, self.config.model.multimodal)
        options = prompt.get("mm_processor_kwargs")
        if options is not None and not isinstance(options, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict of the processor's options, not {options!r}.")
        return self.images.process(text, images, options=options)


def check_items(items: list, ids: list[int] | None, mm) -> None:
    """Prepared image items fit their token ids: in order, inside the prompt, each range starting
    and ending on the image placeholder token, no more than --limit-mm-per-prompt allows."""
    if ids is None:
        raise ValueError("Image items come with the prompt's token ids (prompt_token_ids).")
    if len(items) > mm.limit("image"):
        raise ValueError(f"The prompt has {len(items)} images; at most {mm.limit('image')} are allowed "
                         "(--limit-mm-per-prompt).")
    end = 0
    for item in items:
        last = item.offset + item.length - 1
        if item.offset < end or last >= len(ids) or ids[item.offset] != mm.image_token_id or \
                ids[last] != mm.image_token_id:
            raise ValueError(f"An image's placeholder range {item.offset}..{last} does not fit the prompt's tokens.")
        end = item.offset + item.length

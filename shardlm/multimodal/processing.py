"""A prompt's images through the checkpoint's Hugging Face processor: the token ids with each
image's placeholder expanded to one token per embedding, and one MultiModalItem per image."""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

from shardlm.config import ModelConfig
from shardlm.messages import MultiModalItem, TensorData


@functools.lru_cache(maxsize=4)
def load_processor(path: str, trust_remote_code: bool):
    """The checkpoint's HF processor, read once per process (the tokenizer's chat template and the
    image prompts both ask for it)."""
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)


class ImagePrompts:
    def __init__(self, model: ModelConfig):
        self.mm = model.multimodal
        self.processor = load_processor(model.tokenizer, model.trust_remote_code)
        self.placeholder: str = self.processor.image_token      # what a prompt's text marks an image with

    def process(self, text: str, images: list, add_special_tokens: bool = True,
                options: dict | None = None) -> tuple[list[int], list[MultiModalItem]]:
        """-> the prompt's token ids and its images' items. The text marks each image with the
        model's placeholder (LLaVA's "<image>"), one per image, in order. options: the processor's,
        over --mm-processor-kwargs."""
        options = {**self.mm.processor_kwargs, **(options or {})}
        limit = self.mm.limit("image")
        if len(images) > limit:
            raise ValueError(f"The prompt has {len(images)} images; at most {limit} are allowed "
                             "(--limit-mm-per-prompt '{\"image\": N}').")
        marks = text.count(self.placeholder)
        if marks != len(images):
            raise ValueError(f"The prompt marks {marks} image(s) with {self.placeholder!r} but has {len(images)} "
                             f"image(s): put one {self.placeholder!r} where each image goes.")
        try:
            out = self.processor(text=[text], images=images or None, add_special_tokens=add_special_tokens, **options)
            alone = [self._alone(im, options) for im in images]       # each image's own tensors and token count
        except TypeError as e:          # an option the processor does not take
            raise ValueError(f"The model's processor refused its options {options}: {e}") from None
        ids = list(out["input_ids"][0])
        items = []
        for (start, end), (tensors, _) in zip(self._ranges(ids, [n for _, n in alone]), alone):
            items.append(MultiModalItem("image", start, end - start, content_hash(tensors), tensors))
        return ids, items

    def _alone(self, image, options: dict) -> tuple[dict[str, TensorData], int]:
        """One image through the processor by itself: the model's inputs for it (a batch of one:
        LLaVA-NeXT's tiles and size, Idefics3's tiles and their masks) and its placeholder count."""
        out = self.processor(text=[self.placeholder], images=[image], return_tensors="pt", **options)
        tensors = {k: as_tensor_data(v) for k, v in out.items()
                   if k not in ("input_ids", "attention_mask", "token_type_ids") and isinstance(v, torch.Tensor)}
        return tensors, out["input_ids"][0].tolist().count(self.mm.image_token_id)

    def _ranges(self, ids: list[int], counts: list[int]) -> list[tuple[int, int]]:
        """Each image's placeholder positions, first to last: its counts[i] image tokens in turn
        (tokens between an image's tiles or rows lie inside its range and keep their own embeddings)."""
        positions = [p for p, t in enumerate(ids) if t == self.mm.image_token_id]
        if len(positions) != sum(counts):
            raise ValueError(f"The processor gave {len(positions)} image tokens for images of {sum(counts)}: the "
                             "prompt's text holds image placeholder tokens of its own; remove them.")
        ranges, at = [], 0
        for n in counts:
            ranges.append((positions[at], positions[at + n - 1] + 1))
            at += n
        return ranges


def processor_chat_template(model: ModelConfig) -> str | None:
    """The checkpoint's processor's chat template (llava-hf's keep it in chat_template.json, which
    the tokenizer does not read), which places images as the model was trained to see them."""
    return getattr(load_processor(model.tokenizer, model.trust_remote_code), "chat_template", None)


def as_tensor_data(t: torch.Tensor) -> TensorData:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:           # numpy has no bfloat16: its bits as int16
        return TensorData(list(t.shape), "bfloat16", t.view(torch.int16).numpy().tobytes())
    return TensorData(list(t.shape), str(t.dtype).removeprefix("torch."), t.numpy().tobytes())


def as_tensor(d: TensorData) -> torch.Tensor:
    if d.dtype == "bfloat16":
        return torch.from_numpy(np.frombuffer(d.data, dtype=np.int16).copy()).view(torch.bfloat16).reshape(d.shape)
    return torch.from_numpy(np.frombuffer(d.data, dtype=np.dtype(d.dtype)).copy()).reshape(d.shape)


def content_hash(tensors: dict[str, TensorData]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        d = tensors[name]
        h.update(f"{name}:{d.dtype}:{d.shape}".encode())
        h.update(d.data)
    return h.hexdigest()

"""Offline chats with images (LLM.chat): OpenAI's image_url parts, or vLLM's image_pil parts,
taken out of the messages in order, each left as the chat template takes an image."""

from __future__ import annotations


def split_images(messages: list[dict], content_format: str, placeholder: str) -> tuple[list[dict], list]:
    """-> the messages as the template takes them (OpenAI parts with {"type": "image"}, or for a
    template that reads content as a string, each image's placeholder on a line before the text),
    and the images in order: URLs (image_url) or PIL images (image_pil)."""
    rendered, images = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "image_url":
                url = part["image_url"]
                images.append(url["url"] if isinstance(url, dict) else url)
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(part["image_pil"])
                parts.append({"type": "image"})
            else:
                parts.append(part)
        if content_format == "string":
            texts = "".join(p.get("text", "") for p in parts if p["type"] != "image")
            parts = "".join(f"{placeholder}\n" for p in parts if p["type"] == "image") + texts
        rendered.append({**message, "content": parts})
    return rendered, images

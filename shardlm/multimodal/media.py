"""Images from where OpenAI's image_url parts say they are: a data: URL (base64), an http(s): URL
(fetched), or a file: URL under --allowed-local-media-path (else refused, as vLLM does)."""

from __future__ import annotations

import base64
import binascii
import io
import os
from urllib.parse import unquote, urlparse

FETCH_TIMEOUT_S = 10.0
MAX_IMAGE_BYTES = 64 << 20


class MediaError(ValueError):
    """An image that could not be read: the client's fault (a 400 in the server)."""


def load_image(url: str, mm=None):
    """A PIL image, RGB, from an image_url's url; mm: the MultiModalConfig whose
    --allowed-local-media-path and --allowed-media-domains apply."""
    if not isinstance(url, str) or not url:
        raise MediaError("An image_url part needs a url: a data:image/...;base64, URL, an http(s) URL or a file URL.")
    scheme = urlparse(url).scheme
    if scheme == "data":
        data = _data_url_bytes(url)
    elif scheme in ("http", "https"):
        data = _fetch(url, getattr(mm, "allowed_media_domains", None))
    elif scheme == "file":
        data = _local_file(url, getattr(mm, "allowed_local_media_path", None))
    else:
        raise MediaError(f"Image URL scheme {scheme or '(none)'!r}: give a data:, http(s): or file: URL.")
    return decode_image(data)


def as_images(given: list, mm=None) -> list:
    """Images given as PIL images or URLs (read with load_image) -> the images."""
    return [load_image(image, mm) if isinstance(image, str) else image for image in given]


def decode_image(data: bytes):
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise MediaError(f"The image could not be decoded ({e}): send a PNG, JPEG, WebP, GIF or BMP image.") from None
    return image.convert("RGB")


def _data_url_bytes(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise MediaError("A data URL image must be base64: data:image/png;base64,....")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("The data URL's base64 payload does not decode.") from None


def _fetch(url: str, domains: list[str] | None) -> bytes:
    """domains: the hosts images may come from (None: any); with them no redirect is followed."""
    import httpx
    host = (urlparse(url).hostname or "").lower()
    if domains is not None and host not in domains:
        raise MediaError(f"Images are fetched from {', '.join(domains) or 'no host'} only (--allowed-media-domains), "
                         f"not {host or url}.")
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=domains is None) as response:
            response.raise_for_status()
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > MAX_IMAGE_BYTES:
                    raise MediaError(f"The image at {url} is larger than {MAX_IMAGE_BYTES >> 20} MiB.")
            return bytes(data)
    except httpx.HTTPError as e:
        raise MediaError(f"The image at {url} could not be fetched ({type(e).__name__}: {e}).") from None


def _local_file(url: str, allowed: str | None) -> bytes:
    if not allowed:
        raise MediaError("file: image URLs are read only under --allowed-local-media-path: start the server with it, "
                         "or send the image as a data: URL.")
    path = os.path.realpath(unquote(urlparse(url).path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise MediaError(f"{path} is outside --allowed-local-media-path {allowed}.")
    try:
        with open(path, "rb") as f:
            return f.read(MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise MediaError(f"The image file {path} could not be read ({e.strerror}).") from None

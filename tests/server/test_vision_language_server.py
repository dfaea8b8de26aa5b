"""A vision-language model served: chats with image_url parts through the official openai client
give transformers' tokens, streamed or not, and /tokenize counts their images' tokens; a content
format of strings puts each image's placeholder before the text; bad images are a 400 that says
why, and the server goes on; a pooling server embeds chats with images."""

import httpx
import openai
import pytest

from tests.helpers import server_in_this_process
from tests.models.test_vision_language import data_url, image, transformers_greedy


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llava"), "--dtype", "float32", "--enable-prefix-caching",
                                "--limit-mm-per-prompt", '{"image": 2}') as (_, url):
        yield url


def ask(*parts):
    return [{"role": "user", "content": list(parts)}]


def text(t):
    return {"type": "text", "text": t}


def picture(img):
    return {"type": "image_url", "image_url": {"url": data_url(img)}}


def test_a_chat_with_images_gives_transformers_tokens(server, tiny_model_dir):
    from transformers import LlavaProcessor
    path = tiny_model_dir("llava")
    images = [image(11, 50, 60), image(12)]
    hf_messages = ask(text("Compare "), {"type": "image"}, text(" and "), {"type": "image"}, text("."))
    rendered = LlavaProcessor.from_pretrained(path).apply_chat_template(hf_messages, add_generation_prompt=True)
    ((ref, _),) = transformers_greedy(path, [rendered], [images], add_special_tokens=False)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    messages = ask(text("Compare "), picture(images[0]), text(" and "), picture(images[1]), text("."))
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert answer.choices[0].token_ids == ref
    assert answer.usage.prompt_tokens > 32          # two images of 16 tokens each
    tokenized = httpx.post(server + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60).json()
    assert tokenized["count"] == answer.usage.prompt_tokens, "/tokenize expands the images' placeholders too"
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        answer.choices[0].message.content


def test_the_responses_api_reads_input_image_parts(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    image_part = {"type": "input_image", "image_url": data_url(image(11, 50, 60))}
    response = client.responses.create(model="tiny", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is "}, image_part]}])
    chat = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=ask(
        text("What is "), {"type": "image_url", "image_url": {"url": image_part["image_url"]}}))
    assert response.output_text == chat.choices[0].message.content and response.output_text


def test_images_are_fetched_from_http_urls(server):
    """An http: image_url is fetched (here from a file server on this machine): the same answer as
    the image sent inline; a URL that answers 404 is a 400 naming it."""
    import base64
    import functools
    import http.server
    import tempfile
    import threading
    folder = tempfile.mkdtemp()
    inline = data_url(image(13))
    with open(f"{folder}/pic.png", "wb") as f:
        f.write(base64.b64decode(inline.split(",")[1]))
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=folder))
    threading.Thread(target=files.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{files.server_address[1]}"
        answers = [httpx.post(server + "/v1/chat/completions", json={
            "messages": ask(text("see "), {"type": "image_url", "image_url": {"url": url}}), "max_tokens": 6,
            "temperature": 0}) for url in (f"{base}/pic.png", inline, f"{base}/missing.png")]
    finally:
        files.shutdown()
    assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"] == \
        answers[1].json()["choices"][0]["message"]
    assert answers[2].status_code == 400 and "missing.png could not be fetched" in answers[2].json()["error"]["message"]


@pytest.mark.parametrize("parts, says", [
    ((text("a"), {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}), "does not decode"),
    ((text("a"), {"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}), "scheme"),
    ((text("a"), {"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}), "--allowed-local-media-path"),
    ((picture(image(1)), picture(image(2)), picture(image(3))), "at most 2"),
    ((text("a"), {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}), "input_audio"),
])
def test_bad_images_are_a_400_that_says_why(server, parts, says):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": ask(*parts), "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    ok = httpx.post(server + "/v1/chat/completions", json={"messages": ask(text("hi")), "max_tokens": 2})
    assert ok.status_code == 200


def test_beam_search_with_images_is_refused(server):
    r = httpx.post(server + "/v1/chat/completions", json={
        "messages": ask(picture(image(1)), text("hi")), "max_tokens": 2, "use_beam_search": True, "n": 2})
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]


def test_a_string_content_format_puts_placeholders_before_the_text(tiny_model_dir):
    from shardlm.entrypoints.openai.frontend_options import as_content_format
    parts = [{"type": "text", "text": "what is "}, {"type": "image"}, {"type": "text", "text": "this"}]
    assert as_content_format(parts, "string", "<image>") == "<image>\nwhat is this"
    assert as_content_format(parts, "openai", "<image>") == parts


@pytest.mark.slow
def test_a_pooling_server_embeds_a_chat_with_images(tiny_model_dir):
    """/v1/embeddings with vLLM's `messages` (no generation prompt, as vLLM renders them for
    embeddings): the rendered chat and its image give transformers' last hidden state, normalized;
    a text-only chat too; input and messages together are a 400."""
    import torch
    import transformers
    from transformers import LlavaProcessor
    path = tiny_model_dir("llava")
    processor = LlavaProcessor.from_pretrained(path)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    chats = [(ask(picture(image(21)), text("What is this?")), ask({"type": "image"}, text("What is this?")),
              [image(21)]), (ask(text("Plain words")), ask(text("Plain words")), None)]
    with server_in_this_process(path, "--dtype", "float32", "--runner", "pooling") as (_, url):
        for messages, hf_messages, images in chats:
            rendered = processor.apply_chat_template(hf_messages, add_generation_prompt=False)
            with torch.inference_mode():
                hidden = model.model(**processor(images=images, text=rendered, return_tensors="pt",
                                                 add_special_tokens=False)).last_hidden_state[0, -1]
            r = httpx.post(url + "/v1/embeddings", json={"model": "tiny", "messages": messages}, timeout=60)
            assert r.status_code == 200, r.text
            torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]),
                                       torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5, rtol=0)
        both = httpx.post(url + "/v1/embeddings", json={"input": "x", "messages": chats[1][0]}, timeout=60)
        assert both.status_code == 400 and "one of the two" in both.json()["error"]["message"]

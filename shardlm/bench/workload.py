"""The offline benchmark workload: a JSON file in the shared format, or a synthetic one.

File format: {"output_len": 128, "latency_prompt_index": 0,
              "prompts": [{"token_ids": [...]} or {"text": "..."}, ...]}
The name "grounded" instead of a path: input-grounded prompts (bench/grounded.py), which end
at their answer's end (EOS) within 256 tokens: decoding past it would measure whatever the
model makes up after its answer, not the answer. The name "long": prompts of 4k, 8k and 16k
random tokens, 128 new tokens each (long-context runs, e.g. decode context parallel); for a
model with fewer positions, 2k, 4k and the longest that fits (long_lengths).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_TOPICS = ["the ocean", "volcanoes", "the moon", "honeybees", "rainforests", "electricity", "the Roman Empire",
           "black holes", "photosynthesis", "the human heart", "glaciers", "the internet", "dinosaurs",
           "chess", "music theory", "bread baking"]
_TASKS = ["Explain {} to a ten-year-old.", "Write a short poem about {}.",
          "Give three surprising facts about {}.", "Summarize the history of {} in a paragraph."]


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int
    latency_prompt_index: int = 0
    source: str = "synthetic"
    ignore_eos: bool = True      # False: a request ends at EOS, before output_len

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def load_workload(path: str | None, tokenizer, num_prompts: int | None = None,
                  output_len: int | None = None, max_model_len: int | None = None) -> Workload:
    if path == "grounded":
        from shardlm.bench.grounded import TASKS
        w = Workload(chat_prompts(tokenizer, TASKS), 256, source="grounded", ignore_eos=False)
    elif path == "long":
        w = Workload(long_prompts(tokenizer, long_lengths(max_model_len, output_len or 128)), 128, source="long")
    elif path:
        with open(path) as f:
            data = json.load(f)
        prompts = [p["token_ids"] if "token_ids" in p else tokenizer(p["text"]).input_ids for p in data["prompts"]]
        w = Workload(prompts, data.get("output_len", 128), data.get("latency_prompt_index", 0), path,
                     data.get("ignore_eos", True))
    else:
        w = Workload(synthetic_prompts(tokenizer), 128)
    if num_prompts:
        w.prompts = (w.prompts * (num_prompts // len(w.prompts) + 1))[:num_prompts]
    if output_len:
        w.output_len = output_len
    return w


def long_lengths(max_model_len: int | None, output_len: int) -> tuple[int, ...]:
    """The long workload's prompt lengths: 4k, 8k and 16k where the model takes them with
    output_len tokens after; for a shorter model, 2k, 4k and the longest that fits, in thousands
    (2,048, 4,096 and 8,000 for the default model's 8,192 positions)."""
    room = (max_model_len or 1 << 30) - output_len
    fits = [n for n in (2048, 4096, 8192, 16384) if n <= room]
    if 16384 not in fits and room // 1000 * 1000 > (fits[-1] if fits else 0):
        fits.append(room // 1000 * 1000)
    return tuple(fits[-3:])


def long_prompts(tokenizer, lengths=(4096, 8192, 16384), seed: int = 0) -> list[list[int]]:
    """Random token ids (of the tokenizer's ordinary range) of each length: the same on every run."""
    import random
    rng = random.Random(seed)
    top = min(len(tokenizer), 32000)
    return [[rng.randrange(100, top) for _ in range(n)] for n in lengths]


def synthetic_prompts(tokenizer) -> list[list[int]]:
    """64 chat prompts (16 topics x 4 tasks)."""
    return chat_prompts(tokenizer, [task.format(topic) for topic in _TOPICS for task in _TASKS])


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """User messages rendered with the model's chat template if it has one, as token ids."""
    prompts = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
        else:
            prompts.append(tokenizer(text).input_ids)
    return prompts

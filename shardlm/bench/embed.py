"""`shardlm bench embed`: sentences per second of a pooling model at batch 1 (one sentence per
call, as a retrieval query arrives) and at larger batches (a corpus being indexed); with
--compare, sentence-transformers on the same sentences in the same process, so the ratio is
measured side by side. Medians over --reps."""

from __future__ import annotations

import random
import statistics
import time

_WORDS = ("the a of to and in is that for it as with was on be by this are from at or an have not they which "
          "model data search query document vector server engine token memory network index result answer "
          "question system language learning retrieval ranking embedding sentence paragraph").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """n sentences of 8 to 40 words (typical retrieval queries and passages), the same for every run."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 40))).capitalize() + "." for _ in range(n)]


def _rate(fn, texts: list[str], batch: int, reps: int) -> float:
    """Sentences per second of fn(list of texts) called on `batch` texts at a time; median of reps."""
    fn(texts[:batch])        # warm-up
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(0, len(texts), batch):
            fn(texts[i:i + batch])
        rates.append(len(texts) / (time.perf_counter() - t0))
    return statistics.median(rates)


def run_embed_bench(engine_args, batch_sizes: list[int], num_sentences: int, reps: int, compare: bool) -> dict:
    from shardlm.llm import LLM
    llm = LLM(**vars(engine_args))
    texts = sentences(num_sentences)
    config = llm.engine.config
    result = {"model": config.model.model, "dtype": str(config.model.dtype).removeprefix("torch."),
              "num_sentences": num_sentences, "shardlm": {}}
    def measured(b: int) -> list[str]:       # batch 1: a quarter of them (one call each)
        return texts[:max(b, num_sentences // 4)] if b == 1 else texts
    try:
        for b in batch_sizes:
            result["shardlm"][b] = _rate(lambda t: llm.embed(t, use_tqdm=False), measured(b), b, reps)
    finally:
        llm.shutdown()
    if compare:
        import torch
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(config.model.model, device="cpu")
        if config.model.dtype != torch.float32:
            st = st.to(config.model.dtype)
        result["sentence_transformers"] = {
            b: _rate(lambda t: st.encode(t, batch_size=b), measured(b), b, reps) for b in batch_sizes}
    return result


def report(result: dict, as_json: bool) -> None:
    if as_json:
        import json
        print(json.dumps(result, indent=1))
        return
    print(f"{result['model']} ({result['dtype']}), {result['num_sentences']} sentences of 8-40 words")
    peer = result.get("sentence_transformers")
    for b, rate in result["shardlm"].items():
        line = f"  batch {b:>4}: shardlm {rate:8.1f} sentences/s"
        if peer:
            line += f", sentence-transformers {peer[b]:8.1f} ({rate / peer[b]:.2f}x)"
        print(line)

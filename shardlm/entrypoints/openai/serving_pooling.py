"""The pooling routes' work: inputs -> pooling requests on the engine -> vLLM's response shapes.

/v1/embeddings and /pooling return each input's vector (floats, or base64 of little-endian
float32 as OpenAI's client asks by default); /classify class probabilities; /score one score per
pair; /rerank the documents by score (top_n of them). A cross-encoder reads each (query,
document) pair as one prompt; an embedding model embeds each text once and scores a pair by
cosine (pooling/scoring.py). Every input is checked before any runs: a bad one fails the whole
request with a 400 and nothing is left running."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from shardlm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from shardlm.entrypoints.openai.protocol import OpenAIError
from shardlm.entrypoints.openai.serving import OpenAIServing, check_continuation, check_encodable, last_outputs
from shardlm.lora.request import LoRARequest
from shardlm.outputs import PoolingRequestOutput
from shardlm.pooling.params import PoolingParams
from shardlm.pooling.scoring import cosine, cross_encoder_prompt, score_pairs


class PoolingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.llm = serving.llm
        self.pooler = self.llm.config.model.pooler

    # ---- routes ----
    async def embeddings(self, req: EmbeddingRequest, kind: str = "embedding"):
        model, lora = self.serving.resolve_model(req.model)
        task = getattr(req, "task", None) or "embed"
        params = self._params(req, task=task, dimensions=req.dimensions, normalize=req.normalize,
                              use_activation=getattr(req, "use_activation", None))
        if (req.input is None) == (req.messages is None):
            raise OpenAIError("Give the input or a chat's messages (one of the two).", 400, "input")
        prompts = self._inputs(req.input) if req.messages is None else [await self._chat_prompt(req)]
        outs = await self._run(prompts, params, kind, req.priority, lora)
        data = [{"index": i, "object": kind, kind if kind == "embedding" else "data":
                 _encoded(o.outputs.data, req.encoding_format)} for i, o in enumerate(outs)]
        return self._answer(model, kind, data, outs)

    async def pooling(self, req: PoolingRequest):
        return await self.embeddings(req, kind="pooling")

    async def classify(self, req: ClassificationRequest):
        model, lora = self.serving.resolve_model(req.model)
        outs = await self._run(self._inputs(req.input), self._params(req, task="classify",
                                                                     use_activation=req.use_activation), "classify",
                               req.priority, lora)
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            data.append({"index": i, "label": self._label(int(np.argmax(probs))), "probs": probs,
                         "num_classes": len(probs)})
        return self._answer(model, "classify", data, outs)

    async def score(self, req: ScoreRequest):
        model, lora = self.serving.resolve_model(req.model)
        scores, outs = await self._scores(req.text_1, req.text_2, req, lora)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return self._answer(model, "score", data, outs)

    async def rerank(self, req: RerankRequest, api_version: int | None = None):
        """api_version: Cohere's (1, 2) adds its meta; None: vLLM's and Jina's shape."""
        model, lora = self.serving.resolve_model(req.model)
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        scores, outs = await self._scores(req.query, texts, req, lora)
        ranked = sorted(range(len(texts)), key=lambda i: -scores[i])[:req.top_n or len(texts)]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in ranked]
        answer = {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                  "usage": {"total_tokens": _tokens(outs)}}
        if api_version is not None:
            answer["meta"] = {"api_version": {"version": str(api_version)}, "billed_units": {"search_units": 1}}
        return answer

    # ---- shared ----
    def _params(self, req, **fields) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, **fields)
        except ValueError as e:
            raise OpenAIError(str(e), 400, None) from e

    def _inputs(self, given) -> list[dict]:
        """An input or a batch of them -> prompts (texts or token ids), at most --max-prompts."""
        if isinstance(given, str) or (given and all(isinstance(t, int) for t in given)):
            given = [given]
        if not given:
            raise OpenAIError("The input is empty: give a text, token ids, or a list of them.", 400, "input")
        limit = self.serving.limits.max_prompts
        if len(given) > limit:
            raise OpenAIError(f"{len(given)} inputs are more than this server allows in one request ({limit}, "
                              "--max-prompts).", 400, "input")
        prompts = []
        for item in given:
            if isinstance(item, str):
                check_encodable(item, "input")
                prompts.append({"prompt": item})
            else:
                prompts.append({"prompt_token_ids": list(item)})
        return prompts

    async def _chat_prompt(self, req: EmbeddingRequest) -> dict:
        """A chat's messages as one prompt, rendered as the chat route renders them; a
        vision-language model's images read with it."""
        check_continuation(req)
        extra = {"continue_final_message": True} if req.continue_final_message else {}
        text = await self.serving.off_loop(self.serving.render_chat, req.messages, None, req.add_generation_prompt,
                                           {**extra, **(req.chat_template_kwargs or {})})
        ids, images = await self.serving.chat_tokens(req, text)
        return {"prompt": text, "prompt_token_ids": ids, **({"mm_items": images} if images else {})}

    async def _run(self, prompts: list[dict], params: PoolingParams | list[PoolingParams],
                   kind: str, priority: int = 0, lora: LoRARequest | None = None) -> list[PoolingRequestOutput]:
        if self.pooler is None:
            raise OpenAIError(f"{self.serving.model_names[0]} is a generative model: /{kind} needs a pooling model "
                              "(start the server with --runner pooling, and --convert embed for a generative "
                              "checkpoint).", 400, "model")
        rid = f"{kind}-{uuid.uuid4().hex}"
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        streams = self.serving.submit([(p, q, f"{rid}-{k}") for k, (p, q) in enumerate(zip(prompts, all_params))],
                                      lora=lora, priority=priority)
        return await last_outputs(streams)

    async def _scores(self, first, second, req, lora: LoRARequest | None
                      ) -> tuple[list[float], list[PoolingRequestOutput]]:
        try:
            pairs = score_pairs(first, second)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "text_2") from e
        if len(pairs) > self.serving.limits.max_prompts:
            raise OpenAIError(f"{len(pairs)} pairs are more than this server allows in one request "
                              f"({self.serving.limits.max_prompts}, --max-prompts).", 400, "documents")
        if self.pooler is not None and self.pooler.task == "classify":
            keep = req.truncate_prompt_tokens
            keep = self.serving.max_model_len if keep == -1 else keep
            self.serving.need_tokenizer("Scoring text pairs", "text_1")
            prompts = [cross_encoder_prompt(self.llm.tokenizer, a, b, keep) for a, b in pairs]
            outs = await self._run(prompts, self._params(req, task="score").clone(truncate_prompt_tokens=None),
                                   "score", req.priority, lora)
            return [float(o.outputs.data.flatten()[-1]) for o in outs], outs
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        outs = await self._run(self._inputs(texts), self._params(req, task="embed"), "score", req.priority, lora)
        vectors = dict(zip(texts, (o.outputs.data for o in outs)))
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], outs

    def _label(self, index: int) -> str:
        labels = getattr(self.llm.config.model.hf_config, "id2label", None) or {}
        return str(labels.get(index, labels.get(str(index), f"LABEL_{index}")))

    def _answer(self, model: str, kind: str, data: list, outs: list[PoolingRequestOutput]) -> dict:
        prefix = {"embedding": "embd", "pooling": "pool", "classify": "classify", "score": "score"}[kind]
        tokens = _tokens(outs)
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(values, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(values.numpy().astype("<f4").tobytes()).decode()
    return values.tolist()


def _tokens(outs: list[PoolingRequestOutput]) -> int:
    return sum(len(o.prompt_token_ids) for o in outs)

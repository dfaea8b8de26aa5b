"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(messages)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from shardlm import startup  # noqa: F401  (first of shardlm's: it counts the threads importing torch starts)
from shardlm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from shardlm.engine.arg_utils import VLLM_ALIASES, EngineArgs
from shardlm.engine.llm_engine import LLMEngine
from shardlm.engine.processor import require_tokenizer, split_prompt
from shardlm.lora.request import LoRARequest
from shardlm.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from shardlm.pooling.params import PoolingParams
from shardlm.pooling.scoring import cosine, cross_encoder_prompt, score_pairs
from shardlm.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """An engine in this process. `model`: a Hugging Face model directory, or None for the
    embedded default model (SmolLM2-135M-Instruct). Keyword arguments are EngineArgs fields
    (dtype, max_model_len, kv_cache_memory, enable_prefix_caching, max_num_seqs, ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        for alias, name in VLLM_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"LLM() got both {alias} and {name}, two names of one setting: give one.")
                kwargs[name] = kwargs.pop(alias)
        unknown = sorted(set(kwargs) - EngineArgs.field_names())
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(unknown)}; valid arguments: "
                            f"{', '.join(sorted(EngineArgs.field_names()))}.")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of these.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model).
        priority: one per prompt, with scheduling_policy="priority" (lower runs first)."""
        items = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, len(items), "sampling params")
        loras = _per_prompt(lora_request, len(items), "LoRA requests")
        priorities = _priorities(priority, len(items))
        ids = []
        try:
            for prompt, sp, lora, prio in zip(items, params, loras, priorities):
                rid = str(next(self._counter))
                # generate() returns whole outputs
                if isinstance(sp, SamplingParams) and sp.output_kind != RequestOutputKind.FINAL_ONLY:
                    sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(rid, prompt, sp, lora_request=lora, priority=prio)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """As vLLM's: per prompt, its best params.beam_width continuations (beam_search.py), each
        step of every prompt's beams run as one batch."""
        m = self.engine.config.model
        searches = []
        for prompt in _normalize_prompts(prompts):
            text, ids = split_prompt(prompt)
            if ids is None:
                require_tokenizer(self.get_tokenizer(), "A text prompt")
                ids = self.get_tokenizer()(text).input_ids
            searches.append(BeamSearch(ids, params, m.eos_token_ids, m.max_model_len))
        step = params.step_params()
        while live := [(search, beams) for search in searches if (beams := search.live())]:
            outputs = iter(self.generate([{"prompt_token_ids": beam.tokens} for _, beams in live for beam in beams],
                                         step, use_tqdm=False, lora_request=lora_request))
            for search, beams in live:
                search.advance([next(outputs).outputs[0].logprobs[0] for _ in beams])
        decode = self.get_tokenizer().decode if self.get_tokenizer() is not None else None
        return [search.result(decode) for search in searches]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them, through the
        chat template as vLLM's LLM.chat: continue_final_message goes on in the last message (with
        add_generation_prompt=False); tools and chat_template_kwargs reach the template."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message goes on in the last message, add_generation_prompt starts a new "
                             "one: pass add_generation_prompt=False.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        require_tokenizer(tok, "LLM.chat")
        extra = {**({"continue_final_message": True} if continue_final_message else {}), **(chat_template_kwargs or {})}
        prompts = []
        for conv in conversations:
            conv, images = self._chat_images(conv, chat_template)
            text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template, tools=tools, **extra)
            if images:
                processor = self.engine.processor.given_embeddings.images
                ids, items = processor.process(text, images, add_special_tokens=False)
                prompts.append({"prompt": text, "prompt_token_ids": ids, "mm_items": items})
            else:
                prompts.append({"prompt": text, "prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _chat_images(self, conversation: list[dict], chat_template: str | None) -> tuple[list[dict], list]:
        """A conversation's image parts taken out (PIL images, read where given as URLs)."""
        if not any(isinstance(m.get("content"), list) and any(p.get("type") in ("image_url", "image_pil")
                                                               for p in m["content"]) for m in conversation):
            return conversation, []
        from shardlm.entrypoints.openai.frontend_options import loops_over_content
        from shardlm.multimodal.chat import split_images
        from shardlm.multimodal.media import as_images
        images = self.engine.processor.given_embeddings.images         # a text model: ValueError
        template = chat_template or getattr(self.get_tokenizer(), "chat_template", None)
        fmt = "openai" if isinstance(template, str) and loops_over_content(template) else "string"
        conversation, found = split_images(conversation, fmt, images.placeholder)
        return conversation, as_images(found, self.engine.config.model.multimodal)

    # ---- pooling models (runner pooling): embeddings, classes, scores ----
    def encode(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | Sequence[PoolingParams]
               | None = None, *, pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True, priority: list[int] | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt as a tensor (outputs.data): pooling_task embed, classify,
        token_embed or token_classify (None: the model's own task). lora_request: the LoRA adapter of
        every prompt, or one per prompt (a decoder model's; None: the base model)."""
        items = _normalize_prompts(prompts)
        loras = _per_prompt(lora_request, len(items), "LoRA requests")
        given = _per_prompt(pooling_params, len(items), "pooling params")
        params = []
        for p in given:
            p = p or PoolingParams()
            if not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams, not {type(p).__name__}.")
            changes = {k: v for k, v in (("task", pooling_task), ("truncate_prompt_tokens", truncate_prompt_tokens))
                       if v is not None}
            params.append(p.clone(**changes) if changes else p)
        ids = []
        try:
            for prompt, p, prio, lora in zip(items, params, _priorities(priority, len(items)), loras):
                rid = str(next(self._counter))
                self.engine.add_request(rid, prompt, p, lora_request=lora, priority=prio)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              priority: list[int] | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (outputs.embedding)."""
        outs = self.encode(prompts, pooling_params, pooling_task="embed", truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, priority=priority, lora_request=lora_request)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
                for o in outs]

    def classify(self, prompts: Prompt | Sequence[Prompt], *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (outputs.probs) from a classification model."""
        outs = self.encode(prompts, pooling_params, pooling_task="classify",
                           truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm, priority=priority,
                           lora_request=lora_request)
        return [ClassificationRequestOutput(o.request_id, ClassificationOutput(o.outputs.data.tolist()),
                                            o.prompt_token_ids) for o in outs]

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Scores of text pairs: data_1 one text against each of data_2, or both lists pairwise. A
        cross-encoder reads each pair; an embedding model gives the cosine of their embeddings
        (lora_request: the adapter of every text)."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.engine.config.model.pooler
        params = (pooling_params or PoolingParams()).clone(truncate_prompt_tokens=truncate_prompt_tokens)
        if pooler is not None and pooler.task == "classify":
            keep = self.engine.config.model.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            tok = self.get_tokenizer()
            require_tokenizer(tok, "LLM.score of text pairs")
            outs = self.encode([cross_encoder_prompt(tok, a, b, keep) for a, b in pairs],
                               params.clone(truncate_prompt_tokens=None), pooling_task="score", use_tqdm=use_tqdm,
                               lora_request=lora_request)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data.flatten()[-1])),
                                         o.prompt_token_ids) for o in outs]
        texts = list({_key(t): t for pair in pairs for t in pair}.values())
        embedded = {_key(t): o for t, o in zip(texts, self.encode(texts, params, pooling_task="embed",
                                                                  use_tqdm=use_tqdm, lora_request=lora_request))}
        scores = []
        for a, b in pairs:
            first, second = embedded[_key(a)], embedded[_key(b)]
            scores.append(ScoringRequestOutput(f"{first.request_id}-{second.request_id}",
                                               ScoringOutput(cosine(first.outputs.data, second.outputs.data)),
                                               first.prompt_token_ids + second.prompt_token_ids))
        return scores

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start, out_tokens = time.perf_counter(), 0
        try:
            wanted = set(request_ids)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id not in wanted:    # held from an earlier call that raised
                        continue
                    done[out.request_id] = out
                    if bar is not None:
                        if isinstance(out, RequestOutput):
                            out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.set_postfix_str(f"output {out_tokens / (time.perf_counter() - start):.1f} tok/s",
                                            refresh=False)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([r for r in request_ids if r not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in request_ids]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read a LoRA adapter on every worker ahead of its first request."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Drop an adapter from the workers' memory (a later request naming it reads it again)."""
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters the workers hold read."""
        return self.engine.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """With enable_sleep_mode, as vLLM's: give back the KV cache's memory (level 1) and the
        weights' (level 2; read again from the checkpoint at wake_up), between bursts of work (an
        RL trainer's turn); cached prefixes are forgotten. No request may be running."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """The memory sleep gave back, allocated again (and the weights read again after level 2)."""
        self.engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine.sleeping

    def stats(self) -> dict:
        """The engine's figures now, as the server's /metrics reports them: running and waiting
        requests, KV cache usage and size, prefix cache queries and hits, preemptions, aborts (and
        LoRA, speculative decoding and expert-load counters where those run). With data parallel,
        totals over the replicas, each replica's own under "engines"."""
        return self.engine.stats()

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call a Worker method on every rank (as vLLM's LLM.collective_rpc); one result per rank."""
        return self.engine.collective_rpc(method, args)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _normalize_prompts(prompts) -> list:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("generate() needs at least one prompt.")
    for p in prompts:
        split_prompt(p)          # a prompt it cannot read fails before any request is added
    return list(prompts)


def _key(prompt) -> str:
    """A prompt as a dict key (a text is embedded once however often it is scored)."""
    return prompt if isinstance(prompt, str) else repr(prompt)


def _per_prompt(given, n: int, what: str) -> list:
    """One value for every prompt, or a list or tuple of one per prompt -> a list of n."""
    values = list(given) if isinstance(given, (list, tuple)) else [given] * n
    if len(values) != n:
        raise ValueError(f"Got {n} prompts but {len(values)} {what}: give one, or one per prompt.")
    return values


def _priorities(priority: list[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    priority = list(priority)
    if len(priority) != n:
        raise ValueError(f"Got {n} prompts but {len(priority)} priorities: give one per prompt.")
    return priority

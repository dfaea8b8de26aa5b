"""Input processing, shared by LLMEngine and AsyncLLM: a prompt and its SamplingParams become
engine-core requests, checked once, before anything reaches the engine core.

Tokenizes text prompts, checks the ids against the vocabulary and max_model_len, and fans a
request with n samples out into n engine-core requests (with prefix caching they share the
prompt's KV blocks; each gets its own seed, seed + i).
"""

from __future__ import annotations

import time

from shardlm.config import EngineConfig, ModelConfig
from shardlm.engine.output_processor import ParentRequest
from shardlm.logits_processor import engine_logits_processors
from shardlm.lora.peft import front_end_check
from shardlm.lora.request import LoRARequest
from shardlm.messages import EngineCoreRequest
from shardlm.multimodal.inputs import GivenEmbeddings
from shardlm.outputs import RequestMetrics
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import GENERATION_CONFIG_FIELDS, RequestOutputKind, SamplingParams
from shardlm.structured_output.grammar import GrammarCompiler

# what a request to a sleeping engine gets (--enable-sleep-mode)
SLEEPING = "The engine sleeps (--enable-sleep-mode): wake it up first (wake_up(); the server's POST /wake_up)."


def load_tokenizer(model):
    """The model's tokenizer, or None with --skip-tokenizer-init (token ids in and out only)."""
    if model.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
    if model.multimodal is not None:     # a vision-language checkpoint's chat template may be its processor's alone
        from shardlm.multimodal.processing import processor_chat_template
        tokenizer.chat_template = processor_chat_template(model) or tokenizer.chat_template
    return tokenizer


def require_tokenizer(tokenizer, what: str) -> None:
    """ValueError where `what` needs text and the engine runs without a tokenizer."""
    if tokenizer is None:
        raise ValueError(f"{what} needs the tokenizer, and this engine runs without one (--skip-tokenizer-init): send "
                         "prompts as token ids, without stop strings or structured outputs.")


def bad_word_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as it starts a text and after a space."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def cache_salt_of(prompt) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's): a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, not {salt!r}.")
    return salt


def split_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """A prompt as (text, token ids): a string, a list of token ids, or a dict with either or both."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt and "prompt" not in prompt and "prompt_embeds" not in prompt:
            raise ValueError(f"A prompt dict needs 'prompt', 'prompt_token_ids' or 'prompt_embeds'; got keys "
                             f"{sorted(prompt)}.")
        ids = prompt.get("prompt_token_ids")
        return prompt.get("prompt"), list(ids) if ids is not None else None
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise TypeError(f"Cannot read prompt {prompt!r}: use a string, a list of token ids, or a dict.")


def check_logprobs(params: SamplingParams, model: ModelConfig) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > model.logprobs_limit:
            raise ValueError(f"SamplingParams.{name}={asked}: this engine gives at most {model.logprobs_limit} per "
                             f"token (--max-logprobs {model.max_logprobs}; -1 allows the whole vocabulary).")


def check_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """The one max_tokens rule, offline and in the server (vLLM's server rule): the prompt and
    max_tokens must fit in max_model_len; None asks for the rest of the context."""
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(f"max_tokens={max_tokens} is too large: this model's maximum context length is "
                         f"{max_model_len} tokens and the prompt has {prompt_len}, which leaves room for "
                         f"{max_model_len - prompt_len} new tokens. Lower max_tokens (or leave it out for the rest "
                         "of the context), or shorten the prompt.")


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.given_embeddings = GivenEmbeddings(config, tokenizer)    # images, prompt embeds (multimodal/)
        self._grammars: GrammarCompiler | None = None     # checks constraints; made at the first one
        self._checked_loras: set[tuple[int, str]] = set()   # adapters read and found servable
        # the custom logits processors, which check each request's parameters (extra_args)
        self._logits_processors = engine_logits_processors(config)

    def default_sampling_params(self) -> SamplingParams:
        gen = self.config.model.generation_defaults
        values = {field: gen[key] for key, field in GENERATION_CONFIG_FIELDS.items() if gen.get(key) is not None}
        if gen.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def process(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                lora_request: LoRARequest | None = None,
                priority: int = 0) -> tuple[ParentRequest, list[EngineCoreRequest]]:
        """-> the request as the output processor tracks it, and its n engine-core requests.
        params: SamplingParams, or PoolingParams for a pooling model (one request, no tokens out)."""
        self.check_priority(priority)
        parent, requests = self._process(request_id, prompt, params, arrival_time, lora_request)
        for r in requests:
            r.priority = priority
        return parent, requests

    def check_priority(self, priority) -> None:
        """A request's priority is an integer, and not 0 only where the policy is priority."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise ValueError(f"priority={priority!r} must be an integer (lower runs first).")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise ValueError(f"The request has priority {priority}, but priority scheduling is off: start the engine "
                             "with --scheduling-policy priority (scheduling_policy=\"priority\").")

    def _process(self, request_id: str, prompt, params, arrival_time: float | None,
                 lora_request: LoRARequest | None) -> tuple[ParentRequest, list[EngineCoreRequest]]:
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, arrival_time, lora_request)
        if self.config.model.runner == "pooling":
            raise ValueError(f"{self.config.model.served_model_name} is a pooling model (embeddings, classes, scores): "
                             "it does not generate text. Use LLM.embed / classify / score / encode, or the server's "
                             "/v1/embeddings, /classify, /score and /rerank.")
        if lora_request is not None:
            self.check_lora(lora_request)
        text, prompt_token_ids = split_prompt(prompt)
        salt = cache_salt_of(prompt)
        mm_items = None
        if self.given_embeddings.given(prompt):
            prompt_token_ids, mm_items = self.given_embeddings.read(prompt, text, prompt_token_ids, params)
        if prompt_token_ids is None:
            if not isinstance(text, str):
                raise TypeError(f"A prompt must be a string or a list of token ids, not {type(text).__name__}.")
            require_tokenizer(self.tokenizer, "A text prompt")
            prompt_token_ids = self.tokenizer(text).input_ids
        keep = getattr(params, "truncate_prompt_tokens", None)
        if keep is not None:           # the prompt's last tokens (the text then no longer says it)
            keep = self.config.model.max_model_len if keep == -1 else keep
            if len(prompt_token_ids) > keep:
                if mm_items:
                    raise ValueError("truncate_prompt_tokens would cut a prompt with images or embeddings: leave it "
                                     "out, or shorten the prompt.")
                prompt_token_ids, text = prompt_token_ids[-keep:], None
        self._validate(prompt_token_ids)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, not {type(params).__name__}.")
        if params.bad_words:
            require_tokenizer(self.tokenizer, "SamplingParams.bad_words")
            params = params.clone(bad_words=None, bad_words_token_ids=(params.bad_words_token_ids or [])
                                  + bad_word_sequences(self.tokenizer, params.bad_words))
        if self.config.speculative is not None and any(len(s) > 1 for s in params.bad_words_token_ids or []):
            raise ValueError("Bad words of several tokens are not checked inside proposed tokens: leave out "
                             "--speculative-config, or give bad words of one token each.")
        params.check_vocabulary(self.config.model.vocab_size)
        if params.stop:
            require_tokenizer(self.tokenizer, "SamplingParams.stop (stop strings)")
        if params.structured_outputs is not None:     # one that cannot compile: a clear error now
            require_tokenizer(self.tokenizer, "SamplingParams.structured_outputs")
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.config.model.vocab_size)
            self._grammars.matcher(params.structured_outputs)
        check_max_tokens(len(prompt_token_ids), params.max_tokens, self.config.model.max_model_len)
        check_logprobs(params, self.config.model)
        for processor in self._logits_processors:
            processor.validate_params(params)
        arrival_time = arrival_time or time.time()
        parent = ParentRequest(request_id, text, prompt_token_ids, params,
                               RequestMetrics(arrival_time, max_tokens_param=params.max_tokens, n_param=params.n))
        if params.n == 1:
            return parent, [EngineCoreRequest(request_id, prompt_token_ids, params, arrival_time, lora_request,
                                              cache_salt=salt, mm_items=mm_items)]
        return parent, [
            EngineCoreRequest(f"{i}_{request_id}", prompt_token_ids,
                              params.clone(n=1, seed=None if params.seed is None else params.seed + i), arrival_time,
                              lora_request, cache_salt=salt, mm_items=mm_items)
            for i in range(params.n)]

    def _process_pooling(self, request_id: str, prompt, params: PoolingParams, arrival_time: float | None,
                         lora_request: LoRARequest | None) -> tuple[ParentRequest, list[EngineCoreRequest]]:
        pooler = self.config.model.pooler
        name = self.config.model.served_model_name
        if pooler is None:
            raise ValueError(f"{name} is a generative model: pooling (embeddings, classes, scores) needs a pooling "
                             "model, or this one run as one with --runner pooling (--convert embed).")
        if lora_request is not None:
            self.check_lora(lora_request)
        task = params.task or pooler.task
        if task not in pooler.tasks:
            raise ValueError(f"{name} does not serve the pooling task {task!r}: it serves {', '.join(pooler.tasks)}.")
        if params.task is None:
            params = params.clone(task=task)
        hidden = self.config.model.hf_config.hidden_size
        if params.dimensions is not None:
            if pooler.task != "embed" or not pooler.matryoshka:
                raise ValueError(f"{name} does not support matryoshka representation: leave out dimensions.")
            if params.dimensions > hidden:
                raise ValueError(f"dimensions={params.dimensions} is more than the model's {hidden}.")
        text, ids = split_prompt(prompt)
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        mm_items = None
        if self.given_embeddings.given(prompt):      # images (a vision-language model), as in generation
            ids, mm_items = self.given_embeddings.read(prompt, text, ids, params)
        if ids is None:
            if not isinstance(text, str):
                raise TypeError(f"A prompt must be a string or a list of token ids, not {type(text).__name__}.")
            require_tokenizer(self.tokenizer, "A text prompt")
            encoded = self.tokenizer(text)
            ids, token_type_ids = encoded.input_ids, encoded.get("token_type_ids")
        kept, token_type_ids = self._truncated(ids, token_type_ids, params.truncate_prompt_tokens)
        if mm_items and len(kept) < len(ids):
            raise ValueError("truncate_prompt_tokens would cut a prompt with images or embeddings: leave it out, or "
                             "shorten the prompt.")
        ids = kept
        self._validate(ids, room_for_output=False)
        arrival_time = arrival_time or time.time()
        sampling = SamplingParams(max_tokens=None, output_kind=RequestOutputKind.FINAL_ONLY)
        parent = ParentRequest(request_id, text, ids, sampling, RequestMetrics(arrival_time), pooling_params=params)
        return parent, [EngineCoreRequest(request_id, ids, sampling, arrival_time, lora_request, params,
                                          list(token_type_ids) if token_type_ids is not None else None,
                                          mm_items=mm_items)]

    def _truncated(self, ids: list[int], token_type_ids: list[int] | None, keep: int | None):
        """A pooling prompt cut to `keep` tokens (-1: max_model_len) on the tokenizer's truncation side."""
        if keep is None:
            return ids, token_type_ids
        keep = self.config.model.max_model_len if keep == -1 else keep
        if len(ids) <= keep:
            return ids, token_type_ids
        part = slice(-keep, None) if getattr(self.tokenizer, "truncation_side", "right") == "left" else slice(keep)
        return ids[part], token_type_ids[part] if token_type_ids is not None else None

    def check_lora(self, lora_request: LoRARequest) -> None:
        """The adapter can be served: LoRA is on, and the adapter reads and fits the base model
        (read once per id and path; a ValueError says what is wrong)."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, not {type(lora_request).__name__}.")
        lora = self.config.lora
        if lora is None:
            raise ValueError(f"The request names LoRA adapter {lora_request.lora_name!r}, but LoRA is off: start the "
                             "engine with enable_lora=True (--enable-lora).")
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._checked_loras:
            front_end_check(lora_request, self.config.model, lora.max_lora_rank)
            self._checked_loras.add(key)

    def _validate(self, ids: list[int], room_for_output: bool = True) -> None:
        max_len = self.config.model.max_model_len
        if not ids:
            raise ValueError("The prompt is empty: give at least one token.")
        if not room_for_output and len(ids) > max_len:
            raise ValueError(f"The input is {len(ids)} tokens long, but this model's maximum context length is "
                             f"{max_len} tokens: shorten it, or set truncate_prompt_tokens to cut it (-1: to "
                             f"{max_len}).")
        if room_for_output and len(ids) >= max_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long, but max_model_len={max_len} leaves no room "
                             f"for output: shorten the prompt below {max_len} tokens or raise max_model_len.")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}).")

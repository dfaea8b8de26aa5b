"""OpenAI completions and chat completions on top of AsyncLLM: requests to SamplingParams,
RequestOutputs to response bodies and server-sent-event chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from shardlm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.processor import check_max_tokens, require_tokenizer
from shardlm.entrypoints.openai import harmony, tools
from shardlm.entrypoints.openai.chat_images import embeds_prompts, image_placeholder, with_images
from shardlm.entrypoints.openai.frontend_options import FrontendOptions
from shardlm.entrypoints.openai.logprobs_json import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    prompt_position_logprobs,
)
from shardlm.entrypoints.openai.lora_modules import LoRAModules
from shardlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    RequestLimits,
)
from shardlm.entrypoints.openai.tool_parsers import get_parser
from shardlm.lora.request import LoRARequest
from shardlm.outputs import RequestOutput
from shardlm.pooling.params import PoolingParams
from shardlm.reasoning import get_reasoning_parser
from shardlm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from shardlm.structured_output.grammar import BACKENDS

_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclasses.dataclass
class EventStream:
    """A streamed response: its server-sent events, and the engine requests behind them. The
    server calls close() once the response ends however it ends: a client that left before the
    first event was read never started `events`, so its own cleanup would not run."""
    events: AsyncIterator[dict | str]     # a dict: one chunk's JSON; a string: an event as written
    request_ids: list[str]
    llm: AsyncLLM

    def close(self) -> None:
        for rid in self.request_ids:       # a no-op for requests that finished
            self.llm.abort(rid)


def structured_outputs_params(req) -> StructuredOutputsParams | None:
    """The request's constraint from whichever field carries it (one at most), or None."""
    given = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError("response_format of type json_schema needs json_schema.schema.", 400, "response_format")
        given["response_format"] = {"json": fmt.json_schema.schema_}
    options = {}
    if req.structured_outputs is not None:
        values = dict(req.structured_outputs)
        if any(values.get(k) is not None for k in ("json", "regex", "choice", "grammar", "json_object")):
            given["structured_outputs"] = values
        else:       # options only (disable_any_whitespace, ...): for the constraint another field gives
            options = values
    guided = {k: getattr(req, "guided_" + k) for k in ("json", "regex", "choice", "grammar")
              if getattr(req, "guided_" + k) is not None}
    if guided:
        given["guided_" + next(iter(guided))] = {**guided, "whitespace_pattern": req.guided_whitespace_pattern}
    backend = req.guided_decoding_backend or given.get("structured_outputs", options).pop("backend", None)
    if backend not in (None, *BACKENDS):
        raise OpenAIError(f"Structured-output backend {backend!r} is not available: this server uses 'guidance' "
                          "(llguidance); leave the backend out or say 'auto'.", 400, "guided_decoding_backend")
    if len(given) > 1:
        raise OpenAIError(f"Give one structured-output constraint, not {' and '.join(given)}.", 400, next(iter(given)))
    if not given:
        return None
    (field, values), = given.items()
    try:
        return StructuredOutputsParams(**{**options, **values})
    except (TypeError, ValueError) as e:
        raise OpenAIError(str(e), 400, field) from e


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_names: list[str], chat_template: str | None = None,
                 limits: RequestLimits | None = None, tool_parser: str | None = None,
                 options: FrontendOptions | None = None):
        """tool_parser: the --tool-call-parser that reads tool_choice "auto" outputs (None: auto is off;
        serve imported a --tool-parser-plugin file first);
        options: how answers are written (frontend_options.py)."""
        self.llm = llm
        self.loras = LoRAModules(served_model_names[0])      # adapters a request's model may name
        self.tool_parser = get_parser(tool_parser) if tool_parser else None
        # answers that may hold tool calls keep special tokens where the calls are written in them
        self.tool_calls_special = self.tool_parser is not None and llm.tokenizer is not None and \
            self.tool_parser.needs_special_tokens(llm.tokenizer)
        m = llm.config.model
        self.reasoning = get_reasoning_parser(m.reasoning_parser, m.reasoning_parser_plugin) if m.reasoning_parser \
            else None
        self.model_names = served_model_names
        self.chat_template = chat_template
        self.limits = limits or RequestLimits()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-tokenize")
        self.max_model_len = llm.config.model.max_model_len
        self.defaults = llm.default_sampling_params()
        self.tracer = None            # --otlp-traces-endpoint: a RequestTracer (tracing.py)
        self.options = options or FrontendOptions()
        template = chat_template or getattr(llm.tokenizer, "chat_template", None)
        self.content_format = self.options.content_format_for(template if isinstance(template, str) else None)
        self.image_placeholder = image_placeholder(llm)      # a vision-language model's (chat_images.py)
        self.harmony = harmony.is_harmony_model(m.hf_config)      # GPT-OSS: chats read as harmony (harmony.py)
        # (a required or named tool choice is JSON, not harmony: tools.AnswerShape)

    # ---- shared ----
    def check_model(self, name: str | None) -> str:
        return self.resolve_model(name)[0]

    def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The model a request names: (its name, its LoRA adapter or None for the base model)."""
        lora = self.loras.get(name) if name is not None else None
        if lora is not None:
            return name, lora
        if name is not None and name not in self.model_names:
            served = [*self.model_names, *self.loras.adapters]
            raise OpenAIError(f"The model `{name}` does not exist. Served: {', '.join(served)}.", 404,
                              "model", "NotFoundError")
        return name if name is not None else self.model_names[0], None     # vLLM answers with the name asked for

    def check_request(self, req) -> None:
        """Fields this server does not implement, and what a request may ask for (RequestLimits)."""
        unknown = sorted(k for k, v in (req.model_extra or {}).items() if v is not None)
        if unknown:
            raise OpenAIError(f"This server does not support the field(s) {', '.join(map(repr, unknown))}; leave "
                              "them out.", 400, unknown[0])
        lim = self.limits
        if req.n > lim.max_n:
            raise OpenAIError(f"n={req.n} is more than this server allows ({lim.max_n}, --max-n).", 400, "n")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop_strings:
            raise OpenAIError(f"{len(stops)} stop strings are more than this server allows ({lim.max_stop_strings}, "
                              "--max-stop-strings).", 400, "stop")
        if any(len(x) > lim.max_stop_string_chars for x in stops):
            raise OpenAIError(f"A stop string is longer than this server allows ({lim.max_stop_string_chars} "
                              "characters, --max-stop-string-chars).", 400, "stop")

    def sampling_params(self, req, max_tokens: int | None, prompt_len: int, keep_special_tokens: bool = False,
                        **extra) -> SamplingParams:
        """Streams get deltas (only what is new each step); the others one final output.
        keep_special_tokens: the output's text keeps them whatever the request says (harmony, tool
        calls written in special tokens)."""
        try:
            check_max_tokens(prompt_len, max_tokens, self.max_model_len)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "max_tokens") from e
        values = {f: getattr(req, f) if getattr(req, f) is not None else getattr(self.defaults, f) for f in _DEFAULTED}
        constrained, tool_constraint = structured_outputs_params(req), extra.pop("tool_constraint", None)
        if constrained is not None and tool_constraint is not None:
            raise OpenAIError("tool_choice \"required\" or a named function constrains the output already: leave out "
                              "response_format, structured_outputs and guided_*.", 400, "tool_choice")
        try:
            return SamplingParams(
                n=req.n, seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                max_tokens=max_tokens, skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output, logit_bias=req.logit_bias,
                allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                structured_outputs=constrained or tool_constraint,
                extra_args=req.vllm_xargs,
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY, **values, **extra)
        except ValueError as e:
            raise invalid(e, None) from e

    def render_chat(self, messages: list[ChatMessage], tool_specs: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The conversation through the chat template, as this server renders every chat: its
        content format, and the default template variables under the request's."""
        self.need_tokenizer("A chat", "messages")
        for m in messages:
            check_encodable(m.text(), "messages")
        return render_messages(self.llm.tokenizer, tools.template_messages(messages, self.content_format,
                                                                            self.image_placeholder),
                               self.chat_template, tools=tool_specs, add_generation_prompt=add_generation_prompt,
                               **{**self.options.default_chat_template_kwargs, **(template_kwargs or {})})

    async def chat_tokens(self, req, text: str, add_special_tokens: bool | None = None
                          ) -> tuple[list[int], list | None]:
        """A rendered chat's token ids, and its images' items where its messages have image_url
        parts (a vision-language model's processor expands their placeholders). add_special_tokens:
        to the rendered text (None: the request's)."""
        if add_special_tokens is None:
            add_special_tokens = req.add_special_tokens
        if any(m.image_urls() for m in req.messages):
            return await with_images(self.llm, req, text, self._pool, add_special_tokens)
        encoded = await self.off_loop(self.llm.tokenizer, text, add_special_tokens=add_special_tokens)
        return encoded.input_ids, None

    def need_tokenizer(self, what: str, param: str) -> None:
        """A 400 where `what` needs text and the server runs without a tokenizer (--skip-tokenizer-init)."""
        try:
            require_tokenizer(self.llm.tokenizer, what)
        except ValueError as e:
            raise OpenAIError(str(e), 400, param) from None

    def tokens_as_ids(self, req) -> bool:
        """Whether logprobs name tokens as token_id:N (the request's say, else the server's; always
        without a tokenizer, which could not name them otherwise)."""
        if self.llm.tokenizer is None:
            return True
        given = req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if given is None else given

    def usage(self, prompt: int, completion: int, cached: int) -> dict:
        """OpenAI's usage; with --enable-prompt-tokens-details also the prompt tokens the prefix cache gave."""
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.options.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def usage_of(self, finals: list[RequestOutput]) -> dict:
        return self.usage(sum(len(o.prompt_token_ids) for o in finals),
                          sum(len(c.token_ids) for o in finals for c in o.outputs),
                          sum(o.num_cached_tokens for o in finals))

    def stream_usage(self, req) -> bool:
        """Whether a stream ends with a usage chunk: stream_options asks, or --enable-force-include-usage."""
        return bool(req.stream_options and req.stream_options.include_usage) or self.options.enable_force_include_usage

    async def tokenize(self, prompt: str | list[int], param: str = "prompt",
                       add_special_tokens: bool = True) -> list[int]:
        """Text to token ids, once; AsyncLLM's input processor checks them (length, vocabulary)."""
        if not isinstance(prompt, str):
            return list(prompt)
        self.need_tokenizer("A text prompt", param)
        check_encodable(prompt, param)
        return (await self.off_loop(self.llm.tokenizer, prompt, add_special_tokens=add_special_tokens)).input_ids

    def truncated(self, ids: list[int], keep: int | None, images=None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return ids
        if images:
            raise OpenAIError("truncate_prompt_tokens would cut a prompt with images: leave it out.", 400,
                              "truncate_prompt_tokens")
        if keep == 0:
            raise OpenAIError("truncate_prompt_tokens=0 would leave no prompt: give at least 1, or -1 for as many as "
                              "the model takes.", 400, "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    @staticmethod
    def check_prompt_logprobs(req) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise OpenAIError("prompt_logprobs are not streamed: leave out stream, or prompt_logprobs.", 400,
                              "prompt_logprobs")

    def response_id(self, req, kind: str) -> str:
        """The response's id: the request's request_id (vLLM's field) or a new one."""
        return f"{kind}-{req.request_id if req.request_id else uuid.uuid4().hex}"

    async def off_loop(self, fn, *args, **kwargs):
        """Tokenizing or rendering a large input runs on a worker thread (the tokenizer releases
        the GIL), so other clients' streams go on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def submit(self, requests: list[tuple[dict, SamplingParams | PoolingParams, str]],
               lora: LoRARequest | None = None, priority: int = 0) -> list[AsyncIterator[RequestOutput]]:
        """Add every request to the engine now, checked before any response starts (so a stream
        never breaks on bad input): all of them, or none (those added are aborted). Admission is
        decided here, with no await between the check and the adds."""
        try:
            self.llm.processor.check_priority(priority)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "priority") from e
        if self.llm.sleeping:
            raise OpenAIError("The engine sleeps (--enable-sleep-mode): POST /wake_up first, or send the request to "
                              "another replica.", 503, type_="ServiceUnavailableError", headers={"Retry-After": "5"})
        waiting, limit = self.llm.num_waiting, self.limits.max_num_waiting
        if waiting >= limit:
            raise OpenAIError(f"The server is busy: {waiting} requests are waiting (--max-num-waiting {limit}). "
                              "Retry later.", 429, type_="RateLimitError", headers={"Retry-After": "1"})
        queued, bound = self.llm.num_unfinished, self.limits.max_num_queued_reqs
        if bound is not None and queued >= bound:
            raise OpenAIError(f"The server is full: {queued} requests are in its engine (--max-num-queued-reqs "
                              f"{bound}). Send this one to another replica, or retry.", 503,
                              type_="ServiceUnavailableError", headers={"Retry-After": "1"})
        streams = []
        try:
            for prompt, params, rid in requests:
                streams.append(self.llm.generate(prompt, params, rid, lora_request=lora, priority=priority))
                if self.tracer is not None:
                    self.tracer.begin(rid, params)
        except BaseException as e:
            for _, _, rid in requests[:len(streams)]:
                self.llm.abort(rid)
            if isinstance(e, ValueError):
                raise invalid(e, "prompt") from e
            raise
        return streams

    # ---- beam search (use_beam_search, as vLLM's) ----
    def beam_params(self, req, max_tokens: int | None, prompt_len: int) -> BeamSearchParams:
        if req.stream:
            raise OpenAIError("Beam search answers whole: leave out stream, or use_beam_search.", 400, "stream")
        limit = self.llm.config.model.logprobs_limit
        if 2 * req.n > limit:
            raise OpenAIError(f"Beam search with n={req.n} reads {2 * req.n} logprobs a step, more than this server "
                              f"gives ({limit}, --max-logprobs): give n <= {limit // 2}.", 400, "n")
        try:
            check_max_tokens(prompt_len, max_tokens, self.max_model_len)
            return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens or self.max_model_len - prompt_len,
                                    ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                                    length_penalty=req.length_penalty,
                                    include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "max_tokens") from e

    @staticmethod
    def engine_prompt(req, ids: list[int], text: str | None = None) -> dict:
        """A prompt as the engine takes it: its token ids (and text), with the request's cache_salt."""
        return {"prompt": text, "prompt_token_ids": ids, **({"cache_salt": req.cache_salt} if req.cache_salt else {})}

    async def beam_search(self, req, ids: list[int], params: BeamSearchParams,
                          lora: LoRARequest | None) -> BeamSearchOutput:
        """One prompt's search, each step's beams sent to the engine together."""
        search = BeamSearch(ids, params, self.llm.config.model.eos_token_ids, self.max_model_len)
        step = params.step_params()
        while beams := search.live():
            streams = self.submit([(self.engine_prompt(req, b.tokens), step, f"beam-{uuid.uuid4().hex}")
                                   for b in beams], lora, req.priority)
            search.advance([out.outputs[0].logprobs[0] for out in await last_outputs(streams)])
        tok = self.llm.tokenizer
        return search.result(tok.decode if tok is not None else None)

    # ---- /v1/completions ----
    async def completions(self, req: CompletionRequest):
        model, lora = self.resolve_model(req.model)
        self.check_request(req)
        if req.echo:
            self.need_tokenizer("echo", "echo")
        self.check_prompt_logprobs(req)
        if req.prompt is None and not req.prompt_embeds:
            raise OpenAIError("Field required: give a prompt (or prompt_embeds).", 400, "prompt")
        # with prompt_embeds, an empty prompt is none (vLLM's clients send prompt="": the openai client needs one)
        given = req.prompt if not (req.prompt_embeds and req.prompt in ("", [])) else None
        prompts = _completion_prompts(given) if given is not None else []
        embedded = await self.off_loop(embeds_prompts, req, self.llm.config.model) if req.prompt_embeds else []
        if len(prompts) + len(embedded) > self.limits.max_prompts:
            raise OpenAIError(f"{len(prompts) + len(embedded)} prompts are more than this server allows in one "
                              f"request ({self.limits.max_prompts}, --max-prompts).", 400, "prompt")
        whole = [await self.tokenize(p, add_special_tokens=req.add_special_tokens) for p in prompts]
        ids = [self.truncated(i, req.truncate_prompt_tokens) for i in whole]
        # a prompt cut by truncate_prompt_tokens is its tokens alone (echo decodes them)
        texts = [p if isinstance(p, str) and len(i) == len(w) else None for p, i, w in zip(prompts, ids, whole)]
        salt = {"cache_salt": req.cache_salt} if req.cache_salt else {}
        engine_prompts = ([self.engine_prompt(req, i, text) for i, text in zip(ids, texts)]
                          + [{"prompt_embeds": tensor, **salt} for _, tensor in embedded])
        ids += [i for i, _ in embedded]
        if req.use_beam_search:
            return await self._beam_completions(req, model, lora, ids)
        echoed = req.logprobs if req.echo else None
        asked = [n for n in (req.prompt_logprobs, echoed) if n is not None]
        params = [self.sampling_params(req, req.max_tokens, len(i), logprobs=req.logprobs,
                                       prompt_logprobs=max(asked) if asked else None) for i in ids]
        rid, created = self.response_id(req, "cmpl"), int(time.time())
        rids = [f"{rid}-{k}-{uuid.uuid4().hex[:8]}" if req.request_id else f"{rid}-{k}" for k in range(len(ids))]
        streams = self.submit([(prompt, p, r) for prompt, p, r in zip(engine_prompts, params, rids)], lora,
                              req.priority)
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if req.stream:
            return EventStream(self._stream_completions(req, head, streams, ids), rids, self.llm)
        finals = await last_outputs(streams)
        choices, as_ids = [], self.tokens_as_ids(req)
        for k, out in enumerate(finals):
            for c in out.outputs:
                text, lps = c.text, c.logprobs
                if req.echo:
                    prompt_text = out.prompt
                    if prompt_text is None:
                        prompt_text = self.llm.tokenizer.decode(out.prompt_token_ids)
                    text = prompt_text + text
                    if lps is not None and out.prompt_logprobs is not None:
                        lps = prompt_position_logprobs(out, self.llm.tokenizer) + lps
                choice = {"index": k * req.n + c.index, "text": text, "finish_reason": c.finish_reason,
                          "stop_reason": c.stop_reason,
                          "logprobs": completion_logprobs(lps, as_ids) if req.logprobs is not None else None}
                if req.return_token_ids:
                    choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return {**head, "choices": choices, "usage": self.usage_of(finals)}

    async def _beam_completions(self, req, model: str, lora, ids: list[list[int]]) -> dict:
        results = await asyncio.gather(*(self.beam_search(req, i, self.beam_params(req, req.max_tokens, len(i)), lora)
                                         for i in ids))
        choices = [{"index": k * req.n + j, "text": beam.text, "finish_reason": beam.finish_reason,
                    "stop_reason": None, "logprobs": None}
                   for k, result in enumerate(results) for j, beam in enumerate(result.sequences)]
        generated = sum(len(b.tokens) - len(i) for i, r in zip(ids, results) for b in r.sequences)
        return {"id": self.response_id(req, "cmpl"), "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": self.usage(sum(map(len, ids)), generated, 0)}

    async def _stream_completions(self, req, head, streams, prompt_ids) -> AsyncIterator[str]:
        """Each output is a delta: its text goes out as it is (with return_token_ids its tokens too,
        and the prompt's in a choice's first chunk)."""
        started: set[int] = set()
        prompt_tokens = completion_tokens = cached_tokens = 0
        as_ids = self.tokens_as_ids(req)
        async for k, out in _merge(streams):
            for c in out.outputs:
                idx = k * req.n + c.index
                completion_tokens += len(c.token_ids)
                text, first = c.text, idx not in started
                if req.echo and first:
                    text = (out.prompt or self.llm.tokenizer.decode(out.prompt_token_ids)) + text
                if not text and not c.finish_reason and not c.logprobs and not (req.return_token_ids and c.token_ids):
                    continue
                started.add(idx)
                choice = {"index": idx, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                          "logprobs": completion_logprobs(c.logprobs, as_ids) if req.logprobs is not None else None}
                if req.return_token_ids:
                    choice.update(prompt_token_ids=out.prompt_token_ids if first else None, token_ids=c.token_ids)
                yield sse({**head, "choices": [choice]})
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                cached_tokens += out.num_cached_tokens
        if self.stream_usage(req):
            yield sse({**head, "choices": [], "usage": self.usage(prompt_tokens, completion_tokens, cached_tokens)})
        yield sse("[DONE]")

    # ---- /v1/chat/completions ----
    async def chat(self, req: ChatCompletionRequest):
        model, lora = self.resolve_model(req.model)
        self.check_request(req)
        mode, function = tools.tool_mode(req, self.tool_parser)
        self.check_prompt_logprobs(req)
        check_continuation(req)
        tool_specs = None if mode == "none" and self.options.exclude_tools_when_tool_choice_none else \
            tools.template_tools(req)
        extra = {k: v for k, v in (("continue_final_message", req.continue_final_message),
                                   ("documents", req.documents)) if v}
        text = await self.off_loop(self.render_chat, req.messages, tool_specs, req.add_generation_prompt,
                                   {**extra, **(req.chat_template_kwargs or {})})
        shape = tools.AnswerShape(mode, function, self.tool_parser.with_tools(req.tools) if self.tool_parser else None,
                                  self.reasoning_for(text), self.harmony and mode in ("auto", "none"))
        ids, images = await self.chat_tokens(req, text)
        ids = self.truncated(ids, req.truncate_prompt_tokens, images)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true.", 400, "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.use_beam_search:
            return await self._beam_chat(req, model, lora, ids, max_tokens, shape)
        params = self.sampling_params(req, max_tokens, len(ids),
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                                      prompt_logprobs=req.prompt_logprobs,
                                      tool_constraint=tools.constraint(req, mode, function),
                                      keep_special_tokens=shape.harmony or (mode == "auto" and self.tool_calls_special))
        created = int(time.time())
        head = {"id": self.response_id(req, "chatcmpl"), "object": "chat.completion", "created": created,
                "model": model}
        rid = f"{head['id']}-{uuid.uuid4().hex[:8]}" if req.request_id else head["id"]    # unique in the engine
        prompt = {**self.engine_prompt(req, ids, text), **({"mm_items": images} if images else {})}
        (stream,) = self.submit([(prompt, params, rid)], lora, req.priority)
        if req.stream:
            return EventStream(self._stream_chat(req, {**head, "object": "chat.completion.chunk"}, stream,
                                                 shape), [rid], self.llm)
        (final,) = await last_outputs([stream])   # FINAL_ONLY: one output
        choices, as_ids = [], self.tokens_as_ids(req)
        for c in final.outputs:
            message = shape.message(c.text, self.answer_role(req))
            if echo := self.echoed(req):
                message["content"] = echo + (message["content"] or "")
            choices.append({"index": c.index, "message": message,
                            "finish_reason": _tool_finish(c.finish_reason, "tool_calls" in message),
                            "stop_reason": c.stop_reason,
                            "logprobs": chat_logprobs(c.logprobs, req.top_logprobs or 0, as_ids)
                            if req.logprobs else None,
                            **({"token_ids": c.token_ids} if req.return_token_ids else {})})
        answer = {**head, "choices": choices, "usage": self.usage_of([final])}
        if req.return_token_ids:
            answer["prompt_token_ids"] = final.prompt_token_ids
        if req.prompt_logprobs is not None:
            answer["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
        return answer

    async def _beam_chat(self, req, model: str, lora, ids: list[int], max_tokens: int | None,
                         shape: tools.AnswerShape) -> dict:
        result = await self.beam_search(req, ids, self.beam_params(req, max_tokens, len(ids)), lora)
        choices = [{"index": j, "message": shape.message(beam.text, self.answer_role(req)),
                    "finish_reason": beam.finish_reason, "stop_reason": None, "logprobs": None}
                   for j, beam in enumerate(result.sequences)]
        generated = sum(len(b.tokens) - len(ids) for b in result.sequences)
        return {"id": self.response_id(req, "chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": choices, "usage": self.usage(len(ids), generated, 0)}

    def reasoning_for(self, prompt: str):
        """The reasoning parser for an answer to this prompt: none where the prompt closes the
        thinking itself (a template with thinking off: DeepSeek-V3.1's `</think>`, Qwen3's empty
        think), whose answer is all content; a reasoning_content field all the same."""
        if self.reasoning is None or not self.reasoning.closed_by(prompt):
            return self.reasoning
        return dataclasses.replace(self.reasoning, thinking=False)

    def echoed(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's text, where the answer is in its role (it goes on)."""
        last = req.messages[-1]
        return last.text() if req.echo and last.role == self.answer_role(req) else ""

    def answer_role(self, req: ChatCompletionRequest) -> str:
        """--response-role where the prompt asks for an answer, else the last message's role (it goes on)."""
        return self.options.response_role if req.add_generation_prompt else req.messages[-1].role

    async def _stream_chat(self, req, head, stream, shape: tools.AnswerShape) -> AsyncIterator[dict | str]:
        """Each output is a delta: its text goes out as it is, or as reasoning_content and
        tool-call deltas (tools.ChatChoiceStream). Chunks as dicts (the route writes them as
        server-sent events; /v1/responses reads them), then the [DONE] event."""
        started: dict[int, tools.ChatChoiceStream] = {}
        prompt_tokens = completion_tokens = cached_tokens = 0
        as_ids, role = self.tokens_as_ids(req), self.answer_role(req)
        async for _, out in _merge([stream]):
            for c in out.outputs:
                if c.index not in started:
                    started[c.index] = shape.stream()
                    yield {**head, "choices": [{"index": c.index, "delta": {"role": role, "content": self.echoed(req)},
                                                "logprobs": None, "finish_reason": None}],
                           **({"prompt_token_ids": out.prompt_token_ids} if req.return_token_ids else {})}
                completion_tokens += len(c.token_ids)
                calls = started[c.index]
                deltas = calls.feed(c.text, final=c.finish_reason is not None)
                logprobs = chat_logprobs(c.logprobs, req.top_logprobs or 0, as_ids) if req.logprobs else None
                if not deltas and not c.finish_reason and not c.logprobs and not (req.return_token_ids and c.token_ids):
                    continue
                for delta in deltas[:-1]:
                    yield {**head, "choices": [{"index": c.index, "delta": delta, "logprobs": None,
                                                "finish_reason": None}]}
                yield {**head, "choices": [{
                    "index": c.index, "delta": deltas[-1] if deltas else {}, "logprobs": logprobs,
                    "finish_reason": _tool_finish(c.finish_reason, calls.called), "stop_reason": c.stop_reason,
                    **({"token_ids": c.token_ids} if req.return_token_ids else {})}]}
            if out.finished:
                prompt_tokens, cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        if self.stream_usage(req):
            yield {**head, "choices": [], "usage": self.usage(prompt_tokens, completion_tokens, cached_tokens)}
        yield sse("[DONE]")


def _tool_finish(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason "tool_calls" for an output that ended in tool calls."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def invalid(e: ValueError, default_param: str | None) -> OpenAIError:
    """A ValueError from SamplingParams or the input processor as a 400 naming the parameter."""
    m = re.search(r"SamplingParams\.(\w+)", str(e))
    if str(e).startswith("structured_outputs."):       # a constraint the grammar backend refused
        default_param = "structured_outputs"
    return OpenAIError(str(e).replace("SamplingParams.", ""), 400, m.group(1) if m else default_param)


def render_messages(tokenizer, messages: list[dict], chat_template: str | None, **kwargs) -> str:
    """The chat template applied to messages; a template that rejects them is the client's error."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template, **kwargs)
    except Exception as e:
        raise OpenAIError(f"The chat template could not render these messages: {e}", 400, "messages") from e


def check_continuation(req) -> None:
    """A chat request (chat completions, or embeddings of messages) does not both go on in its last
    message and start a new one."""
    if req.continue_final_message and req.add_generation_prompt:
        raise OpenAIError("continue_final_message goes on in the last message, add_generation_prompt starts a new "
                          "one: set add_generation_prompt to false.", 400, "continue_final_message")


def check_encodable(text: str, param: str) -> None:
    """Text a tokenizer cannot encode (lone surrogates from JSON escapes) is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIError(f"The text is not valid Unicode ({e.reason} at position {e.start}): send UTF-8 text "
                          "without lone surrogates.", 400, param) from None


def _completion_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if not prompt:
        raise OpenAIError("The prompt is empty.", 400, "prompt")
    return list(prompt)


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several request streams as they come; closing this closes (aborts) them all."""
    if len(streams) == 1:       # one request: read it directly, no pump task and queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k, stream):
        try:
            async for out in stream:
                await queue.put((k, out))
        except BaseException as e:   # noqa: BLE001 - re-raised by the consumer
            await queue.put((k, e))
        finally:
            await queue.put((k, done))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            k, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def last_outputs(streams) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for k, out in _merge(streams):
        finals[k] = out
    return [finals[k] for k in range(len(streams))]

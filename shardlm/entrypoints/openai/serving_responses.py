"""POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel: OpenAI's Responses
API over the chat pipeline. A request becomes chat messages (its instructions, the conversation of
its previous_response_id, its input items: messages, function calls and their outputs), runs as a
chat completion (the same chat template, tool-call parser, reasoning parser and structured
outputs), and its answer becomes output items: reasoning, a message of output_text, function
calls. Streams become the typed event sequence the openai client's responses.stream() reads.

Responses are kept (store: true, the default) in a bounded store, by id, for previous_response_id
and retrieval; background: true answers at once with a queued response that runs on, which GET
polls and cancel stops."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator

from pydantic import ValidationError

from shardlm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from shardlm.entrypoints.openai.responses_protocol import ResponsesRequest
from shardlm.entrypoints.openai.serving import EventStream, OpenAIServing, sse

STORE_SIZE = 1000       # responses kept for previous_response_id and GET (the oldest go first)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.store: OrderedDict[str, dict] = OrderedDict()        # id -> {"response", "conversation"}
        self.tasks: dict[str, asyncio.Task] = {}                  # background responses running

    # ---- routes ----
    async def create(self, req: ResponsesRequest):
        self._check_fields(req)
        if req.background and (req.stream or not req.store):
            raise OpenAIError("background: true needs store: true and no stream (poll GET /v1/responses/{id}).", 400,
                              "background")
        conversation = self._previous(req.previous_response_id) + input_messages(req.input)
        chat = self._chat_request(req, conversation)
        head = self._head(req, _new_id("resp"))
        if req.background:
            queued = {**head, "status": "queued"}
            self._keep(queued, conversation)
            self.tasks[head["id"]] = asyncio.ensure_future(self._run_background(head, chat, conversation))
            return queued
        answer = await self.serving.chat(chat)
        if req.stream:
            return EventStream(self._events(head, answer.events, conversation, req.store), answer.request_ids,
                               answer.llm)
        response = finish(head, answer["choices"][0], answer["usage"])
        if req.store:
            self._keep(response, conversation + [assistant_message(response["output"])])
        return response

    def retrieve(self, response_id: str) -> dict:
        return self._stored(response_id)["response"]

    async def cancel(self, response_id: str) -> dict:
        stored = self._stored(response_id)
        task = self.tasks.pop(response_id, None)
        if task is None:
            raise OpenAIError(f"Response {response_id} is not running in the background: only a background response "
                              "can be cancelled.", 400, "response_id")
        task.cancel()
        stored["response"] = {**stored["response"], "status": "cancelled"}
        return stored["response"]

    # ---- the request as a chat completion ----
    def _check_fields(self, req: ResponsesRequest) -> None:
        unknown = sorted(k for k, v in (req.model_extra or {}).items() if v is not None)
        if unknown:
            raise OpenAIError(f"This server does not support the field(s) {', '.join(map(repr, unknown))} of "
                              "/v1/responses; leave them out.", 400, unknown[0])

    def _previous(self, response_id: str | None) -> list[dict]:
        if response_id is None:
            return []
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"Previous response with id '{response_id}' not found (it was not stored, or is too "
                              f"old: the last {STORE_SIZE} are kept).", 404, "previous_response_id", "NotFoundError")
        return list(stored["conversation"])

    def _chat_request(self, req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        body = {"model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
                "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "priority": req.priority,
                "stream": req.stream, "stream_options": {"include_usage": True} if req.stream else None,
                "response_format": response_format(req.text), "parallel_tool_calls": req.parallel_tool_calls}
        if req.tools:
            body["tools"] = [chat_tool(t) for t in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(req.tool_choice)
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            raise OpenAIError(f"Invalid request: {'.'.join(map(str, first['loc']))}: {first['msg']}", 400,
                              "input") from None

    def _head(self, req: ResponsesRequest, response_id: str) -> dict:
        """The response's fields that do not depend on its output."""
        return {"id": response_id, "object": "response", "created_at": int(time.time()),
                "model": self.serving.check_model(req.model), "status": "in_progress", "output": [],
                "instructions": req.instructions, "previous_response_id": req.previous_response_id,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
                "parallel_tool_calls": req.parallel_tool_calls,
                "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "metadata": req.metadata or {}, "store": req.store, "background": req.background,
                "user": req.user, "error": None, "incomplete_details": None, "usage": None}

    # ---- kept responses ----
    def _keep(self, response: dict, conversation: list[dict]) -> None:
        self.store[response["id"]] = {"response": response, "conversation": conversation}
        self.store.move_to_end(response["id"])
        while len(self.store) > STORE_SIZE:
            self.store.popitem(last=False)

    def _stored(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id '{response_id}' not found.", 404, "response_id", "NotFoundError")
        return stored

    async def _run_background(self, head: dict, chat: ChatCompletionRequest, conversation: list[dict]) -> None:
        self.store[head["id"]]["response"] = {**head, "status": "in_progress"}
        try:
            answer = await self.serving.chat(chat)
            response = finish(head, answer["choices"][0], answer["usage"])
            self._keep(response, conversation + [assistant_message(response["output"])])
        except OpenAIError as e:
            self.store[head["id"]]["response"] = {**head, "status": "failed",
                                                  "error": {"code": str(e.status), "message": e.message}}
        finally:
            self.tasks.pop(head["id"], None)

    # ---- streaming ----
    async def _events(self, head: dict, chunks: AsyncIterator[dict | str], conversation: list[dict],
                      store: bool) -> AsyncIterator[str]:
        events = StreamEvents(head)
        yield events.send("response.created", response=head)
        yield events.send("response.in_progress", response=head)
        usage, finish_reason = None, None
        async for body in chunks:
            if isinstance(body, str):          # chat's closing [DONE] event
                break
            usage = body.get("usage") or usage
            for choice in body.get("choices", []):
                for event in events.feed(choice.get("delta") or {}):
                    yield event
                finish_reason = choice.get("finish_reason") or finish_reason
        for event in events.close():
            yield event
        response = finish(head, {"message": None, "finish_reason": finish_reason}, usage, events.items)
        if store:
            self._keep(response, conversation + [assistant_message(response["output"])])
        # (a response cut at max_output_tokens ends so too, with status "incomplete": the openai client's
        # responses.stream() takes its final response from response.completed only)
        yield events.send("response.completed", response=response)


class StreamEvents:
    """Chat deltas -> the Responses event sequence: each output item added, its deltas, done."""

    def __init__(self, head: dict):
        self.head = head
        self.sequence = 0
        self.items: list[dict] = []          # the output so far
        self.open: dict | None = None        # the text item receiving deltas (reasoning or message)
        self.open_text = ""
        self.calls: dict[int, dict] = {}     # tool call index -> its function_call item

    def send(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(event)

    def feed(self, delta: dict) -> list[str]:
        out = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            item = self.calls.get(call["index"])
            if item is None:
                out += self._close_text()
                function = call.get("function") or {}
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": call.get("id") or _new_id("call"),
                        "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
                self.calls[call["index"]] = item
                out += self._add(item)
            piece = (call.get("function") or {}).get("arguments") or ""
            if piece:
                item["arguments"] += piece
                out.append(self.send("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=piece))
        return out

    def close(self) -> list[str]:
        """At the end: the open text item and every function call done."""
        out = self._close_text()
        for call in self.calls.values():
            index = self.items.index(call)
            call["status"] = "completed"
            out.append(self.send("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                                 name=call["name"], arguments=call["arguments"]))
            out.append(self.send("response.output_item.done", output_index=index, item=dict(call)))
        return out

    def _text(self, kind: str, piece: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close_text()
            item = ({"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []} if kind == "reasoning"
                    else {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                          "content": []})
            out += self._add(item)
            self.open, self.open_text = item, ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            if kind == "message":
                out.append(self.send("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=part))
        self.open_text += piece
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.send(name, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                             delta=piece, **extra))
        return out

    def _add(self, item: dict) -> list[str]:
        self.items.append(item)
        return [self.send("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close_text(self) -> list[str]:
        """The open text item done."""
        item = self.open
        if item is None:
            return []
        index, text, out = self.items.index(item), self.open_text, []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.send("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], "completed"
            out.append(self.send("response.output_text.done", item_id=item["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[]))
            out.append(self.send("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        out.append(self.send("response.output_item.done", output_index=index, item=dict(item)))
        self.open = None
        return out


# ---- conversions ----
def input_messages(given) -> list[dict]:
    """Responses input (a text, or items) -> chat messages."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise OpenAIError(f"An input message has role {role!r}: use user, system, developer or assistant.",
                                  400, "input")
            messages.append({"role": role, "content": _content_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)       # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue                                 # earlier thinking: not sent back to the model
        else:
            raise OpenAIError(f"Input items of type {kind!r} are not supported: send message, function_call, "
                              "function_call_output or reasoning items.", 400, "input")
    if not messages:
        raise OpenAIError("The input has no message.", 400, "input")
    return messages


def _content_of(content) -> str | list[dict]:
    """A message's content as chat takes it: its text, or its parts where it has images
    (input_image: an image_url, as chat's image_url parts take it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError("A message's content must be a text or a list of text and image parts.", 400, "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise OpenAIError(f"Content parts of type {kind!r} are not supported: send input_text parts, and "
                              "input_image parts with an image_url for a vision-language model.", 400, "input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise OpenAIError(f"Tools of type {tool.get('type')!r} are not supported: only function tools.", 400, "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice {choice!r} is not supported: use none, auto, required or "
                      "{\"type\": \"function\", \"name\": ...}.", 400, "tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format -> chat's response_format (None: plain text)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                        "strict": fmt.get("strict")}}
    raise OpenAIError(f"text.format type {kind!r}: use text, json_object or json_schema.", 400, "text")


def output_items(message: dict) -> list[dict]:
    """A chat message -> Responses output items: reasoning, a message of text, function calls."""
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": [],
                                   "logprobs": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def finish(head: dict, choice: dict, usage: dict | None, items: list[dict] | None = None) -> dict:
    """The whole response from its chat choice (or, streamed, the items already built)."""
    output = items if items is not None else output_items(choice["message"])
    cut = choice.get("finish_reason") == "length"
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    return {**head, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
                      "input_tokens_details": {"cached_tokens": usage.get("prompt_tokens_details", {})
                                               .get("cached_tokens", 0)},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def assistant_message(output: list[dict]) -> dict:
    """The response's output as the assistant's turn of a conversation (previous_response_id)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}

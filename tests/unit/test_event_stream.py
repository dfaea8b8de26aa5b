"""A streamed response's requests are aborted however it ends, even when the client left before
the response started (the events' generator then never runs, so its own cleanup cannot)."""

import asyncio

from shardlm.entrypoints.openai.routes.openai_api import event_stream_response
from shardlm.entrypoints.openai.serving import EventStream


class _Aborts:
    def __init__(self):
        self.aborted = []

    def abort(self, request_id):
        self.aborted.append(request_id)


def _run(messages_from_client):
    started = []

    async def events():
        started.append(True)
        yield "data: one\n\n"
        yield "data: [DONE]\n\n"

    llm = _Aborts()
    response = event_stream_response(EventStream(events(), ["cmpl-1-0", "cmpl-1-1"], llm))
    sent = []

    async def receive():
        if messages_from_client:
            return messages_from_client.pop(0)
        await asyncio.sleep(3600)

    async def send(message):          # as a server's send may: a suspension point
        await asyncio.sleep(0)
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(response(scope, receive, send))
    return started, sent, llm.aborted


def test_a_client_gone_before_the_first_event_still_aborts_the_requests():
    started, _, aborted = _run([{"type": "http.disconnect"}])
    assert not started, "the generator never ran: only the background task can clean up"
    assert aborted == ["cmpl-1-0", "cmpl-1-1"]


def test_a_stream_read_to_the_end_closes_its_requests_too():
    started, sent, aborted = _run([])
    assert started and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert aborted == ["cmpl-1-0", "cmpl-1-1"]      # a no-op in the engine for finished requests

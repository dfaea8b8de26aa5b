"""--otlp-traces-endpoint: spans received by an OTLP/HTTP collector in this process, one per
request, with vLLM's attributes, in the trace and under the span that the request's W3C
traceparent header names."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.helpers import free_port, server_in_this_process

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector(BaseHTTPRequestHandler):
    received: list = []

    def do_POST(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Collector.received.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    pytest.importorskip("opentelemetry.sdk")
    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Collector.received = []
    yield f"http://127.0.0.1:{port}/v1/traces"
    server.shutdown()
    server.server_close()


def test_each_request_is_a_span_in_the_callers_trace(tiny_model_dir, collector):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}        # export within 0.1 s
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--otlp-traces-endpoint", collector,
                                "--collect-detailed-traces", "all", env=env) as (_, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 6, "temperature": 0.5,
                                                      "ignore_eos": True},
                       headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, timeout=60)
        assert r.status_code == 200
        untraced = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 3}, timeout=60)
        assert untraced.status_code == 200
        deadline = time.time() + 10
        while len(Collector.received) < 2 and time.time() < deadline:
            time.sleep(0.1)
    spans = {s.trace_id.hex(): s for s in Collector.received}
    assert len(Collector.received) == 2
    span = spans[TRACE_ID]
    assert span.name == "llm_request" and span.parent_span_id.hex() == PARENT_ID
    assert span.kind == 2                        # SERVER
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.request.id"].string_value == r.json()["id"] + "-0"
    assert attrs["gen_ai.response.model"].string_value == "tiny"
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 6
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == r.json()["usage"]["prompt_tokens"]
    assert attrs["gen_ai.request.max_tokens"].int_value == 6
    assert attrs["gen_ai.request.temperature"].double_value == pytest.approx(0.5)
    e2e = attrs["gen_ai.latency.e2e"].double_value
    assert 0 < attrs["gen_ai.latency.time_to_first_token"].double_value <= e2e
    assert 0 <= attrs["gen_ai.latency.time_in_queue"].double_value <= e2e
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(e2e, abs=1e-3)
    # --collect-detailed-traces: the steps it was in, on the engine core and in the worker's forward passes
    execute, forward = (attrs[f"gen_ai.latency.time_in_model_{k}"].double_value for k in ("execute", "forward"))
    assert 0 < forward <= execute <= e2e
    other = next(s for t, s in spans.items() if t != TRACE_ID)
    assert other.parent_span_id == b""           # no traceparent: a trace of its own

"""--otlp-traces-endpoint: one OpenTelemetry span per request, as vLLM sends them: named
"llm_request", kind SERVER, vLLM's gen_ai.* attributes (the request's parameters, its token
counts, its time in the queue, to the first token, end to end, prefill and decode), exported over
OTLP/HTTP with a batch processor. A request that carries W3C trace headers (traceparent,
tracestate) gets its span in that trace, under the caller's span.

OpenTelemetry's SDK and exporter are an optional extra: pip install 'shardlm[otel]'."""

from __future__ import annotations

import contextvars
from collections import OrderedDict

from shardlm.outputs import RequestOutput

# the trace headers of the HTTP request being answered (set by TraceHeaders, read when its
# engine requests are submitted)
TRACE_HEADERS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("trace_headers", default=None)
_PENDING_LIMIT = 100_000      # requests begun but never finished (aborted) are forgotten past this


class TraceHeaders:
    """ASGI middleware: a request's traceparent / tracestate headers into TRACE_HEADERS."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                       if k in (b"traceparent", b"tracestate")}
            TRACE_HEADERS.set(headers or None)
        await self.app(scope, receive, send)


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: "
                             "pip install 'shardlm[otel]'.") from e
        self.provider = TracerProvider(resource=Resource.create({"service.name": "shardlm"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("shardlm.llm_engine")
        self.propagator, self.kind = TraceContextTextMapPropagator(), SpanKind.SERVER
        self.model_name = model_name
        self.pending: OrderedDict[str, tuple] = OrderedDict()     # request id -> (trace context, params)

    def begin(self, request_id: str, params) -> None:
        """A request goes to the engine: remember its trace context and parameters."""
        headers = TRACE_HEADERS.get()
        self.pending[request_id] = (self.propagator.extract(headers) if headers else None, params)
        while len(self.pending) > _PENDING_LIMIT:
            self.pending.popitem(last=False)

    def finish(self, out: RequestOutput) -> None:
        """A request finished: its span, from its arrival to its end."""
        begun = self.pending.pop(out.request_id, None)
        m = out.metrics
        if begun is None or m is None or m.finished_time is None:
            return
        context, params = begun
        span = self.tracer.start_span("llm_request", context=context, kind=self.kind,
                                      start_time=int(m.arrival_time * 1e9))
        for key, value in self._attributes(out, params).items():
            if value is not None:
                span.set_attribute(key, value)
        span.end(end_time=int(m.finished_time * 1e9))

    def _attributes(self, out: RequestOutput, params) -> dict:
        m = out.metrics
        scheduled = m.first_scheduled_time
        first = m.first_token_time
        return {
            "gen_ai.response.model": self.model_name, "gen_ai.request.id": out.request_id,
            "gen_ai.request.temperature": getattr(params, "temperature", None),
            "gen_ai.request.top_p": getattr(params, "top_p", None),
            "gen_ai.request.max_tokens": getattr(params, "max_tokens", None),
            "gen_ai.request.n": getattr(params, "n", None),
            "gen_ai.usage.num_sequences": len(out.outputs) if hasattr(out, "outputs") else None,
            "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in out.outputs),
            "gen_ai.latency.time_in_queue": scheduled - m.arrival_time if scheduled is not None else None,
            "gen_ai.latency.time_to_first_token": first - m.arrival_time if first is not None else None,
            "gen_ai.latency.e2e": m.finished_time - m.arrival_time,
            "gen_ai.latency.time_in_model_prefill": first - scheduled if None not in (first, scheduled) else None,
            "gen_ai.latency.time_in_model_decode": m.finished_time - first if first is not None else None,
            "gen_ai.latency.time_in_model_inference":
                m.finished_time - scheduled if scheduled is not None else None,
            "gen_ai.latency.time_in_model_execute": m.model_execute_time,     # --collect-detailed-traces
            "gen_ai.latency.time_in_model_forward": m.model_forward_time,
        }

    def shutdown(self) -> None:
        """Export what is left (the batch processor holds spans for a while)."""
        self.provider.shutdown()

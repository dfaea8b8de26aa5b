"""`shardlm serve`: the OpenAI-compatible server, or with --headless this node's replicas."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from shardlm import envs
from shardlm.entrypoints.cli.engine_flags import add_engine_args, engine_args_from


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (the engine core runs in its own process)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but "
                   "/health, /metrics, /version); default: $SHARDLM_API_KEY or $VLLM_API_KEY (which keep it out "
                   "of `ps`)")
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    p.add_argument("--headless", action="store_true",
                   help="data parallel across nodes: run this node's replicas (--data-parallel-size-local from "
                        "--data-parallel-start-rank) and no API server; they join the head at "
                        "--data-parallel-address:--data-parallel-rpc-port")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model writes its own tool calls, read by --tool-call-parser')
    from shardlm.entrypoints.openai.tool_parsers import PARSERS
    p.add_argument("--tool-call-parser", default=None, metavar="{" + ",".join(sorted(PARSERS)) + "}",
                   help="how this model writes tool calls (with --enable-auto-tool-choice); a --tool-parser-plugin "
                        "file may register more names")
    p.add_argument("--tool-parser-plugin", default=None, metavar="FILE.py",
                   help="a Python file that registers tool-call parsers (shardlm.entrypoints.openai.tool_parsers."
                        "register_tool_parser), as vLLM's")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), each as name=path or as JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's model picks one")
    from shardlm.entrypoints.openai.drain import DEFAULT_SHUTDOWN_TIMEOUT_S
    p.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, refuse new requests (503) and let those in flight finish for up to this many "
                        "seconds, then exit 0; 0 stops at once (SIGINT always does) (default: %(default)s, inside "
                        "Kubernetes' 30 s grace period)")
    from shardlm.engine.restarts import DEFAULT_MAX_RESTARTS
    p.add_argument("--max-engine-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="start the engine again when it dies (a worker killed, a step failing or timing out) at "
                        "most this many times an hour, then exit non-zero; requests with an answer begun fail "
                        "with 503 + Retry-After, those without wait for the new engine (0: exit at once) "
                        "(default: %(default)s)")
    p.add_argument("--max-replica-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help="data parallel: start a dead replica again, while the others serve, at most this many "
                        "times an hour each; past it the replica stays dead (default: %(default)s)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one OpenTelemetry span per request (vLLM's gen_ai.* attributes; W3C traceparent "
                        "continued) to this OTLP/HTTP endpoint, e.g. http://localhost:4318/v1/traces (needs "
                        "pip install 'shardlm[otel]')")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_http_args(p.add_argument_group("HTTP (TLS, CORS, a reverse proxy's prefix, logs, docs)"))
    add_frontend_args(p.add_argument_group("answers (vLLM's frontend flags)"))
    from shardlm.entrypoints.openai.protocol import RequestLimits
    limits = p.add_argument_group("request limits")
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                            help=RequestLimits.HELP[f.name] + " (default: %(default)s)")
    p.set_defaults(func=run)


def add_http_args(group) -> None:
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the private key (PEM), with --ssl-certfile")
    group.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate chain (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, help="the CA certificates that sign clients' certificates")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 not asked, 1 optional, 2 required (default: %(default)s)")
    group.add_argument("--ssl-ciphers", default=None, help="the TLS ciphers, in OpenSSL's notation")
    group.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves this server under")
    group.add_argument("--uds", default=None, metavar="PATH", help="listen on this Unix socket instead of "
                       "--host/--port (a socket file left by a stopped server is replaced)")
    for name, what in (("origins", "the web origins a browser may call this server from"),
                       ("methods", "the HTTP methods they may use"), ("headers", "the request headers they may send")):
        group.add_argument(f"--allowed-{name}", type=_json_list, default=["*"], metavar="JSON",
                           help=f"CORS: {what}, a JSON list (default: [\"*\"]: any)")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow cookies and authorization "
                       "headers from the --allowed-origins (not with every origin)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per request")
    group.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                       help="no access log line for these paths, comma-separated, e.g. /health,/metrics,/load")
    group.add_argument("--log-config-file", default=None, metavar="FILE",
                       help="uvicorn's logging configuration (JSON, YAML or INI, as logging.config reads them)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="every answer carries X-Request-Id: the request's own, else a new one")
    group.add_argument("--middleware", action="extend", nargs="+", default=[], metavar="MODULE.NAME",
                       help="ASGI middleware to add, outermost (a class, or an async function (request, "
                            "call_next)), importable from the Python path; repeatable")
    group.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")


def add_frontend_args(group) -> None:
    """One flag per FrontendOptions field (how the OpenAI routes write their answers)."""
    from shardlm.entrypoints.openai.frontend_options import CONTENT_FORMATS, FrontendOptions
    for f in dataclasses.fields(FrontendOptions):
        flag, text = f"--{f.name.replace('_', '-')}", FrontendOptions.HELP[f.name]
        if f.default is False:
            group.add_argument(flag, action="store_true", help=text)
        else:
            group.add_argument(flag, default=f.default, metavar="JSON" if f.default is None else None,
                               choices=CONTENT_FORMATS if f.name == "chat_template_content_format" else None,
                               help=text + (" (default: %(default)s)" if f.default is not None else ""))


def frontend_options(ns):
    from shardlm.entrypoints.openai.frontend_options import FrontendOptions
    try:
        return FrontendOptions(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(FrontendOptions)})
    except ValueError as e:
        sys.exit(f"shardlm: error: {e}")


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON list of strings, e.g. '[\"https://example.com\"]'")
    return value


def http_options(ns):
    from shardlm.entrypoints.openai.http_options import HttpOptions
    try:
        return HttpOptions(ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                           ssl_cert_reqs=ns.ssl_cert_reqs, root_path=ns.root_path, allowed_origins=ns.allowed_origins,
                           allowed_methods=ns.allowed_methods, allowed_headers=ns.allowed_headers,
                           allow_credentials=ns.allow_credentials, access_log=not ns.disable_uvicorn_access_log,
                           docs=not ns.disable_fastapi_docs, ssl_ciphers=ns.ssl_ciphers, uds=ns.uds,
                           log_config_file=ns.log_config_file,
                           quiet_paths=[p.strip() for p in ns.disable_access_log_for_endpoints.split(",") if p.strip()],
                           request_id_headers=ns.enable_request_id_headers, middleware=ns.middleware)
    except ValueError as e:
        sys.exit(f"shardlm: error: {e}")


def run(ns) -> None:
    if ns.headless:
        from shardlm.engine.headless import run_headless
        if ns.data_parallel_hybrid_lb or ns.data_parallel_rank is not None:
            raise ValueError("--headless with --data-parallel-hybrid-lb or --data-parallel-rank: each server of "
                             "hybrid or external load balancing has an API server of its own. Leave out "
                             "--headless, or those (a head with -dp and headless nodes: internal balancing).")
        config = engine_args_from(ns).create_engine_config()
        par = config.parallel
        if par.data_parallel_size_local == par.data_parallel_size or par.data_parallel_start_rank == 0:
            raise ValueError("--headless runs replicas that join a head on another node: give "
                             "--data-parallel-start-rank (its first replica, above the head's) and "
                             "--data-parallel-size-local, with --data-parallel-address/--data-parallel-rpc-port.")
        check_restart_counts(ns)
        sys.exit(run_headless(config, ns.max_replica_restarts))
    from shardlm.entrypoints.openai.server import run_server
    run_server(**server_options(ns))


def check_restart_counts(ns) -> None:
    """--max-engine-restarts and --max-replica-restarts: counts >= 0, else exit saying so."""
    for flag in ("max_engine_restarts", "max_replica_restarts"):
        if getattr(ns, flag) < 0:
            sys.exit(f"shardlm: error: --{flag.replace('_', '-')} {getattr(ns, flag)}: give a count >= 0 "
                     "(0 never restarts).")


def server_options(ns) -> dict:
    """make_server's arguments from `shardlm serve`'s flags; a bad combination exits with why."""
    from shardlm.engine.restarts import RestartPolicy
    chat_template = ns.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    from shardlm.entrypoints.openai.protocol import RequestLimits
    try:
        limits = RequestLimits(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestLimits)})
    except ValueError as e:
        sys.exit(f"shardlm: error: {e}")
    api_key = ns.api_key if ns.api_key is not None else envs.SHARDLM_API_KEY
    if api_key is not None and not api_key.strip():
        sys.exit("shardlm: error: the API key is empty: give a key, or leave --api-key out to serve without one.")
    if ns.shutdown_timeout < 0:
        sys.exit(f"shardlm: error: --shutdown-timeout {ns.shutdown_timeout:g}: give seconds >= 0 (0 stops at once).")
    check_restart_counts(ns)
    if ns.collect_detailed_traces and not ns.otlp_traces_endpoint:
        sys.exit("shardlm: error: --collect-detailed-traces adds to the spans of --otlp-traces-endpoint: give "
                 "--otlp-traces-endpoint URL too.")
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        from shardlm.entrypoints.openai.tool_parsers import PARSERS
        sys.exit(f"shardlm: error: --enable-auto-tool-choice needs --tool-call-parser NAME ({', '.join(PARSERS)}: "
                 "the format this model writes tool calls in).")
    if ns.tool_call_parser or ns.tool_parser_plugin:
        from shardlm.entrypoints.openai.tool_parsers import get_parser
        try:        # the plugin registers its parsers in this process, the API server's
            get_parser(ns.tool_call_parser or "hermes", ns.tool_parser_plugin)
        except ValueError as e:
            sys.exit(f"shardlm: error: {e}")
    from shardlm.entrypoints.openai.lora_modules import parse_lora_module
    try:
        lora_modules = [parse_lora_module(m) for m in ns.lora_modules or []]
    except ValueError as e:
        sys.exit(f"shardlm: error: {e}")
    return dict(engine_args=engine_args_from(ns), host=ns.host, port=ns.port, api_key=api_key,
                chat_template=chat_template, log_level=ns.uvicorn_log_level, limits=limits,
                metrics_require_key=ns.metrics_require_key,
                tool_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None, lora_modules=lora_modules,
                shutdown_timeout=ns.shutdown_timeout,
                restarts=RestartPolicy(ns.max_engine_restarts, ns.max_replica_restarts),
                otlp_traces_endpoint=ns.otlp_traces_endpoint, http=http_options(ns), frontend=frontend_options(ns))

"""How the server meets HTTP clients beyond the request limits, under vLLM's flags: TLS
(--ssl-*), CORS for browser clients (--allowed-origins ...; every origin by default, as vLLM),
the path prefix a reverse proxy adds (--root-path), a Unix socket (--uds), the access log and
its configuration, X-Request-Id headers, the user's own middleware and the API docs pages."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import ssl
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from shardlm.entrypoints.openai.middleware import RequestIdHeader


@dataclass
class HttpOptions:
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)     # 2: clients must show a certificate signed by ssl_ca_certs
    root_path: str = ""
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    access_log: bool = True
    docs: bool = True                           # /docs, /redoc and /openapi.json
    ssl_ciphers: str | None = None              # OpenSSL's cipher list (default: uvicorn's, TLSv1)
    uds: str | None = None                      # listen on this Unix socket instead of --host/--port
    log_config_file: str | None = None          # uvicorn's (and Python's) logging config, JSON/YAML/INI
    quiet_paths: list[str] = field(default_factory=list)    # --disable-access-log-for-endpoints
    request_id_headers: bool = False            # answers carry X-Request-Id (the client's, else a new one)
    middleware: list[str] = field(default_factory=list)     # import paths of ASGI middleware or functions

    def __post_init__(self):
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both (the key and its certificate).")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs}: give 0 (none), 1 (optional) or 2 (required).")
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs asks clients for a certificate: give --ssl-ca-certs, the CA that signs "
                             "them.")
        if self.ssl_cert_reqs != ssl.CERT_NONE and self.ssl_keyfile is None:
            raise ValueError("--ssl-cert-reqs needs TLS: give --ssl-keyfile and --ssl-certfile.")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with every origin (*) lets any web page use a visitor's credentials "
                             "here (browsers refuse it too): name the origins in --allowed-origins.")
        if self.log_config_file is not None and not os.path.isfile(self.log_config_file):
            raise ValueError(f"--log-config-file {self.log_config_file}: no such file.")
        self.middleware_objects = [_import_middleware(path) for path in self.middleware]

    def fastapi_kwargs(self) -> dict:
        return {} if self.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}

    def add_outer_middleware(self, app: FastAPI) -> None:
        """Added last, so that they run first: CORS, so that a browser's preflight (OPTIONS) is
        answered before the API key check and every answer, errors too, carries the CORS headers;
        X-Request-Id; then, outermost as in vLLM, the user's --middleware."""
        app.add_middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                           allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)
        if self.request_id_headers:
            app.add_middleware(RequestIdHeader)
        for imported in self.middleware_objects:
            if inspect.isclass(imported):
                app.add_middleware(imported)
            else:
                app.middleware("http")(imported)

    def uvicorn_kwargs(self) -> dict:
        kwargs = dict(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile, ssl_ca_certs=self.ssl_ca_certs,
                      ssl_cert_reqs=self.ssl_cert_reqs, root_path=self.root_path, access_log=self.access_log,
                      uds=self.uds)
        if self.ssl_ciphers is not None:
            kwargs["ssl_ciphers"] = self.ssl_ciphers
        if self.log_config_file is not None:
            kwargs["log_config"] = self.log_config_file
        return kwargs

    def quiet_access_log(self) -> None:
        """No access log lines for --disable-access-log-for-endpoints (after uvicorn set up its logging)."""
        if self.quiet_paths:
            logging.getLogger("uvicorn.access").addFilter(QuietPaths(self.quiet_paths))


class QuietPaths(logging.Filter):
    """Drops uvicorn's access log lines for these paths (the query string aside)."""

    def __init__(self, paths: list[str]):
        super().__init__()
        self.paths = set(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) > 2 else None     # (client, method, path, ...)
        return not (isinstance(path, str) and path.split("?", 1)[0] in self.paths)


def _import_middleware(path: str):
    """--middleware module.name: an ASGI middleware class, or an `async def (request, call_next)`."""
    module_name, _, name = path.rpartition(".")
    try:
        imported = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--middleware {path}: cannot import it ({e}); give module.name on the Python path.") \
            from None
    if imported is None or not (inspect.isclass(imported) or inspect.iscoroutinefunction(imported)):
        raise ValueError(f"--middleware {path}: give an ASGI middleware class or an async function "
                         "(request, call_next), as module.name.")
    return imported

"""How the server meets HTTP clients beyond the request limits, under vLLM's flags: TLS
(--ssl-*), CORS for browser clients (--allowed-origins ...; every origin by default, as vLLM),
the path prefix a reverse proxy adds (--root-path), the access log and the API docs pages."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware


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

    def fastapi_kwargs(self) -> dict:
        return {} if self.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}

    def add_cors(self, app: FastAPI) -> None:
        """Added last, so that it runs first: a browser's preflight (OPTIONS) is answered before
        the API key check, and every answer, errors too, carries the CORS headers."""
        app.add_middleware(CORSMiddleware, allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                           allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)

    def uvicorn_kwargs(self) -> dict:
        return dict(ssl_keyfile=self.ssl_keyfile, ssl_certfile=self.ssl_certfile, ssl_ca_certs=self.ssl_ca_certs,
                    ssl_cert_reqs=self.ssl_cert_reqs, root_path=self.root_path, access_log=self.access_log)

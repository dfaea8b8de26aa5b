"""vLLM's HTTP flags: TLS (--ssl-*), CORS for browser clients (every origin by default, as vLLM;
a preflight is answered before the API key check), --root-path behind a reverse proxy,
--disable-fastapi-docs, --uds, X-Request-Id headers, --middleware, the access log's paths and
configuration; bad combinations and unreadable files fail before the engine starts."""

import datetime
import ipaddress
import json
import ssl

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shardlm.engine.arg_utils import EngineArgs
from shardlm.entrypoints.openai.http_options import HttpOptions
from shardlm.entrypoints.openai.listen import bind_unix_socket
from shardlm.entrypoints.openai.server import make_server
from tests.helpers import free_port, server_in_this_process

PREFLIGHT = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.mark.parametrize("options, why", [
    (dict(ssl_keyfile="key.pem"), "--ssl-keyfile and --ssl-certfile go together"),
    (dict(ssl_keyfile="k", ssl_certfile="c", ssl_cert_reqs=2), "give --ssl-ca-certs"),
    (dict(ssl_cert_reqs=3), "give 0 \\(none\\), 1 \\(optional\\) or 2"),
    (dict(allow_credentials=True), "name the origins in --allowed-origins")])
def test_bad_combinations_are_refused_with_what_to_do(options, why):
    with pytest.raises(ValueError, match=why):
        HttpOptions(**options)


def test_unreadable_tls_files_fail_before_the_engine_starts(tiny_model_dir, tmp_path):
    (tmp_path / "key.pem").write_text("not a key")
    (tmp_path / "cert.pem").write_text("not a certificate")
    args = EngineArgs(model=tiny_model_dir("llama-gqa"), dtype="float32")
    with pytest.raises(ValueError, match="--ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-ciphers: cannot use them"):
        make_server(args, "127.0.0.1", free_port(), http=HttpOptions(str(tmp_path / "key.pem"),
                                                                     str(tmp_path / "cert.pem")))


@pytest.mark.slow
def test_cors_root_path_and_docs(tiny_model_dir):
    """CORS answers browsers, its preflight before the API key check; the schema names the proxy's
    prefix; a narrower origin list and no docs pages."""
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--api-key", "k", "--root-path", "/llm") as (_, url):
        pre = httpx.options(url + "/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        refused = httpx.get(url + "/v1/models", headers={"Origin": "https://chat.example"})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*", \
            "a browser can read why it was refused"
        ok = httpx.get(url + "/v1/models", headers={"Origin": "https://chat.example", "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
        schema = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert schema["servers"] == [{"url": "/llm"}], "the docs call the API through the proxy's prefix"
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--allowed-origins", '["https://chat.example"]',
                                "--disable-fastapi-docs") as (_, url):
        assert httpx.options(url + "/v1/completions", headers=PREFLIGHT).headers["access-control-allow-origin"] \
            == "https://chat.example"
        other = httpx.options(url + "/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert httpx.get(url + "/docs").status_code == 404 and httpx.get(url + "/openapi.json").status_code == 404
        assert httpx.get(url + "/v1/models").status_code == 200


def _self_signed(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    keyfile, certfile = tmp_path / "key.pem", tmp_path / "cert.pem"
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(keyfile), str(certfile)


@pytest.mark.slow
def test_tls_serves_https_with_the_given_certificate(tiny_model_dir, tmp_path):
    keyfile, certfile = _self_signed(tmp_path)
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--ssl-keyfile", keyfile,
                                "--ssl-certfile", certfile) as (_, url):
        secure = url.replace("http://", "https://")
        r = httpx.post(secure + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                       verify=ssl.create_default_context(cafile=certfile))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=5)       # plain HTTP on the TLS port gets no answer


MIDDLEWARE = '''
async def tag(request, call_next):
    response = await call_next(request)
    response.headers["x-tagged"] = request.url.path
    return response
'''


def _log_config(path) -> dict:
    """uvicorn's loggers into one file, line by line (and shardlm's left as they are)."""
    handler = {"class": "logging.FileHandler", "filename": str(path), "formatter": "plain"}
    return {"version": 1, "disable_existing_loggers": False, "formatters": {"plain": {"format": "%(message)s"}},
            "handlers": {"file": handler},
            "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False}
                        for name in ("uvicorn.error", "uvicorn.access")}}


@pytest.mark.slow
def test_a_unix_socket_request_ids_middleware_and_the_access_log(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "log.json").write_text(json.dumps(_log_config(tmp_path / "server.log")))
    sock = tmp_path / "shardlm.sock"
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--uds", str(sock), "--enable-request-id-headers",
                                "--middleware", "my_middleware.tag", "--log-config-file", str(tmp_path / "log.json"),
                                "--disable-access-log-for-endpoints", "/health,/load", "--uvicorn-log-level", "info"):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://shardlm") as client:
            health = client.get("/health")
            models = client.get("/v1/models?x=1", headers={"X-Request-Id": "req-7"})
            assert client.get("/load?x=1").status_code == 200
    assert health.status_code == 200 and len(health.headers["x-request-id"]) == 32, "a new id where none was sent"
    assert models.status_code == 200 and models.headers["x-request-id"] == "req-7"
    assert models.headers["x-tagged"] == "/v1/models", "the user's middleware ran"
    log = (tmp_path / "server.log").read_text()
    assert f"Uvicorn running on unix socket {sock}" in log
    assert "GET /v1/models?x=1" in log and "/health" not in log and "/load" not in log


def test_a_unix_socket_path_in_use_or_not_a_socket_is_refused_and_a_stale_one_replaced(tmp_path):
    import socket as sockets
    path = str(tmp_path / "s.sock")
    stale = sockets.socket(sockets.AF_UNIX)
    stale.bind(path)
    stale.close()                           # the file stays, nobody listens
    replaced = bind_unix_socket(path)
    replaced.listen()
    with pytest.raises(ValueError, match="another server listens on it"):
        bind_unix_socket(path)
    replaced.close()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="a file that is not a socket"):
        bind_unix_socket(str(tmp_path / "file"))


@pytest.mark.parametrize("options, why", [
    (dict(middleware=["no_such_module.thing"]), "--middleware no_such_module.thing: cannot import it"),
    (dict(middleware=["json.dumps"]), "give an ASGI middleware class or an async function"),
    (dict(log_config_file="/nonexistent.json"), "--log-config-file /nonexistent.json: no such file")])
def test_bad_middleware_and_log_config_are_named(options, why):
    with pytest.raises(ValueError, match=why):
        HttpOptions(**options)

"""Limits below the routes (entrypoints/openai/transport.py), tried over raw sockets as a hostile
client would: headers too large or too many (431), a client too slow with its headers or its body
(408), one connection too many (503); the server answers a normal request afterwards."""

import socket
import time

import httpx
import pytest

from tests.helpers import server_in_this_process

LIMITS = ("--max-header-bytes", "4096", "--max-header-count", "20", "--client-timeout", "1",
          "--max-connections", "3")


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), *LIMITS) as (_, url):
        yield url


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _status(s: socket.socket) -> tuple[int, bytes]:
    """The status and the rest of the response, read until the server closes."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def _request(extra_headers: str = "", body: bytes = b"{}", length: int | None = None) -> bytes:
    return (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n{extra_headers}\r\n").encode() + body


def _still_serves(url: str) -> None:
    r = httpx.post(url + "/tokenize", json={"prompt": "hello"}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 0


@pytest.mark.parametrize("pieces", [1, 8], ids=["whole", "in-pieces"])
def test_headers_larger_than_the_limit_get_431(url, pieces):
    """Whole in one write (h11 parses them at once) or in pieces (its buffer limit)."""
    s = _connect(url)
    data = _request(f"X-Big: {'a' * 8000}\r\n")
    step = len(data) // pieces + 1
    try:
        for i in range(0, len(data), step):
            s.sendall(data[i:i + step])
            time.sleep(0.05 if pieces > 1 else 0)
    except (BrokenPipeError, ConnectionResetError):
        pass                            # refused before the last piece
    status, data = _status(s)
    assert status == 431 and b"--max-header-bytes" in data
    _still_serves(url)


def test_more_headers_than_the_limit_get_431(url):
    s = _connect(url)
    s.sendall(_request("".join(f"X-H{i}: v\r\n" for i in range(30)), b'{"prompt": "hi"}'))
    status, data = _status(s)
    assert status == 431 and b"--max-header-count" in data
    _still_serves(url)


def test_a_client_too_slow_with_its_headers_gets_408_and_is_closed(url):
    s = _connect(url)
    s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\n")      # and nothing more
    t0 = time.monotonic()
    status, data = _status(s)
    assert status == 408 and b"--client-timeout" in data and time.monotonic() - t0 < 5
    _still_serves(url)


def test_a_client_too_slow_with_its_body_gets_408(url):
    s = _connect(url)
    s.sendall(_request(body=b'{"prompt": ', length=100))      # 11 of the 100 bytes it announced
    status, data = _status(s)
    assert status == 408 and b"--client-timeout" in data
    _still_serves(url)


def test_one_connection_more_than_the_limit_gets_503(url):
    held = []
    try:
        for _ in range(3):          # --max-connections 3: three open connections, each served
            s = _connect(url)
            s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(s)
        extra = _connect(url)
        extra.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _ = _status(extra)
        assert status == 503
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    _still_serves(url)

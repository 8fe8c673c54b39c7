"""The reference reward server's limits against the real server on 127.0.0.1 (security review S5-11): a
Content-Length that is missing, negative, not a number or too large is answered unread (411, 400, 400,
413); a deeply nested body is a 400; a client that drips its request gets a 408 at the whole-request
deadline; connections past the limit get a 503. Each answer is one JSON line, and the server keeps
serving. The limits are the retriever server's (trainer/search/retriever_server.py), shared."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest
from cloudrl.trainer.inputs import reward_server
from cloudrl.trainer.inputs.reward_server import MAX_BODY_BYTES, RewardServer
from servers import error_line, raw_exchange


@pytest.fixture
def server():
    srv = RewardServer(("127.0.0.1", 0), lambda items: [float(len(i["response"])) for i in items], timeout_s=1.0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _score(srv) -> list[float]:
    body = json.dumps({"items": [{"prompt": "p", "response": "abc", "ground_truth": ""}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.server_address[1]}/score", body)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["scores"]


def _exchange(srv, head: bytes, then: bytes = b"", keep_sending: bool = False) -> tuple[bytes, float]:
    return raw_exchange(srv.server_address[1], head + then, keep_sending)


@pytest.mark.parametrize(
    "length, status",
    [(None, 411), ("-1", 400), ("abc", 400), (str(MAX_BODY_BYTES + 1), 413)],
)
def test_a_bad_content_length_is_answered_unread(server, length, status):
    head = (
        b"POST /score HTTP/1.1\r\nHost: x\r\n" + (f"Content-Length: {length}\r\n".encode() if length else b"") + b"\r\n"
    )
    answer, took = _exchange(server, head, keep_sending=length == "-1")  # -1 with a body streaming on
    assert answer.startswith(f"HTTP/1.0 {status} ".encode()), answer[:200]
    assert f"send a Content-Length of at most {MAX_BODY_BYTES} bytes" in error_line(answer)
    assert took < 1.5  # at once, not at the deadline
    assert _score(server) == [3.0]


def test_a_deeply_nested_body_is_a_400(server):
    body = b"[" * 100_000 + b"]" * 100_000
    head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    answer, _ = _exchange(server, head, body)
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    assert "nests too deep" in error_line(answer)
    assert _score(server) == [3.0]


def test_a_dripping_client_gets_408_at_the_deadline(server):
    request = b'POST /score HTTP/1.1\r\nContent-Length: 60\r\n\r\n{"items": [{"response": "abc"}]}' + b" " * 27
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=10) as s:
        for byte in request:  # one byte every 0.3 s: never silent for the 1 s timeout
            try:
                s.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.3)
            if time.monotonic() - start > 6:
                break
        try:
            while chunk := s.recv(4096):
                answer += chunk
        except OSError:
            pass
    took = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.0 408"), answer[:200]
    assert 1.5 < took < 5, took  # the deadline is twice the 1 s timeout
    assert "did not arrive within 2 s" in error_line(answer)
    assert _score(server) == [3.0]


def test_connections_past_the_limit_get_503(server, monkeypatch):
    monkeypatch.setattr(server, "clients", threading.BoundedSemaphore(2))  # the limit, made small
    held = [socket.create_connection(("127.0.0.1", server.server_address[1])) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.clients._value and time.monotonic() < deadline:  # both accepted, each in its thread
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as s:
            answer = s.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.0 503"), answer[:200]
        assert f"the reward server serves {server.max_clients} connections at once" in error_line(answer)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while server.clients._value < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _score(server) == [3.0]


def test_the_limits_are_the_retrievers_one_definition():
    from cloudrl.trainer.search import retriever_server

    assert issubclass(RewardServer, retriever_server.LimitedServer)
    assert issubclass(reward_server._Handler, retriever_server.LimitedHandler)

"""The retriever server's limits against the real server on 127.0.0.1: a small request cannot buy a huge
reply, a deeply nested body is a 400 (not a traceback), a missing Content-Length a 411 and a negative one
a 400, a client that drips its request a byte at a time gets a 408 within the deadline, and connections
past MAX_CLIENTS get a 503; each a one-line JSON error, and the server keeps serving. The trainer's client splits a batch past those bounds into requests the
server accepts, keeping the queries' order."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("bm25s")

from cloudrl.trainer.search import retriever_server as rs  # noqa: E402
from cloudrl.trainer.search.retrieval import RetrievalClient  # noqa: E402
from servers import error_line, raw_exchange  # noqa: E402


def _word(i: int) -> str:
    """A word of letters only (BM25's tokenizer drops numbers) that names document i alone."""
    return "zq" + "".join(chr(ord("a") + int(d)) for d in str(i))


CORPUS = [{"id": str(i), "contents": f"Doc {i}\nrock river sea number {i} {_word(i)}"} for i in range(40)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    (d / "corpus.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    rs.build_index(d / "corpus.jsonl", d / "index")
    srv = rs.RetrieverServer(("127.0.0.1", 0), rs.load_index(d / "index"), topk=2, timeout_s=1.0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _post(srv, payload=None, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{srv.server_port}/retrieve", body)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _one_line(body: dict) -> str:
    assert list(body) == ["error"] and "\n" not in body["error"]
    return body["error"]


def test_queries_times_topk_is_bounded(server):
    queries = ["rock"] * (rs.MAX_PASSAGES // rs.MAX_TOPK + 1)  # within MAX_QUERIES, topk within MAX_TOPK
    code, body = _post(server, {"queries": queries, "topk": rs.MAX_TOPK})
    assert code == 400 and f"more than {rs.MAX_PASSAGES} passages" in _one_line(body)
    assert _post(server, {"queries": ["rock"] * 10, "topk": 3})[0] == 200


def test_reply_size_is_bounded(server, monkeypatch):
    monkeypatch.setattr(rs, "MAX_REPLY_BYTES", 100)
    code, body = _post(server, {"queries": ["rock"] * 5, "topk": 5})
    assert code == 413 and "fewer queries or a smaller topk" in _one_line(body)


def test_deeply_nested_body_is_a_400(server):
    code, body = _post(server, raw=b"[" * 100_000 + b"]" * 100_000)
    assert code == 400 and "nests too deep" in _one_line(body)


@pytest.mark.parametrize("length, status", [(None, 411), ("-1", 400), ("x", 400)])
def test_a_missing_or_negative_content_length_is_answered_unread(server, length, status):
    head = b"POST /retrieve HTTP/1.1\r\n" + (f"Content-Length: {length}\r\n".encode() if length else b"") + b"\r\n"
    answer, _ = raw_exchange(server.server_port, head + b'{"queries": ["rock"]}')  # a body the server never reads
    assert answer.startswith(f"HTTP/1.0 {status} ".encode()), answer[:200]
    assert f"at most {rs.MAX_BODY_BYTES} bytes" in error_line(answer)
    assert _post(server, {"queries": ["rock"]})[0] == 200


def test_a_dripping_client_gets_408_within_the_deadline(server):
    request = b'POST /retrieve HTTP/1.1\r\nContent-Length: 40\r\n\r\n{"queries": ["rock"], "topk": 1}       '
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as s:
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
    assert _post(server, {"queries": ["rock"]})[0] == 200


def test_connections_past_the_limit_get_503(server, monkeypatch):
    deadline = time.monotonic() + 10
    while server.clients._value < rs.MAX_CLIENTS and time.monotonic() < deadline:
        time.sleep(0.02)  # earlier tests' connection threads done: none releases into the small semaphore below
    monkeypatch.setattr(server, "clients", threading.BoundedSemaphore(2))  # MAX_CLIENTS, made small
    held = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.clients._value and time.monotonic() < deadline:  # both accepted, each in its thread
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as s:
            answer = s.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.0 503"), answer[:200]
        assert "connections at once" in error_line(answer)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while server.clients._value < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _post(server, {"queries": ["rock"]})[0] == 200


@pytest.fixture
def requests_seen(server, monkeypatch):
    """The number of queries in each request the server searched, in arrival order."""
    seen: list[int] = []
    search = server.retrieve

    def counting(queries, topk, with_scores):
        seen.append(len(queries))
        return search(queries, topk, with_scores)

    monkeypatch.setattr(server, "retrieve", counting)
    return seen


def _best_ids(rows: list[list[dict]]) -> list[str]:
    return [row[0]["document"]["id"] for row in rows]


def test_client_splits_a_batch_past_the_passage_cap_and_keeps_its_order(server, requests_seen):
    # topk MAX_TOPK: each request may carry MAX_PASSAGES // MAX_TOPK queries; this batch needs three.
    per_request = rs.MAX_PASSAGES // rs.MAX_TOPK
    ids = [(7 * j) % len(CORPUS) for j in range(2 * per_request + 1)]
    client = RetrievalClient(f"http://127.0.0.1:{server.server_port}/retrieve", topk=rs.MAX_TOPK, retries=0)
    rows = client.retrieve([f"{_word(i)} rock" for i in ids])
    assert requests_seen == [per_request, per_request, 1]
    assert _best_ids(rows) == [str(i) for i in ids]
    assert all(len(row) == len(CORPUS) for row in rows)  # topk past the corpus: every document, once


def test_client_splits_by_queries_and_by_body_bytes(server, requests_seen, monkeypatch):
    client = RetrievalClient(f"http://127.0.0.1:{server.server_port}/retrieve", topk=1, retries=0)
    many = [_word(i % len(CORPUS)) for i in range(rs.MAX_QUERIES + 5)]
    assert _best_ids(client.retrieve(many)) == [str(i % len(CORPUS)) for i in range(len(many))]
    assert requests_seen == [rs.MAX_QUERIES, 5]
    requests_seen.clear()
    monkeypatch.setattr(rs, "MAX_BODY_BYTES", 2000)  # the server's bound and the client's, both small
    long = [f"{_word(i)} " + "filler " * 60 for i in range(12)]  # about 430 bytes of JSON each
    assert _best_ids(client.retrieve(long)) == [str(i) for i in range(12)]
    assert len(requests_seen) == 3 and sum(requests_seen) == 12

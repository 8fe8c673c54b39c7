"""The retriever server (real HTTP on 127.0.0.1) against Search-R1's /retrieve shape, its BM25 ranking
against bm25s's own, its bounds and errors, and the trainer's retrieval client. No cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

bm25s = pytest.importorskip("bm25s")

from cloudrl.trainer.search.retrieval import RetrievalClient, RetrieverUnavailable  # noqa: E402
from cloudrl.trainer.search.retriever_server import MAX_BODY_BYTES, RetrieverServer, build_index, load_index  # noqa: E402

CORPUS = [
    {"id": "0", "contents": "Alder\nAlder is a tree that grows near rivers and lakes."},
    {"id": "1", "contents": "Basalt\nBasalt is a volcanic rock formed from lava."},
    {"id": "2", "contents": "Cobalt\nCobalt is a metal used in blue glass and batteries."},
    {"id": "3", "contents": "Delta\nA river delta forms where a river meets the sea, leaving rock and silt."},
    {"id": "4", "contents": "Ember\nAn ember is a glowing piece of coal or wood from a fire."},
    {"id": "5", "contents": "Fjord\nA fjord is a long narrow sea inlet between cliffs of rock."},
]
QUERIES = ["river rock", "volcanic lava", "blue metal glass", "fire wood coal", "sea cliffs inlet"]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("search")
    (d / "corpus.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    build_index(d / "corpus.jsonl", d / "index")
    return d / "index"


@pytest.fixture(scope="module")
def server(index_dir):
    srv = RetrieverServer(("127.0.0.1", 0), load_index(index_dir), topk=2, timeout_s=2.0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv, path="/retrieve"):
    return f"http://127.0.0.1:{srv.server_port}{path}"


def _post(srv, payload, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(_url(srv), body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_retrieve_speaks_search_r1s_shape(server):
    code, body = _post(server, {"queries": QUERIES[:2], "topk": 3, "return_scores": True})
    assert code == 200 and list(body) == ["result"]
    assert len(body["result"]) == 2 and all(len(row) == 3 for row in body["result"])
    for row in body["result"]:
        for item in row:
            assert set(item) == {"document", "score"} and isinstance(item["score"], float)
            assert item["document"] in CORPUS  # the corpus record itself, `contents` and all
        assert [i["score"] for i in row] == sorted((i["score"] for i in row), reverse=True)
    assert body["result"][1][0]["document"]["id"] == "1"  # "volcanic lava" -> Basalt
    code, body = _post(server, {"queries": ["volcanic lava"], "return_scores": False})
    assert code == 200 and len(body["result"][0]) == 2  # the server's default topk
    assert body["result"][0][0] == CORPUS[1]  # without scores: the documents themselves


def test_bm25_ranking_equals_bm25s_own(server):
    ref = bm25s.BM25()
    ref.index(bm25s.tokenize([d["contents"] for d in CORPUS], stopwords="en", show_progress=False), show_progress=False)
    want_ids, want_scores = ref.retrieve(
        bm25s.tokenize(QUERIES, stopwords="en", show_progress=False), k=4, show_progress=False
    )
    _, body = _post(server, {"queries": QUERIES, "topk": 4, "return_scores": True})
    got_ids = [[int(i["document"]["id"]) for i in row] for row in body["result"]]
    got_scores = [[i["score"] for i in row] for row in body["result"]]
    assert got_ids == want_ids.tolist()
    assert sum(got_scores, []) == pytest.approx(want_scores.ravel().tolist(), rel=1e-6)


def test_health_counts_queries(server):
    def health():
        with urllib.request.urlopen(_url(server, "/health"), timeout=5) as resp:
            return json.loads(resp.read())

    before = health()
    assert before["status"] == "ok" and before["documents"] == len(CORPUS) and before["index"] == "bm25"
    _post(server, {"queries": ["a", "b", "c"], "topk": 1})
    assert health()["queries_served"] == before["queries_served"] + 3


@pytest.mark.parametrize(
    "payload, raw, code, words",
    [
        (None, b"not json", 400, "not JSON"),
        ({"queries": "one string"}, None, 400, "list of strings"),
        ({"queries": ["q"], "topk": 0}, None, 200, None),  # 0/absent: the server's default
        ({"queries": ["q"], "topk": 500}, None, 400, "from 1 to 100"),
        ({"queries": ["q"] * 2000}, None, 400, "at most 1024"),
    ],
)
def test_bad_requests_get_one_line(server, payload, raw, code, words):
    got, body = _post(server, payload, raw)
    assert got == code
    if words:
        assert words in body["error"] and "\n" not in body["error"]


def test_oversized_request_is_refused_unread(server):
    import socket

    with socket.create_connection(("127.0.0.1", server.server_port), timeout=10) as s:
        s.sendall(f"POST /retrieve HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
        answer = s.makefile("rb").read().decode()  # the server answers without reading the body
    assert answer.startswith("HTTP/1.0 413") and f"at most {MAX_BODY_BYTES} bytes" in answer


def test_stalled_client_is_dropped(server):
    import socket

    with socket.create_connection(("127.0.0.1", server.server_port)) as s:
        s.sendall(b"POST /retrieve HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")  # and then nothing
        s.settimeout(10)
        start = time.monotonic()
        assert s.recv(1024) == b""  # the server closes the connection
        assert time.monotonic() - start < 8
    assert _post(server, {"queries": ["rock"]})[0] == 200  # and keeps serving others


def test_client_passages_and_errors(server):
    client = RetrievalClient(_url(server), topk=1, timeout_s=5, retries=0)
    assert client.passages(["volcanic lava"]) == [[CORPUS[1]["contents"]]]
    with pytest.raises(RetrieverUnavailable, match=r"answered HTTP 400: .*list of strings"):
        RetrievalClient(_url(server), topk=1).retrieve([1])  # type: ignore[list-item]
    with socket_closed_port() as port:
        url = f"http://127.0.0.1:{port}/retrieve"
        start = time.monotonic()
        with pytest.raises(RetrieverUnavailable) as e:
            RetrievalClient(url, retries=2, timeout_s=1).retrieve(["q"])
        assert url in str(e.value) and "3 tries" in str(e.value) and "\n" not in str(e.value)
        assert 1.0 <= time.monotonic() - start < 10  # it backed off between tries


class socket_closed_port:
    """A port on 127.0.0.1 nothing listens on."""

    def __enter__(self):
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        return self.port

    def __exit__(self, *exc):
        return False


def _cli(*args, **kw):
    env = dict(os.environ)
    env.pop("CLOUDRL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer.search.retriever_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        **kw,
    )


def test_cli_builds_and_serves(tmp_path, index_dir):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    done = _cli("build-index", "--corpus", str(corpus), "--out", str(tmp_path / "idx"))
    assert done.returncode == 0 and "indexed 6 documents (bm25)" in done.stdout
    with socket_closed_port() as port:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cloudrl.trainer.search.retriever_server",
                "serve",
                "--index",
                str(tmp_path / "idx"),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert "retriever serving 6 documents" in proc.stdout.readline()
            client = RetrievalClient(f"http://127.0.0.1:{port}/retrieve", topk=1)
            assert client.retrieve(["volcanic lava"])[0][0]["document"]["id"] == "1"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"id": 1}\n', 'needs a "contents" string'),
        ("not json\n", "not JSON"),
        ("", "has no documents"),
        ('{"contents": "2+2 is 4"}\n', "no word BM25 can index"),
    ],
)
def test_cli_bad_corpus_is_one_line(tmp_path, content, words):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(content)
    done = _cli("build-index", "--corpus", str(corpus), "--out", str(tmp_path / "idx"))
    assert done.returncode == 2 and words in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_cli_serve_without_index_is_one_line(tmp_path):
    done = _cli("serve", "--index", str(tmp_path / "nothing"))
    assert done.returncode == 2 and "build-index" in done.stderr and "Traceback" not in done.stderr


def test_dense_index_ranks_by_embedding_similarity(tmp_path):
    """The dense path end to end with the built-in tiny model as the encoder: a stand-in for a real
    embedding model (its ranking means nothing), enough to check that the index built from the corpus
    is searched with the same mean-pooled embeddings, and saved and loaded whole."""
    faiss = pytest.importorskip("faiss")
    import numpy as np
    from cloudrl.trainer.inputs.demo import materialize_builtin

    encoder = materialize_builtin("tiny")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    meta = build_index(corpus, tmp_path / "dense", encoder=encoder)
    assert meta == {"kind": "dense", "documents": 6, "encoder": encoder}
    index = load_index(tmp_path / "dense")
    vectors = index.encode([d["contents"] for d in CORPUS])
    query = index.encode(["volcanic lava"])
    want = np.argsort(-(vectors @ query[0]), kind="stable")[:3]
    ids, scores = index.search(["volcanic lava"], 3)
    assert ids[0] == want.tolist()
    assert scores[0] == pytest.approx((vectors @ query[0])[want].tolist(), rel=1e-4)
    assert isinstance(index.index, faiss.IndexFlatIP)

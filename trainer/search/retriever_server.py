"""The retriever: an index built from a JSONL corpus, served over HTTP with Search-R1's `/retrieve` API.

    python -m cloudrl.trainer.search.retriever_server build-index --corpus corpus.jsonl --out index/
    python -m cloudrl.trainer.search.retriever_server serve --index index/ --port 8000

Corpus: one JSON object per line with a `contents` string (Search-R1 writes the title on its first
line) and optionally an `id`; every field is returned as the document. The sparse index is BM25 from
`bm25s` (the `search` extra). `--dense --encoder PATH` builds a dense index instead: mean-pooled
embeddings from a transformers encoder in a faiss inner-product index (needs `faiss-cpu`).

API (one JSON request per POST, JSON answers):
    POST /retrieve {"queries": [str, ...], "topk": k, "return_scores": bool}
      -> {"result": [[{"document": doc, "score": s}, ...] per query]}   with return_scores
      -> {"result": [[doc, ...] per query]}                            without
    GET /health -> {"status": "ok", "documents": N, "index": "bm25"|"dense", "queries_served": M}
Bad requests get HTTP 4xx with {"error": one line}. Request bodies, queries per request, topk and the
passages per reply (queries x topk, and their size) are bounded; a client silent for `--timeout-s` is
dropped, and one whose request has not fully arrived within twice that (a slow drip) gets HTTP 408.
At most MAX_CLIENTS connections are served at once; more get HTTP 503.

The module stands alone (the standard library, plus bm25s or faiss and transformers for the index), so
the cluster bundle ships this one file to every node and runs it as `python retriever_server.py serve`
(tasks/ray-bootstrap.sh), where cloudrl itself is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_BODY_BYTES = 1 << 20
MAX_QUERIES = 1024
MAX_TOPK = 100
MAX_PASSAGES = 8192
"""Passages in one reply (queries x topk): a small request must not buy a huge reply."""
MAX_REPLY_BYTES = 64 << 20
"""The documents' text in one reply."""
MAX_CLIENTS = 64
"""Connections served at once (a thread each)."""


class RetrieverIndexError(Exception):
    """A corpus or index that cannot be used; the message names the file and the fix."""


def _need(module: str, extra: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RetrieverIndexError(f"{module} is not installed: pip install 'cloudrl[{extra}]'") from None


def read_corpus(path: Path) -> list[dict]:
    if not path.is_file():
        raise RetrieverIndexError(
            f'corpus {path} does not exist: pass a JSONL file with one {{"contents": ...}} per line'
        )
    docs = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise RetrieverIndexError(
                    f"{path}:{n}: not JSON ({e.msg}): each line must be one JSON object"
                ) from None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                raise RetrieverIndexError(
                    f'{path}:{n}: needs a "contents" string, e.g. {{"id": "0", "contents": "Title\\ntext"}}'
                )
            docs.append(doc)
    if not docs:
        raise RetrieverIndexError(f"corpus {path} has no documents")
    return docs


def _tokenize(bm25s, texts: list[str]):
    return bm25s.tokenize(texts, stopwords="en", show_progress=False)


class BM25Index:
    kind = "bm25"

    def __init__(self, retriever, docs: list[dict]):
        self.retriever, self.docs = retriever, docs

    @classmethod
    def build(cls, docs: list[dict]) -> BM25Index:
        bm25s = _need("bm25s", "search")
        tokens = _tokenize(bm25s, [d["contents"] for d in docs])
        if not tokens.vocab:
            raise RetrieverIndexError(
                "the corpus has no word BM25 can index (only stop words, numbers or single "
                'letters): check its "contents"'
            )
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        return cls(retriever, docs)

    def save(self, out: Path) -> None:
        self.retriever.save(str(out / "bm25"))

    @classmethod
    def load(cls, path: Path, docs: list[dict]) -> BM25Index:
        return cls(_need("bm25s", "search").BM25.load(str(path / "bm25")), docs)

    def search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        bm25s = _need("bm25s", "search")
        tokens = bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        ids, scores = self.retriever.retrieve(tokens, k=min(k, len(self.docs)), show_progress=False)
        return ids.tolist(), scores.tolist()


class DenseIndex:
    """Mean-pooled, L2-normalised embeddings of a transformers encoder in a flat inner-product index."""

    kind = "dense"

    def __init__(self, index, docs: list[dict], encoder: str):
        self.index, self.docs, self.encoder_path = index, docs, encoder
        self._encoder = None

    def encode(self, texts: list[str]):
        import torch

        if self._encoder is None:
            transformers = _need("transformers", "search")
            tok = transformers.AutoTokenizer.from_pretrained(self.encoder_path)
            self._encoder = (tok, transformers.AutoModel.from_pretrained(self.encoder_path).eval())
        tok, model = self._encoder
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), 64):
                enc = tok(texts[start : start + 64], padding=True, truncation=True, max_length=256, return_tensors="pt")
                hidden = model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                out.append(torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1), dim=-1))
        return torch.cat(out).float().numpy()

    @classmethod
    def build(cls, docs: list[dict], encoder: str) -> DenseIndex:
        faiss = _need("faiss", "search-dense")
        self = cls(None, docs, encoder)
        vectors = self.encode([d["contents"] for d in docs])
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)
        return self

    def save(self, out: Path) -> None:
        _need("faiss", "search-dense").write_index(self.index, str(out / "dense.faiss"))

    @classmethod
    def load(cls, path: Path, docs: list[dict], encoder: str) -> DenseIndex:
        return cls(_need("faiss", "search-dense").read_index(str(path / "dense.faiss")), docs, encoder)

    def search(self, queries: list[str], k: int) -> tuple[list[list[int]], list[list[float]]]:
        scores, ids = self.index.search(self.encode(queries), min(k, len(self.docs)))
        return ids.tolist(), scores.tolist()


def build_index(corpus: Path, out: Path, encoder: str | None = None) -> dict:
    docs = read_corpus(corpus)
    out.mkdir(parents=True, exist_ok=True)
    index = DenseIndex.build(docs, encoder) if encoder else BM25Index.build(docs)
    index.save(out)
    with (out / "corpus.jsonl").open("w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    meta = {"kind": index.kind, "documents": len(docs), "encoder": encoder}
    (out / "meta.json").write_text(json.dumps(meta))
    return meta


def load_index(path: Path):
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise RetrieverIndexError(
            f"{path} is not an index: build one with `python -m cloudrl.trainer.search.retriever_server "
            f"build-index --corpus CORPUS.jsonl --out {path}`"
        )
    meta = json.loads(meta_file.read_text())
    docs = read_corpus(path / "corpus.jsonl")
    if meta["kind"] == "dense":
        return DenseIndex.load(path, docs, meta["encoder"])
    return BM25Index.load(path, docs)


class BadRequest(Exception):
    """A request the server refuses: the message (one line) and the HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def raw_answer(status: int, error: str) -> bytes:
    """A whole HTTP response with {"error": error}, for answers sent outside a handler's own flow."""
    reasons = {408: "Request Timeout", 503: "Service Unavailable"}
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.0 {status} {reasons.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def parse_request(body: bytes, default_topk: int) -> tuple[list[str], int, bool]:
    try:
        req = json.loads(body)
    except RecursionError:
        raise BadRequest('the body nests too deep: send a flat {"queries": [...]} object') from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest('the body is not JSON: send {"queries": [...], "topk": k, "return_scores": bool}') from None
    queries = req.get("queries") if isinstance(req, dict) else None
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest('"queries" must be a list of strings')
    if len(queries) > MAX_QUERIES:
        raise BadRequest(f"{len(queries)} queries in one request; send at most {MAX_QUERIES}")
    topk = req.get("topk") or default_topk
    if not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise BadRequest(f'"topk" must be an integer from 1 to {MAX_TOPK}, got {topk!r}')
    if len(queries) * topk > MAX_PASSAGES:
        raise BadRequest(
            f"{len(queries)} queries x topk {topk} asks for more than {MAX_PASSAGES} passages in one reply: "
            f"split the queries over several requests"
        )
    return queries, topk, bool(req.get("return_scores", False))


class LimitedServer(ThreadingHTTPServer):
    """A thread per connection, at most `max_clients` at once (past that an immediate 503), for handlers
    derived from `LimitedHandler`: `timeout_s` of silence drops a client, and a request must arrive whole
    within twice that. The reward server (trainer/inputs/reward_server.py) is one too; the limits live here
    because this file must stand alone on nodes without cloudrl."""

    daemon_threads = True
    what = "the server"
    """How 503 answers name it."""

    def __init__(self, address: tuple[str, int], handler, timeout_s: float, max_clients: int = MAX_CLIENTS):
        self.timeout_s, self.max_clients = timeout_s, max_clients
        self.clients = threading.BoundedSemaphore(max_clients)
        self.slots: dict = {}
        """Each open connection's semaphore (`clients` when it was accepted), released by its own thread."""
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        """A thread per connection, up to max_clients at once; past that an immediate 503."""
        clients = self.clients
        if not clients.acquire(blocking=False):
            try:
                request.sendall(raw_answer(503, f"{self.what} serves {self.max_clients} connections at once: retry"))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.slots[request] = clients
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.pop(request).release()

    def handle_error(self, request, client_address):
        """A client that went away mid-request (dropped as too slow, or gone) is no error worth a traceback."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class RetrieverServer(LimitedServer):
    what = "the retriever"

    def __init__(self, address: tuple[str, int], index, topk: int = 3, timeout_s: float = 30.0):
        self.index, self.topk = index, topk
        self.queries_served = 0
        self.lock = threading.Lock()  # one search at a time: the index is not thread-safe
        super().__init__(address, _Handler, timeout_s)

    def retrieve(self, queries: list[str], topk: int, with_scores: bool) -> list[list]:
        with self.lock:
            ids, scores = self.index.search(queries, topk) if queries else ([], [])
            self.queries_served += len(queries)
        docs = self.index.docs
        size = sum(len(docs[i].get("contents", "")) for row in ids for i in row if i >= 0)
        if size > MAX_REPLY_BYTES:
            raise BadRequest(
                f"the reply would hold {size} characters of documents, more than {MAX_REPLY_BYTES}: "
                f"send fewer queries or a smaller topk",
                413,
            )
        if with_scores:
            return [
                [{"document": docs[i], "score": float(s)} for i, s in zip(row, srow) if i >= 0]
                for row, srow in zip(ids, scores)
            ]
        return [[docs[i] for i in row if i >= 0] for row in ids]


class LimitedHandler(BaseHTTPRequestHandler):
    """A handler for `LimitedServer`: a client silent for the server's `timeout_s` is dropped, and one
    whose request has not arrived whole within twice that (a slow drip) gets a 408. Every answer is sent
    after `_arrived()` (or `read_body`, which calls it) said True."""

    server: LimitedServer

    def setup(self):
        self.timeout = self.server.timeout_s  # a client silent this long is dropped
        self._state = threading.Lock()
        self._deadline = None
        self._late = False
        super().setup()

    def handle_one_request(self):
        """One request, which must arrive whole within twice the timeout: the per-read timeout alone
        never drops a client that drips a byte at a time."""
        self._late = False
        self._deadline = threading.Timer(2 * self.server.timeout_s, self._too_slow)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            super().handle_one_request()
        finally:
            with self._state:
                if self._deadline is not None:  # not read whole (`_arrived` stops it once it was)
                    self._deadline.cancel()
                    self._deadline = None

    def _too_slow(self) -> None:
        with self._state:
            if self._deadline is None:  # the request arrived meanwhile
                return
            self._late = True
        limit = 2 * self.server.timeout_s
        try:
            self.request.sendall(raw_answer(408, f"the request did not arrive within {limit:g} s: send it whole"))
            self.request.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _arrived(self) -> bool:
        """The request has been read: stop its deadline. False when the deadline already answered it."""
        with self._state:
            if self._late:
                self.close_connection = True
                return False
            self._deadline.cancel()
            self._deadline = None
            return True

    def read_body(self, max_bytes: int) -> bytes | None:
        """The request's body, whose Content-Length must be 0 to `max_bytes`: a missing one gets 411, one
        that is negative or not a number 400, a larger one 413, each answered unread. None when refused,
        when the deadline answered it, or when the client went away mid-body."""
        raw = self.headers.get("Content-Length")
        try:
            length = -1 if raw is None else int(raw)
        except ValueError:
            length = -2
        if not 0 <= length <= max_bytes:
            self.close_connection = True
            if not self._arrived():
                return None
            status = 411 if raw is None else 400 if length < 0 else 413
            self._send(status, {"error": f"send a Content-Length of at most {max_bytes} bytes"})
            return None
        body = self.rfile.read(length)
        if not self._arrived():
            return None
        if len(body) < length:  # the client went away mid-body
            self.close_connection = True
            return None
        return body

    def log_message(self, format, *args):  # one line per request would flood a job's log
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Handler(LimitedHandler):
    server: RetrieverServer

    def do_GET(self):
        if not self._arrived():
            return
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"error": f"no endpoint {self.path}: use POST /retrieve or GET /health"})
        s = self.server
        self._send(
            200,
            {"status": "ok", "documents": len(s.index.docs), "index": s.index.kind, "queries_served": s.queries_served},
        )

    def do_POST(self):
        if self.path.rstrip("/") != "/retrieve":
            if not self._arrived():
                return
            return self._send(404, {"error": f"no endpoint {self.path}: use POST /retrieve or GET /health"})
        body = self.read_body(MAX_BODY_BYTES)
        if body is None:
            return
        try:
            queries, topk, with_scores = parse_request(body, self.server.topk)
            self._send(200, {"result": self.server.retrieve(queries, topk, with_scores)})
        except BadRequest as e:
            self._send(e.status, {"error": str(e)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloudrl.trainer.search.retriever_server")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-index", help="index a JSONL corpus")
    b.add_argument("--corpus", required=True, type=Path)
    b.add_argument("--out", required=True, type=Path)
    b.add_argument("--dense", action="store_true", help="a dense index (faiss) instead of BM25")
    b.add_argument("--encoder", help="encoder model directory or hub name (with --dense)")
    s = sub.add_parser("serve", help="serve an index on /retrieve and /health")
    s.add_argument("--index", required=True, type=Path)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--topk", type=int, default=3, help="passages per query when a request names none")
    s.add_argument("--timeout-s", type=float, default=30.0, help="drop a client that stalls this long")
    args = parser.parse_args(argv)
    try:
        if args.command == "build-index":
            if args.dense and not args.encoder:
                raise RetrieverIndexError("--dense needs --encoder PATH (a transformers encoder model)")
            meta = build_index(args.corpus, args.out, args.encoder if args.dense else None)
            print(f"indexed {meta['documents']} documents ({meta['kind']}) into {args.out}", flush=True)
            return 0
        server = RetrieverServer((args.host, args.port), load_index(args.index), args.topk, args.timeout_s)
    except (RetrieverIndexError, OSError) as e:
        if os.environ.get("CLOUDRL_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"retriever serving {len(server.index.docs)} documents on http://{args.host}:{server.server_port}/retrieve",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
Bad requests get HTTP 400 with {"error": one line}. Request bodies, queries per request and topk are
bounded, and a client that stalls mid-request is dropped after `--timeout-s`.

The module stands alone (the standard library, plus bm25s or faiss and transformers for the index), so
the cluster bundle ships this one file to every node and runs it as `python retriever_server.py serve`
(tasks/ray-bootstrap.sh), where cloudrl itself is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_BODY_BYTES = 1 << 20
MAX_QUERIES = 1024
MAX_TOPK = 100


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
    pass


def parse_request(body: bytes, default_topk: int) -> tuple[list[str], int, bool]:
    try:
        req = json.loads(body)
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
    return queries, topk, bool(req.get("return_scores", False))


class RetrieverServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], index, topk: int = 3, timeout_s: float = 30.0):
        self.index, self.topk, self.timeout_s = index, topk, timeout_s
        self.queries_served = 0
        self.lock = threading.Lock()  # one search at a time: the index is not thread-safe
        super().__init__(address, _Handler)

    def retrieve(self, queries: list[str], topk: int, with_scores: bool) -> list[list]:
        with self.lock:
            ids, scores = self.index.search(queries, topk) if queries else ([], [])
            self.queries_served += len(queries)
        docs = self.index.docs
        if with_scores:
            return [
                [{"document": docs[i], "score": float(s)} for i, s in zip(row, srow) if i >= 0]
                for row, srow in zip(ids, scores)
            ]
        return [[docs[i] for i in row if i >= 0] for row in ids]


class _Handler(BaseHTTPRequestHandler):
    server: RetrieverServer

    def setup(self):
        self.timeout = self.server.timeout_s  # a stalled client is dropped
        super().setup()

    def log_message(self, format, *args):  # one line per request would flood a job's log
        pass

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"error": f"no endpoint {self.path}: use POST /retrieve or GET /health"})
        s = self.server
        self._send(
            200,
            {"status": "ok", "documents": len(s.index.docs), "index": s.index.kind, "queries_served": s.queries_served},
        )

    def do_POST(self):
        if self.path.rstrip("/") != "/retrieve":
            return self._send(404, {"error": f"no endpoint {self.path}: use POST /retrieve or GET /health"})
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            return self._send(
                400 if length < 0 else 413, {"error": f"send a Content-Length of at most {MAX_BODY_BYTES} bytes"}
            )
        try:
            queries, topk, with_scores = parse_request(self.rfile.read(length), self.server.topk)
            self._send(200, {"result": self.server.retrieve(queries, topk, with_scores)})
        except BadRequest as e:
            self._send(400, {"error": str(e)})


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

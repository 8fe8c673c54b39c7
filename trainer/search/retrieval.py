"""The trainer's client for a retriever speaking Search-R1's `/retrieve` API (see retriever_server.py).

Rollout workers query the server on their own node (`search.url`, 127.0.0.1 by default) once per turn
with every running sample's query. The server bounds each request (queries, queries x topk passages, body
bytes: the constants in retriever_server.py, which this client reads, so both sides share one limit), so
a large batch goes out as several POSTs, one after another, and the results come back in the queries'
order. A request that times out or finds no server is retried `search.retries` times with a short
back-off; then the rollout stops with one line naming the URL.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from ..errors import TrainerError
from . import retriever_server as limits


class RetrieverUnavailable(TrainerError, ConnectionError):
    """The retriever did not answer, or answered with an error."""


class RetrievalClient:
    def __init__(self, url: str, topk: int = 3, timeout_s: float = 10.0, retries: int = 2):
        self.url, self.topk, self.timeout_s, self.retries = url, topk, timeout_s, retries

    @classmethod
    def from_config(cls, search_cfg) -> RetrievalClient:
        return cls(search_cfg.url, search_cfg.topk, search_cfg.timeout_s, search_cfg.retries)

    def retrieve(self, queries: list[str]) -> list[list[dict]]:
        """Each query's passages as `{"document": {...}, "score": s}`, best first."""
        result: list[list[dict]] = []
        for chunk in self.requests(queries):
            result += self._post(chunk)
        return result

    def requests(self, queries: list[str]) -> list[list[str]]:
        """`queries` split, in order, into the fewest consecutive requests the server accepts: at most
        MAX_QUERIES queries, MAX_PASSAGES passages (queries x topk) and MAX_BODY_BYTES of JSON each."""
        per_request = max(1, min(limits.MAX_QUERIES, limits.MAX_PASSAGES // max(self.topk, 1)))
        empty = len(json.dumps({"queries": [], "topk": self.topk, "return_scores": True}))
        chunks: list[list[str]] = []
        size = empty
        for query in queries:
            # json.dumps escapes every non-ASCII character, so its length is the body's byte count;
            # 2 more for the ", " that joins it to the query before.
            grows = len(json.dumps(query)) + 2
            if not chunks or len(chunks[-1]) >= per_request or size + grows > limits.MAX_BODY_BYTES:
                chunks.append([])
                size = empty
            chunks[-1].append(query)
            size += grows
        return chunks

    def _post(self, queries: list[str]) -> list[list[dict]]:
        """One request; retried while the server cannot be reached."""
        body = json.dumps({"queries": queries, "topk": self.topk, "return_scores": True}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
            request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    result = json.loads(resp.read())["result"]
                break
            except urllib.error.HTTPError as e:  # the server understood and refused: retrying will not help
                raise RetrieverUnavailable(
                    f"retriever at {self.url} answered HTTP {e.code}: {_error_line(e)}"
                ) from None
            except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
                problem = str(getattr(e, "reason", e)) or type(e).__name__
        else:
            raise RetrieverUnavailable(
                f"no retriever answers at {self.url} ({problem}, {self.retries + 1} tries): start one on this node "
                "(python -m cloudrl.trainer.search.retriever_server serve --index DIR) or set search.url"
            )
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrieverUnavailable(f"retriever at {self.url} sent {len(result)} results for {len(queries)} queries")
        return result

    def passages(self, queries: list[str]) -> list[list[str]]:
        """The `search` function of the turn loop: each query's passage texts."""
        return [[_contents(item) for item in row] for row in self.retrieve(queries)]


def _contents(item) -> str:
    doc = item.get("document", item) if isinstance(item, dict) else item
    return str(doc.get("contents", "")) if isinstance(doc, dict) else str(doc)


def _error_line(e: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(e.read()).get("error", e.reason))
    except (ValueError, AttributeError, OSError):
        return str(e.reason)

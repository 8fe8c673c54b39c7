"""Rewards scored by an HTTP service (`reward.url`): a reward model or judge served anywhere.

Each batch of completions goes out as consecutive requests of at most `reward.url_batch_size` samples,
`reward.url_max_concurrency` of them in flight at once:

    POST reward.url    {"items": [{"prompt": "...", "response": "...", "ground_truth": "..."}, ...]}
    200                {"scores": [0.5, 1.0, ...]}          one finite number per item, in order

A request that cannot connect, times out, loses its connection or gets HTTP 5xx or 429 is retried
`reward.url_retries` times with back-off (0.5 s, 1 s, 2 s, ... at most 8 s); any other HTTP error, or an
answer that is not that shape, ends the step at once with one line naming the URL. `reward.url_timeout_s`
bounds each request whole, from connecting to the answer's last byte, so a scorer that drips its answer
times out like a silent one. An answer is read up to `answer_limit` bytes (1 MiB plus 4 KiB an item, at
most 64 MiB); a longer one is refused. No redirect is followed: any HTTP 3xx is refused, so the request
and its token go to reward.url and nowhere else. Error lines name an answer's status, size and content
type, never its body.

With `reward.url_token_env=NAME` the value of the environment variable NAME goes out as
`Authorization: Bearer ...`, only over https:// or to a loopback host unless `reward.url_insecure_http`
says otherwise (urls.py `token_problem`, which config_checks applies too); NAME may not be one of the
infrastructure's own secrets. The value is never printed, and no proxy reads
it (with a token, the environment's proxies serve https:// only, through a tunnel).
`python -m cloudrl.trainer.inputs.reward_server` serves a reward function or a local
sequence-classification model this way.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..errors import RewardError
from ..urls import shown_url, token_problem

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 8.0
MAX_ANSWER_BYTES = 64 << 20
"""The most bytes read of any one answer, whatever the batch (see `answer_limit`)."""


def answer_limit(items: int) -> int:
    """The most bytes read of the answer to a request of `items` items: 1 MiB plus 4 KiB an item (room
    for a scorer's extra fields), at most MAX_ANSWER_BYTES."""
    return min(MAX_ANSWER_BYTES, (1 << 20) + 4096 * items)


class RemoteReward:
    """A reward function `fn(completions, prompts, ground_truth, **columns) -> list[float]` that asks an
    HTTP scorer."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        max_concurrency: int = 4,
        batch_size: int = 64,
        token_env: str = "",
        insecure_http: bool = False,
    ):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.max_concurrency, self.batch_size, self.token_env = max_concurrency, batch_size, token_env
        self.insecure_http = insecure_http
        self.shown = shown_url(url)

    @classmethod
    def from_config(cls, reward) -> RemoteReward:
        """From `Config.reward`."""
        return cls(
            reward.url,
            reward.url_timeout_s,
            reward.url_retries,
            reward.url_max_concurrency,
            reward.url_batch_size,
            reward.url_token_env,
            getattr(reward, "url_insecure_http", False),
        )

    def __call__(self, completions: list[str], prompts: list[str], ground_truth: list, **columns) -> list[float]:
        items = [{"prompt": p, "response": c, "ground_truth": g} for c, p, g in zip(completions, prompts, ground_truth)]
        batches = [items[i : i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        if not batches:
            return []
        headers = self._headers()
        with ThreadPoolExecutor(min(self.max_concurrency, len(batches)), thread_name_prefix="reward-url") as pool:
            parts = list(pool.map(lambda batch: self._post(batch, headers), batches))
        return [value for part in parts for value in part]

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.token_env:
            problem = token_problem(self.url, self.token_env, self.insecure_http)
            if problem:
                raise RewardError(problem)
            token = os.environ.get(self.token_env, "")
            if not token:
                raise RewardError(
                    f"reward.url_token_env={self.token_env} names an environment variable that is not set here: "
                    f"set {self.token_env} on every node (cloudrl submit --env {self.token_env}) or clear the key"
                )
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _post(self, items: list[dict], headers: dict[str, str]) -> list[float]:
        """One request, retried while the scorer cannot be reached, times out or answers 5xx/429."""
        body = json.dumps({"items": items}).encode()
        limit = answer_limit(len(items))
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            request = urllib.request.Request(self.url, body, headers, method="POST")
            deadline = _Deadline(self.timeout_s)
            try:
                with _opener(deadline, "Authorization" in headers).open(request, timeout=self.timeout_s) as resp:
                    answer, kind = _read_bounded(resp, limit), _content_type(resp.headers)
                if deadline.passed:  # the connection was shut at the deadline, which may read as a short answer
                    raise TimeoutError
                break
            except urllib.error.HTTPError as e:
                e.close()
                if deadline.passed:
                    problem = f"no whole answer within reward.url_timeout_s={self.timeout_s:g}s"
                    continue
                if 300 <= e.code < 400:
                    raise RewardError(
                        f"reward.url {self.shown} answered HTTP {e.code}, a redirect ({_kind(e.headers)}): no "
                        f"redirect is followed, so the request and its token go nowhere else: point reward.url "
                        f"at the scorer itself"
                    ) from None
                if e.code not in RETRY_STATUSES:
                    raise RewardError(
                        f"reward.url {self.shown} answered HTTP {e.code} ({_kind(e.headers)}): {_status_fix(e.code)}"
                    ) from None
                problem = f"HTTP {e.code}"
            except _AnswerTooLong as e:
                raise RewardError(
                    f"reward.url {self.shown} answered more than {limit} bytes ({e}) for {len(items)} items: the "
                    f'answer should be {{"scores": [...]}}, one number per item; fix the scorer, or lower '
                    f"reward.url_batch_size"
                ) from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                if deadline.passed:
                    problem = f"no whole answer within reward.url_timeout_s={self.timeout_s:g}s"
                    continue
                reason = getattr(e, "reason", e)
                if isinstance(reason, http.client.HTTPException) or not str(reason):
                    problem = type(reason).__name__  # its text may quote what the scorer sent
                else:
                    problem = f"{type(reason).__name__}: {reason}"
            finally:
                deadline.cancel()
        else:
            raise RewardError(
                f"reward.url {self.shown} failed {self.retries + 1} times ({problem[:200]}): start the scorer "
                f"(python -m cloudrl.trainer.inputs.reward_server), or raise reward.url_timeout_s or reward.url_retries"
            )
        return self._scores(answer, kind, len(items))

    def _scores(self, answer: bytes, kind: str, count: int) -> list[float]:
        want = f'it must answer {{"scores": [...]}} with {count} finite numbers, one per item, in order'
        try:
            scores = json.loads(answer)["scores"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise RewardError(f"reward.url {self.shown} answered {len(answer)} bytes of {kind}: {want}") from None
        if not isinstance(scores, list) or len(scores) != count:
            got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
            raise RewardError(f"reward.url {self.shown} sent {got} for {count} items: {want}")
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                shown = repr(value) if isinstance(value, numbers.Real) else type(value).__name__
                raise RewardError(f"reward.url {self.shown} sent {shown} at index {i}: {want}")
        return [float(v) for v in scores]


class _AnswerTooLong(Exception):
    """An answer past its limit; the message says what its headers declared."""


class _Deadline:
    """One request's deadline: at `seconds` it shuts the request's connection down, wherever the request
    waits (connecting, TLS, sending, the answer's headers or body), so a scorer that drips bytes cannot hold
    it past the deadline. A read it cut short may look like a short answer: check `passed` after it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.passed = self._done = False
        self._handles: list[socket.socket] = []
        """A duplicate of each connection's socket: shutting it down ends the connection for every handle,
        the TLS layer's included (which takes over the original socket object when it wraps it)."""
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def connect(self, address, timeout=None, source_address=None, **kwargs) -> socket.socket:
        """socket.create_connection, waiting no longer than the deadline, for the connection to register."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed before connecting")
        sock = socket.create_connection(address, left, source_address, **kwargs)
        with self._lock:
            if self.passed or self._done:
                sock.close()
                raise TimeoutError("the deadline passed while connecting")
            self._handles.append(sock.dup())
        return sock

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.passed = True
            for handle in self._handles:
                try:
                    handle.shutdown(socket.SHUT_RDWR)
                except OSError:  # not connected any more
                    pass

    def cancel(self) -> None:
        """The request is over: stop the timer and let the duplicates go."""
        self._timer.cancel()
        with self._lock:
            self._done = True
            for handle in self._handles:
                handle.close()
            self._handles.clear()


def _connection_class(base: type[http.client.HTTPConnection], deadline: _Deadline):
    def make(host, **kwargs) -> http.client.HTTPConnection:
        conn = base(host, **kwargs)
        conn._create_connection = deadline.connect  # http.client's own hook for opening the socket
        return conn

    return make


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_connection_class(http.client.HTTPConnection, self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_connection_class(http.client.HTTPSConnection, self.deadline), req)


def _opener(deadline: _Deadline, with_token: bool) -> urllib.request.OpenerDirector:
    """An opener with no redirect handler, so any 3xx raises HTTPError, and every connection under
    `deadline`. The environment's proxies serve it, but with a token only for https:// (a tunnel: the
    proxy never reads the token), never a plain http:// proxy that would."""
    opener = urllib.request.OpenerDirector()
    proxies = urllib.request.getproxies()
    if with_token:
        proxies = {k: v for k, v in proxies.items() if k == "https"}
    for handler in (
        urllib.request.ProxyHandler(proxies),
        urllib.request.UnknownHandler(),
        _HTTPHandler(deadline),
        _HTTPSHandler(deadline),
        urllib.request.HTTPDefaultErrorHandler(),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


def _read_bounded(resp, limit: int) -> bytes:
    """The answer's body, refused (_AnswerTooLong) past `limit` bytes: by its Content-Length before any
    is read, else once it has read limit + 1."""
    declared = resp.headers.get("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _AnswerTooLong(f"Content-Length {int(declared)}, {_kind(resp.headers)}")
    chunks, size = [], 0
    while size <= limit:
        chunk = resp.read(min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise _AnswerTooLong(f"{size} bytes read and more to come, {_kind(resp.headers)}")
    return b"".join(chunks)


def _content_type(headers) -> str:
    """An answer's content type, short, for error lines."""
    if headers is None:
        return "no content type"
    return (headers.get("Content-Type") or "no content type").split(";")[0].strip()[:60] or "no content type"


def _kind(headers) -> str:
    """An answer's content type and declared size, for error lines (never its body)."""
    kind = _content_type(headers)
    length = headers.get("Content-Length") if headers is not None else None
    size = f"{length.strip()[:20]} bytes" if length is not None else "no Content-Length"
    return f"{kind}, {size}"


def _status_fix(code: int) -> str:
    """The fix for an HTTP error that is not retried."""
    if code in (401, 403):
        return "the scorer refused the token: set reward.url_token_env to the variable holding the one it expects"
    if code == 413:
        return "the scorer refused the request's size: lower reward.url_batch_size"
    if code == 404:
        return "no scorer at that path: check reward.url (the reference server serves /score)"
    return 'fix the scorer or the request it expects ({"items": [{prompt, response, ground_truth}]})'

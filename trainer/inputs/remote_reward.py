"""Rewards scored by an HTTP service (`reward.url`): a reward model or judge served anywhere.

Each batch of completions goes out as consecutive requests of at most `reward.url_batch_size` samples,
`reward.url_max_concurrency` of them in flight at once:

    POST reward.url    {"items": [{"prompt": "...", "response": "...", "ground_truth": "..."}, ...]}
    200                {"scores": [0.5, 1.0, ...]}          one finite number per item, in order

A request that cannot connect, times out (`reward.url_timeout_s`), loses its connection or gets HTTP 5xx
or 429 is retried `reward.url_retries` times with back-off (0.5 s, 1 s, 2 s, ... at most 8 s); any other
HTTP error, or an answer that is not that shape, ends the step at once with one line naming the URL.
With `reward.url_token_env=NAME` the value of the environment variable NAME goes out as
`Authorization: Bearer ...`; the value is never printed. `python -m cloudrl.trainer.inputs.reward_server`
serves a reward function or a local sequence-classification model this way.
"""

from __future__ import annotations

import http.client
import json
import math
import numbers
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..errors import RewardError

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 8.0


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
    ):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        self.max_concurrency, self.batch_size, self.token_env = max_concurrency, batch_size, token_env
        self.shown = _shown(url)

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
            token = os.environ.get(self.token_env, "")
            if not token:
                raise RewardError(
                    f"reward.url_token_env={self.token_env} names an environment variable that is not set here: "
                    f"set {self.token_env} on every node (cloudrl submit --env {self.token_env}) or clear the key"
                )
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _post(self, items: list[dict], headers: dict[str, str]) -> list[float]:
        """One request, retried while the scorer cannot be reached or answers 5xx/429."""
        body = json.dumps({"items": items}).encode()
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), _MAX_BACKOFF_S))
            request = urllib.request.Request(self.url, body, headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                    answer = resp.read()
                break
            except urllib.error.HTTPError as e:
                if e.code not in RETRY_STATUSES:
                    raise RewardError(
                        f"reward.url {self.shown} answered HTTP {e.code} ({_error_text(e)}): fix the scorer or "
                        f'the request it expects ({{"items": [{{prompt, response, ground_truth}}]}})'
                    ) from None
                problem = f"HTTP {e.code}"
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                reason = getattr(e, "reason", e)
                problem = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
        else:
            raise RewardError(
                f"reward.url {self.shown} failed {self.retries + 1} times ({problem[:200]}): start the scorer "
                f"(python -m cloudrl.trainer.inputs.reward_server), or raise reward.url_timeout_s or reward.url_retries"
            )
        return self._scores(answer, len(items))

    def _scores(self, answer: bytes, count: int) -> list[float]:
        want = f'it must answer {{"scores": [...]}} with {count} finite numbers, one per item, in order'
        try:
            scores = json.loads(answer)["scores"]
        except (ValueError, KeyError, TypeError):
            raise RewardError(f"reward.url {self.shown} answered {answer[:80]!r}: {want}") from None
        if not isinstance(scores, list) or len(scores) != count:
            got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
            raise RewardError(f"reward.url {self.shown} sent {got} for {count} items: {want}")
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise RewardError(f"reward.url {self.shown} sent {value!r} at index {i}: {want}")
        return [float(v) for v in scores]


def _shown(url: str) -> str:
    """The URL for messages, without any user:password@ part."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _error_text(e: urllib.error.HTTPError) -> str:
    """The error a scorer sent (`{"error": ...}` or its first line), short."""
    try:
        raw = e.read()[:2000]
    except OSError:
        return str(e.reason)
    try:
        text = str(json.loads(raw).get("error", ""))
    except (ValueError, AttributeError):
        text = raw.decode("utf-8", errors="replace")
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else str(e.reason)

"""A reference scorer for `reward.url`: serves a reward function or a local sequence-classification model.

    python -m cloudrl.trainer.inputs.reward_server --function gsm8k --port 8900
    python -m cloudrl.trainer.inputs.reward_server --function rewards/mine.py:score --port 8900
    python -m cloudrl.trainer.inputs.reward_server --model /models/rm --port 8900 --device cuda

    POST /score   {"items": [{"prompt": ..., "response": ..., "ground_truth": ...}, ...]}
              ->  {"scores": [...]}           (errors: {"error": "..."} with HTTP 4xx or 500)
    GET /health   {"ok": true}

It binds 127.0.0.1 unless told otherwise, and refuses any other address without `--token-env NAME`
(requests must then send `Authorization: Bearer <value of NAME>`). A request needs a Content-Length of
at most MAX_BODY_BYTES (411 without one, 400 for a negative one, 413 past it, each answered unread) and
must arrive whole within twice `--timeout-s` (408), a client silent for `--timeout-s` is dropped, and at
most MAX_CLIENTS (64) connections are served at once (more get 503): the retriever server's limits,
defined once in trainer/search/retriever_server.py. A model scores `prompt + response`
by its first logit, as `reward.model_path` does. An LLM judge is not built in: serve one with
`--function` pointing at your own function that asks it.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import sys
import threading
from collections.abc import Callable

from ..search.retriever_server import LimitedHandler, LimitedServer

MAX_BODY_BYTES = 64 << 20
"""Largest request accepted (a batch of long responses fits easily)."""

Scorer = Callable[[list[dict]], list[float]]
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RewardServer(LimitedServer):
    """`timeout_s`: a client silent this long is dropped; its request must arrive whole within twice it."""

    what = "the reward server"

    def __init__(self, address: tuple[str, int], scorer: Scorer, token: str = "", timeout_s: float = 60.0):
        self.scorer, self.token = scorer, token
        # One batch at a time: a model's forward passes and most reward functions are not thread-safe.
        self.lock = threading.Lock()
        super().__init__(address, _Handler, timeout_s)


class _Handler(LimitedHandler):
    server: RewardServer

    def do_GET(self) -> None:
        if not self._arrived():
            return
        if self.path.rstrip("/") == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": "POST /score, or GET /health"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") not in ("", "/score"):
            refusal = (404, "POST /score")
        elif self.server.token and not self._authorized():
            refusal = (401, "missing or wrong Authorization: Bearer token")
        else:
            refusal = None
        if refusal:
            self.close_connection = True  # its body, if any, stays unread
            if self._arrived():
                self._send(refusal[0], {"error": refusal[1]})
            return
        body = self.read_body(MAX_BODY_BYTES)
        if body is None:
            return
        try:
            items = json.loads(body)["items"]
            if not isinstance(items, list) or not all(isinstance(i, dict) and "response" in i for i in items):
                raise ValueError("items must be a list of {prompt, response, ground_truth}")
        except RecursionError:
            self._send(400, {"error": 'the body nests too deep: send {"items": [{prompt, response, ground_truth}]}'})
            return
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": f'expected {{"items": [{{prompt, response, ground_truth}}]}}: {exc}'})
            return
        try:
            with self.server.lock:
                scores = [float(s) for s in self.server.scorer(items)]
        except Exception as exc:
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(200, {"scores": scores})

    def _authorized(self) -> bool:
        sent = self.headers.get("Authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {self.server.token}".encode())


def function_scorer(spec: str) -> Scorer:
    """A scorer calling a reward function (`reward.function` syntax) on a batch, as the trainer would."""
    from .rewards import resolve_reward_fn

    fn = resolve_reward_fn(spec)

    def scorer(items: list[dict]) -> list[float]:
        return list(
            fn(
                [i["response"] for i in items],
                prompts=[i.get("prompt", "") for i in items],
                ground_truth=[i.get("ground_truth", "") for i in items],
                data_source=[i.get("data_source", "") for i in items],
            )
        )

    return scorer


def model_scorer(path: str, device: str = "cpu", micro_batch_size: int = 16) -> Scorer:
    """A scorer running a local AutoModelForSequenceClassification on `prompt + response` (first logit)."""
    import torch

    from .models import load_reward_model, load_tokenizer

    model = load_reward_model(path, "float32" if device == "cpu" else "bfloat16").to(device).eval()
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "right"

    @torch.no_grad()
    def scorer(items: list[dict]) -> list[float]:
        texts = [i.get("prompt", "") + i["response"] for i in items]
        out: list[float] = []
        for start in range(0, len(texts), micro_batch_size):
            enc = tokenizer(texts[start : start + micro_batch_size], return_tensors="pt", padding=True).to(device)
            out += model(**enc).logits[:, 0].float().cpu().tolist()
        return out

    return scorer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cloudrl.trainer.inputs.reward_server", description=__doc__)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--function", help="a reward function: a built-in name, module:fn or file.py:fn")
    what.add_argument("--model", help="a local AutoModelForSequenceClassification directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8900, help="port (0: any free one, printed)")
    parser.add_argument("--token-env", default="", help="environment variable holding the bearer token")
    parser.add_argument("--device", default="cpu", help="the model's device (cpu, cuda)")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=60.0,
        help="drop a client silent this long; a request must arrive whole within twice it (default 60)",
    )
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env, "") if args.token_env else ""
    if args.token_env and not token:
        print(f"error: --token-env {args.token_env}: that environment variable is not set; set it", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and not token:
        print(
            f"error: --host {args.host} serves other machines: give a token with --token-env NAME, "
            "or keep the default 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    from ..errors import TrainerError

    try:
        scorer = function_scorer(args.function) if args.function else model_scorer(args.model, args.device)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = RewardServer((args.host, args.port), scorer, token, args.timeout_s)
    host, port = server.server_address[:2]
    print(f"serving rewards on http://{host}:{port}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

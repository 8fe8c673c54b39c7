"""reward.url against real HTTP servers on 127.0.0.1: order across batches and concurrency, timeouts and
retries, 5xx then success, dropped connections, bad answers, the token, and the reference server."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from cloudrl.trainer.errors import RewardError
from cloudrl.trainer.inputs.remote_reward import RemoteReward
from cloudrl.trainer.inputs.reward_server import RewardServer, function_scorer
from cloudrl.trainer.inputs.rewards import resolve_reward


class Scorer(ThreadingHTTPServer):
    """A test scorer: `answer(server, items) -> (status, body)`, or None to drop the connection."""

    daemon_threads = True

    def __init__(self, answer):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer, self.calls, self.headers, self.in_flight, self.most = answer, 0, [], 0, 0
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        server: Scorer = self.server
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        with server.lock:
            server.calls += 1
            server.headers.append(dict(self.headers))
            server.in_flight += 1
            server.most = max(server.most, server.in_flight)
        try:
            got = server.answer(server, items)
        finally:
            with server.lock:
                server.in_flight -= 1
        if got is None:
            self.connection.close()
            return
        status, body = got
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def serve():
    servers = []

    def start(answer) -> Scorer:
        servers.append(Scorer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _lengths(server, items):
    time.sleep(0.05)
    return 200, {"scores": [float(len(i["response"])) for i in items]}


def test_scores_arrive_in_order_across_batches_and_concurrency(serve):
    server = serve(_lengths)
    completions = ["x" * i for i in range(23)]
    remote = RemoteReward(server.url, timeout_s=5, retries=0, max_concurrency=3, batch_size=4)
    assert remote(completions, prompts=["p"] * 23, ground_truth=["g"] * 23) == [float(i) for i in range(23)]
    assert server.calls == 6
    assert 1 < server.most <= 3


def test_a_slow_server_times_out_and_is_retried(serve):
    def slow_once(server, items):
        if server.calls == 1:
            time.sleep(1.5)
        return 200, {"scores": [1.0] * len(items)}

    server = serve(slow_once)
    assert RemoteReward(server.url, timeout_s=0.5, retries=2)(["a"], prompts=["p"], ground_truth=["g"]) == [1.0]
    assert server.calls == 2


def test_a_server_error_then_success(serve):
    server = serve(lambda s, items: (500, {"error": "warming up"}) if s.calls < 3 else (200, {"scores": [0.5]}))
    assert RemoteReward(server.url, timeout_s=2, retries=3)(["a"], prompts=["p"], ground_truth=["g"]) == [0.5]
    assert server.calls == 3


def test_closed_connections_fail_after_the_retries_with_one_line(serve, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-secret-99")
    server = serve(lambda s, items: None)
    remote = RemoteReward(server.url, timeout_s=2, retries=1, token_env="RM_TOKEN")
    with pytest.raises(RewardError) as err:
        remote(["a"], prompts=["p"], ground_truth=["g"])
    message = str(err.value)
    assert server.calls == 2
    assert message.startswith(f"reward.url {server.url} failed 2 times") and "\n" not in message
    assert "tok-secret-99" not in message
    assert all(h["Authorization"] == "Bearer tok-secret-99" for h in server.headers)


@pytest.mark.parametrize(
    "body, problem",
    [({"scores": [1.0]}, "sent 1 scores for 2 items"), ({"scores": [1.0, float("nan")]}, "sent nan at index 1")],
)
def test_a_wrong_answer_fails_at_once_with_one_line(serve, body, problem):
    server = serve(lambda s, items: (200, body))
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=2, retries=3)(["a", "b"], prompts=["p"] * 2, ground_truth=["g"] * 2)
    assert problem in str(err.value) and "\n" not in str(err.value)
    assert server.calls == 1


def test_a_missing_token_variable_is_named_not_sent(serve, monkeypatch):
    monkeypatch.delenv("RM_TOKEN", raising=False)
    server = serve(_lengths)
    with pytest.raises(RewardError, match="reward.url_token_env=RM_TOKEN names an environment variable"):
        RemoteReward(server.url, token_env="RM_TOKEN")(["a"], prompts=["p"], ground_truth=["g"])
    assert server.calls == 0


def test_the_reference_server_serves_a_reward_function_end_to_end(monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-7")
    server = RewardServer(("127.0.0.1", 0), function_scorer("arithmetic"), token="tok-7")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    reward = SimpleNamespace(
        function="exact_match",
        url=url,
        url_weight=2.0,
        url_timeout_s=5.0,
        url_retries=0,
        url_max_concurrency=2,
        url_batch_size=2,
        url_token_env="RM_TOKEN",
    )
    try:
        fn = resolve_reward(reward)
        columns = {"prompts": ["1+1="] * 3, "ground_truth": ["2"] * 3, "data_source": ["arithmetic"] * 3}
        # exact_match (1 for "2") + 2 x arithmetic from the server (1 when it starts with 2).
        assert fn(["2", "2 apples", "3"], **columns) == [3.0, 2.0, 0.0]
        with pytest.raises(RewardError, match="answered HTTP 401"):
            RemoteReward(url, retries=0)(["2"], prompts=["p"], ground_truth=["2"])
    finally:
        server.shutdown()
        server.server_close()

"""reward.url against real HTTP servers on 127.0.0.1: order across batches and concurrency, timeouts and
retries, 5xx then success, dropped connections, bad answers, the token, and the reference server; no
redirect followed (the token stays with reward.url), a whole-request deadline against a dripping scorer, a
bounded answer, error lines without an answer's body, and where the token may go (config_checks)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import ConfigError, RewardError
from cloudrl.trainer.inputs import remote_reward
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
        if callable(got):  # writes its own answer on the connection
            self.close_connection = True
            got(self)
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


# ----------------------------------------------------------------------------------------------
# Redirects, the deadline, the answer's size, error lines (security review S5-7, S5-8, S5-9)
# ----------------------------------------------------------------------------------------------

CANARY = "ASIA-METADATA-CANARY"


class Elsewhere(ThreadingHTTPServer):
    """Another host (127.0.0.2): records what reaches it, answers a credential-like body to anything."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.2", 0), _ElsewhereHandler)
        self.seen: list[tuple[str, str, str]] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ElsewhereHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        self.server.seen.append((self.command, self.path, self.headers.get("Authorization", "")))
        data = json.dumps({"AccessKeyId": CANARY, "scores": [1.0]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


@pytest.fixture
def elsewhere():
    server = Elsewhere()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_and_the_token_goes_nowhere_else(serve, elsewhere, monkeypatch, status):
    monkeypatch.setenv("RM_TOKEN", "tok-redirect-5")
    target = f"http://127.0.0.2:{elsewhere.server_address[1]}/latest/meta-data/iam/security-credentials/role"

    def redirect(handler):
        body = f"moved to {target} {CANARY}".encode()
        handler.send_response(status)
        handler.send_header("Location", target)
        handler.send_header("Content-Type", "text/plain")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = serve(lambda s, items: redirect)
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=5, retries=2, token_env="RM_TOKEN")(["a"], prompts=["p"], ground_truth=["g"])
    message = str(err.value)
    assert f"answered HTTP {status}, a redirect (text/plain, " in message
    assert "point reward.url at the scorer itself" in message and "\n" not in message
    assert CANARY not in message and "tok-redirect-5" not in message and "127.0.0.2" not in message
    assert elsewhere.seen == []  # nothing, token or not, reached the other host
    assert server.calls == 1  # not retried


def _drip(head: bytes, body: bytes, where: str, every_s: float = 0.2):
    """An answer that sends `head` then `body`, the part named by `where` one byte every `every_s`."""

    def write(handler) -> None:
        try:
            for part, slow in ((head, where == "head"), (body, where == "body")):
                if not slow:
                    handler.wfile.write(part)
                    handler.wfile.flush()
                    continue
                for i in range(len(part)):
                    handler.wfile.write(part[i : i + 1])
                    handler.wfile.flush()
                    time.sleep(every_s)
        except OSError:  # the client gave up
            pass

    return write


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_dripping_scorer_fails_at_the_deadline(serve, where):
    body = b'{"scores": [1.0]}' + b" " * 23  # 40 bytes: 8 s at a byte every 0.2 s
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    server = serve(lambda s, items: _drip(head, body, where))
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=1, retries=0)(["a"], prompts=["p"], ground_truth=["g"])
    took = time.monotonic() - start
    assert 0.9 < took < 3, took  # never silent for 1 s, yet cut at the 1 s deadline
    message = str(err.value)
    assert "failed 1 times (no whole answer within reward.url_timeout_s=1s)" in message and "\n" not in message


def test_the_deadline_is_per_attempt_and_a_retry_can_succeed(serve):
    body = b'{"scores": [2.0]}'
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    server = serve(lambda s, items: _drip(head, body, "body") if s.calls == 1 else (200, {"scores": [3.0]}))
    assert RemoteReward(server.url, timeout_s=1, retries=1)(["a"], prompts=["p"], ground_truth=["g"]) == [3.0]
    assert server.calls == 2


@pytest.fixture
def tls(tmp_path, monkeypatch):
    """(cert, key) of a self-signed certificate for 127.0.0.1, which this process trusts."""
    if not shutil.which("openssl"):
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    return cert, key


def test_over_https_the_token_goes_and_the_deadline_holds(serve, tls, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-tls-8")
    body = b'{"scores": [1.0]}' + b" " * 23
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    server = serve(lambda s, items: _drip(head, body, "body") if s.calls > 1 else (200, {"scores": [0.5]}))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*tls)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    url = server.url.replace("http://", "https://")
    remote = RemoteReward(url, timeout_s=1, retries=0, token_env="RM_TOKEN")
    assert remote(["a"], prompts=["p"], ground_truth=["g"]) == [0.5]
    assert server.headers[0]["Authorization"] == "Bearer tok-tls-8"
    start = time.monotonic()
    with pytest.raises(RewardError, match="no whole answer within reward.url_timeout_s=1s"):
        remote(["a"], prompts=["p"], ground_truth=["g"])  # the TLS layer's reads are cut at the deadline too
    assert 0.9 < time.monotonic() - start < 3


def _raw(head: str, chunks, sent: list[int] | None = None):
    def write(handler) -> None:
        try:
            handler.wfile.write(head.encode())
            for chunk in chunks:
                handler.wfile.write(chunk)
                if sent is not None:
                    sent[0] += len(chunk)
        except OSError:
            pass

    return write


def test_an_answer_past_its_limit_is_refused_by_its_declared_length(serve):
    limit = remote_reward.answer_limit(1)
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {10 << 30}\r\n\r\n"
    server = serve(lambda s, items: _raw(head, [b'{"scores": [1.0' + b" " * 1000]))
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=5, retries=2)(["a"], prompts=["p"], ground_truth=["g"])
    assert time.monotonic() - start < 3  # refused at once, not read until the deadline
    message = str(err.value)
    assert f"answered more than {limit} bytes (Content-Length {10 << 30}, application/json" in message
    assert "lower reward.url_batch_size" in message and "\n" not in message
    assert server.calls == 1


def test_an_answer_of_unknown_length_is_read_up_to_its_limit_only(serve):
    limit = remote_reward.answer_limit(1)
    sent = [0]
    endless = (b", 1.0" * 200_000 for _ in range(1000))  # 1 MB a chunk, up to 1 GB: far past the limit
    head = "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"  # no length: the body runs to EOF
    server = serve(lambda s, items: _raw(head, [b'{"scores": [1.0', *endless], sent))
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=20, retries=0)(["a"], prompts=["p"], ground_truth=["g"])
    message = str(err.value)
    assert f"answered more than {limit} bytes ({limit + 1} bytes read and more to come" in message
    assert sent[0] < 100 * limit  # the scorer stopped soon after: the reader closed the connection


@pytest.mark.parametrize(
    "answer, words",
    [
        ((400, {"error": f"bad input, see {CANARY}"}), "answered HTTP 400 (no content type, "),
        ((200, f"<html>{CANARY}</html>"), "answered 35 bytes of no content type: it must answer"),
        ((200, {"scores": [CANARY]}), "sent str at index 0"),
    ],
)
def test_error_lines_never_hold_the_answers_body(serve, answer, words):
    server = serve(lambda s, items: answer)
    with pytest.raises(RewardError) as err:
        RemoteReward(server.url, timeout_s=5, retries=0)(["a"], prompts=["p"], ground_truth=["g"])
    message = str(err.value)
    assert words in message and CANARY not in message and "\n" not in message


# ----------------------------------------------------------------------------------------------
# Where the token may go (S5-10)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, extra, refused",
    [
        ("http://10.0.0.5:8900/score", [], "is plain http:// to another host"),
        ("http://scorer.internal/score", [], "is plain http:// to another host"),
        ("http://10.0.0.5:8900/score", ["reward.url_insecure_http=true"], None),
        ("https://scorer.example.com/score", [], None),
        ("http://127.0.0.1:8900/score", [], None),
        ("http://127.0.0.2:8900/score", [], None),
        ("http://localhost:8900/score", [], None),
        ("http://[::1]:8900/score", [], None),
    ],
)
def test_the_token_goes_over_https_or_to_loopback_only(url, extra, refused):
    overrides = [f"reward.url={url}", "reward.url_token_env=RM_TOKEN", *extra]
    if refused is None:
        assert load_config("local", overrides).reward.url == url
        return
    with pytest.raises(ConfigError) as err:
        load_config("local", overrides)
    message = str(err.value)
    assert refused in message and "use an https:// address" in message and "reward.url_insecure_http=true" in message
    assert "\n" not in message
    load_config("local", [f"reward.url={url}"])  # without a token, plain http anywhere is fine


@pytest.mark.parametrize("name", ["RAY_AUTH_TOKEN", "AWS_SECRET_ACCESS_KEY", "aws_session_token", "HF_TOKEN"])
def test_the_token_variable_is_not_an_infrastructure_secret(name):
    with pytest.raises(ConfigError, match=f"reward.url_token_env={name} names one of the infrastructure's own"):
        load_config("local", ["reward.url=https://scorer.example.com/score", f"reward.url_token_env={name}"])


@pytest.mark.parametrize(
    "url, env, words",
    [
        ("http://10.255.255.1:9/score", "RM_TOKEN", "is plain http:// to another host"),
        ("https://10.255.255.1:9/score", "AWS_SECRET_ACCESS_KEY", "names one of the infrastructure's own secrets"),
    ],
)
def test_the_token_is_refused_at_run_time_too_before_any_request(monkeypatch, url, env, words):
    monkeypatch.setenv("RM_TOKEN", "tok-plain-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-2")
    start = time.monotonic()
    with pytest.raises(RewardError) as err:
        RemoteReward(url, timeout_s=30, retries=0, token_env=env)(["a"], prompts=["p"], ground_truth=["g"])
    assert time.monotonic() - start < 1  # refused before connecting anywhere
    message = str(err.value)
    assert words in message and "tok-plain-1" not in message and "aws-secret-2" not in message

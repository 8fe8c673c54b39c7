"""Servers and ports the tests share: a free loopback port, a real S3-compatible server (moto) on 127.0.0.1, a
stand-in for a cloud's instance metadata service (its preemption notice), and a raw HTTP client for the
request limits of cloudrl's own servers (the reward server, the retriever)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator


def raw_exchange(port: int, data: bytes, keep_sending: bool = False) -> tuple[bytes, float]:
    """Send `data` to 127.0.0.1:`port` and read the whole answer (at most 8 s); with `keep_sending`, go on
    sending a body that never ends until the server answers. Returns the answer and the seconds it took."""
    start = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=8) as s:
        s.sendall(data)
        if keep_sending:
            s.settimeout(0.05)
            while time.monotonic() - start < 8:
                try:
                    s.sendall(b" " * 65536)
                except OSError:  # a full buffer (timeout) or a closed connection
                    pass
                try:
                    chunk = s.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                answer += chunk
                if not chunk or b"\r\n\r\n" in answer:
                    break
            s.settimeout(2)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    return answer, time.monotonic() - start


def error_line(answer: bytes) -> str:
    """The one-line error of a raw HTTP answer whose JSON body is {"error": ...} (and nothing else)."""
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert list(body) == ["error"] and "\n" not in body["error"]
    return body["error"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 in a subprocess; yields its URL and stops it on exit. A port taken
    between choosing it and moto binding it (Ray's workers bind ports too) is retried with another."""
    for _attempt in range(3):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        if _answers_as_moto(url, proc):
            break
        proc.terminate()
        proc.wait(timeout=30)
    else:
        raise AssertionError("moto's S3 server did not start on 3 ports")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _answers_as_moto(url: str, proc: subprocess.Popen) -> bool:
    """True once moto itself answers at url (within 60 s); False if it exited, so another process holds it."""
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return proc.poll() is None and "ListAllMyBucketsResult" in response.read().decode(errors="replace")
        except OSError:
            time.sleep(0.2)
    return False


class MetadataService:
    """A stand-in for one cloud's instance metadata service on 127.0.0.1 (the real one is link-local on a cloud
    instance), answering the preemption-notice requests of tasks/ray_bringup.py `notices` as AWS (IMDSv2:
    token, then the spot instance-action), GCP (`preempted`, with its Metadata-Flavor header) or Azure
    (Scheduled Events) does: no notice until `announce()`, then one that ends `lead_s` seconds later. Each
    cloud checks its own request header, as the real services do."""

    def __init__(self, cloud: str, lead_s: float = 120.0):
        import http.server
        import threading

        self.cloud, self.lead_s = cloud, lead_s
        self.announced_at: float | None = None
        self.requests: list[str] = []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_PUT(self):
                service.requests.append(f"PUT {self.path}")
                if service.cloud == "aws" and self.path == "/latest/api/token":
                    return self.answer(200, "token-1")
                self.answer(404, "")

            def do_GET(self):
                service.requests.append(f"GET {self.path}")
                self.answer(*service.answer(self.path, self.headers))

            def answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                if service.cloud == "gcp":
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def announce(self) -> None:
        self.announced_at = time.time()

    def answer(self, path: str, headers) -> tuple[int, str]:
        import datetime
        import email.utils

        at = self.announced_at
        end = (at or 0) + self.lead_s
        if self.cloud == "aws" and path == "/latest/meta-data/spot/instance-action":
            if headers.get("X-aws-ec2-metadata-token") != "token-1":
                return 401, ""
            if at is None:
                return 404, ""
            when = datetime.datetime.fromtimestamp(end, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            return 200, json.dumps({"action": "terminate", "time": when})
        if self.cloud == "gcp" and path == "/computeMetadata/v1/instance/preempted":
            if headers.get("Metadata-Flavor") != "Google":
                return 403, ""
            return 200, "TRUE" if at is not None else "FALSE"
        if self.cloud == "azure" and path.startswith("/metadata/scheduledevents"):
            if headers.get("Metadata") != "true":
                return 400, ""
            events = []
            if at is not None:
                when = email.utils.formatdate(end, usegmt=True)
                events = [
                    {"EventId": "e1", "EventType": "Preempt", "ResourceType": "VirtualMachine", "NotBefore": when}
                ]
            return 200, json.dumps({"DocumentIncarnation": 1, "Events": events})
        return 404, ""

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

"""Servers and ports the tests share: a free loopback port, a real S3-compatible server (moto) on 127.0.0.1, and
a raw HTTP client for the request limits of cloudrl's own servers (the reward server, the retriever)."""

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

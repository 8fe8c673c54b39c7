"""A RAY_ADDRESS that still accepts TCP connections but is no Ray GCS (a port forward whose far end is
gone, a stuck process, another service on the old port) fails in seconds with one line, where Ray's own
connect would retry for minutes; a real GCS passes the same probe."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
from cloudrl.trainer.errors import ClusterUnreachable
from cloudrl.trainer.roles.cluster import probe
from runs import run_trainer


@contextlib.contextmanager
def listener(answer: bytes | None = None, close: bool = False):
    """A TCP listener on 127.0.0.1 that accepts and then says nothing (`answer` None), says `answer`, or
    closes the connection at once (`close`). Yields its host:port."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if close:
                conn.close()
                continue
            if answer is not None:
                conn.sendall(answer)
            accepted.append(conn)  # held open, silent

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


@pytest.mark.parametrize(
    "kind, words",
    [
        ({}, "no answer within 1 s"),
        ({"close": True}, "closed the connection"),
        ({"answer": b"HTTP/1.1 400 Bad Request\r\n\r\n"}, "not HTTP/2"),
    ],
)
def test_a_listener_that_is_no_gcs_fails_the_probe_in_seconds(kind, words):
    with listener(**kind) as address:
        start = time.monotonic()
        with pytest.raises(ClusterUnreachable) as err:
            probe(address, "RAY_ADDRESS", timeout_s=1.0)
        took = time.monotonic() - start
    message = str(err.value)
    assert took < 3, took
    assert message.startswith(f"RAY_ADDRESS={address}: no Ray cluster answers there (it accepts connections")
    assert words in message and "unset RAY_ADDRESS" in message and "\n" not in message


def test_trainer_with_a_stale_ray_address_ends_in_seconds_with_one_line(tmp_path):
    with listener() as address:
        start = time.monotonic()
        result = run_trainer(f"trainer.run_dir={tmp_path / 'run'}", env={"RAY_ADDRESS": address}, timeout=120)
        took = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: RAY_ADDRESS={address}: no Ray cluster answers"), lines
    assert "no answer within 3 s" in lines[0] and "Traceback" not in result.stderr
    assert took < 60, took  # Python, torch and the config load; the probe itself takes 3 s


@pytest.mark.ray
def test_a_real_gcs_passes_the_probe(ray_local):
    probe(ray_local, "RAY_ADDRESS", timeout_s=3.0)  # raises if Ray's GCS does not answer as gRPC

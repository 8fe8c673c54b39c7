"""Helpers for the CLI tests: run `cloudrl` for real, start and stop the servers the tests need.

Every process started here is stopped by PID in a `finally`; every server binds 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import getpass
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests
from servers import free_port

VENV_BIN = Path(sys.executable).parent
CLOUDRL = str(VENV_BIN / "cloudrl")
# A short run of the real trainer on the built-in tiny model.
SHORT_RUN = ["trainer.total_steps=2", "model.sft_warmup_steps=0"]


def cli_env(cache: Path, **extra: str) -> dict[str, str]:
    """The environment for a `cloudrl` subprocess: its own state dir, no inherited Ray address."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "CLOUDRL_DEBUG")}
    env.update(
        CLOUDRL_CACHE=str(cache),
        CLOUDRL_LOCAL_DASHBOARD_PORT="0",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        **extra,
    )
    return env


def run_cli(
    args: list[str], env: dict[str, str], timeout: float = 180, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run([CLOUDRL, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def local_state(cache: Path) -> dict | None:
    path = cache / "local-cluster.json"
    return json.loads(path.read_text()) if path.exists() else None


def pids_alive(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def process_tree(pid: int) -> list[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return [pid] + [c.pid for c in proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def local_auth(cache: Path) -> dict[str, str]:
    """The Authorization header for the local cluster whose state is in `cache` (token auth is always on)."""
    state = local_state(cache) or {}
    token = Path(state["token_file"]).read_text().strip() if state.get("token_file") else ""
    return {"Authorization": f"Bearer {token}"} if token else {}


def wait_for_job_status(
    address: str, job_id: str, wanted: set[str], timeout: float, headers: dict[str, str] | None = None
) -> str:
    deadline = time.monotonic() + timeout
    status = "?"
    while time.monotonic() < deadline:
        r = requests.get(f"{address}/api/jobs/{job_id}", headers=headers, timeout=5)
        if r.status_code == 200:
            status = r.json()["status"]
            if status in wanted:
                return status
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} is {status}, not one of {wanted}, after {timeout} s")


def job_count(address: str, headers: dict[str, str] | None = None) -> int:
    return len(requests.get(f"{address}/api/jobs/", headers=headers, timeout=5).json())


@contextlib.contextmanager
def stop_on_exit(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@dataclass
class LocalCluster:
    """A running `cloudrl local` cluster, as the CLI tests use it (tests/cli/conftest.py starts it)."""

    url: str
    cache: Path
    """Its CLOUDRL_CACHE: the state file, the token file and the CLI's model cache."""
    env: dict[str, str]
    """The environment of `cloudrl` subprocesses that reach it (`--local` reads the state in `cache`)."""
    state: dict
    """`local-cluster.json` as `up` wrote it."""
    token: str
    auth: dict[str, str]
    """The Authorization header with its token: `local up` always turns token auth on."""
    pids: list[int] = field(default_factory=list)
    """The processes of its nodes when `up` returned."""


# ----------------------------------------------------------------------------------------------
# Fake edges
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 in a thread, running `handler`; yields its URL, stopped on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def version_faking_proxy(upstream: str, fake_version: str) -> Iterator[str]:
    """A proxy to a real dashboard that changes only the Ray version /api/version reports."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            auth = {k: v for k, v in self.headers.items() if k.lower() == "authorization"}
            r = requests.get(f"{upstream}{self.path}", headers=auth, timeout=10)
            body = r.content
            if self.path.split("?")[0] == "/api/version" and r.status_code == 200:
                data = r.json()
                data["ray_version"] = fake_version
                body = json.dumps(data).encode()
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            raise AssertionError("the preflight must fail before anything is posted")

        def log_message(self, *args: object) -> None:
            pass

    with serve(Handler) as url:
        yield url


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """Accepts TCP connections and never answers: a tunnel whose far end hangs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


# ----------------------------------------------------------------------------------------------
# sshd
# ----------------------------------------------------------------------------------------------

SSHD = "/usr/sbin/sshd"


def sshd_unavailable() -> str | None:
    """Why a test sshd cannot run here, or None."""
    if not Path(SSHD).exists():
        return "no sshd here (apt-get install -y openssh-server)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return "no ssh client here (apt-get install -y openssh-client)"
    if not Path("/run/sshd").is_dir() and os.geteuid() != 0:
        return "sshd needs its privilege-separation dir /run/sshd, and creating it needs root"
    return None


@contextlib.contextmanager
def sshd(tmp: Path) -> Iterator[tuple[int, list[str]]]:
    """A real sshd on 127.0.0.1 with a temp host key; yields its port and the ssh -o options to log in."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)], check=True)
    (tmp / "authorized_keys").write_text((tmp / "client_key.pub").read_text())
    os.chmod(tmp / "authorized_keys", 0o600)
    port = free_port()
    (tmp / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {tmp / 'host_key'}\n"
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nAllowTcpForwarding yes\n"
        f"PermitRootLogin prohibit-password\nPidFile {tmp / 'sshd.pid'}\n"
    )
    proc = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "sshd.log", "wb"),
        start_new_session=True,
    )
    with stop_on_exit(proc):
        deadline = time.monotonic() + 10
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"sshd exited: {(tmp / 'sshd.log').read_text()[-500:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise AssertionError("sshd did not listen within 10 s")
            time.sleep(0.1)
        options = [
            f"Port={port}",
            f"IdentityFile={tmp / 'client_key'}",
            "UserKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=no",
            "LogLevel=ERROR",
            "IdentitiesOnly=yes",
        ]
        yield port, options


def ssh_user() -> str:
    return getpass.getuser()


def send_sigint(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# Popen options for a command the test will Ctrl+C. A shell that starts jobs in the background
# without job control (`.ci/run &`, many CI runners) sets SIGINT to "ignore" for them, and that
# inheritance would make Python ignore Ctrl+C too; a user's terminal never does.
INTERRUPTIBLE = {"preexec_fn": _sigint_as_in_a_terminal}


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs of live processes whose environment has name=value (marks what one test started)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(name) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found

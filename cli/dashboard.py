"""`cloudrl dashboard`: bring a cluster's Ray dashboard to 127.0.0.1 on this machine.

Two ways, one result (a local URL that `cloudrl submit --address` and a browser can use):
- a dstack run (the default): dstack's Python API attaches to the run's head with `bind_address`
  127.0.0.1 and a local port we choose for the container's 8265. When `dstack apply` or
  `dstack attach` already holds a tunnel to the run, dstack reuses it and reports its ports; we
  then print that URL and leave the tunnel to its owner.
- `--ssh HOST` for clusters not made by dstack (Slurm, hand-made): a plain `ssh -N -L`, so the
  user's ~/.ssh/config, agent and ProxyJump all apply.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cloudrl.trainer.errors import ClusterUnreachable

from .errors import CloudrlError
from .local_cluster import Echo, port_free
from .pins import DASHBOARD_PORT
from .ray_api import Address, AuthRefused, ClusterClient, check_port

TASK_FILE = Path("tasks") / "ray-cluster.dstack.yml"
SSH_READY_TIMEOUT_S = 30.0
SSH_READY_TIMEOUT_TTY_S = 120.0  # time to type a password or passphrase


@dataclass
class Forward:
    url: str
    owned: bool
    """False when another process (`dstack apply`/`dstack attach`) holds the tunnel."""
    close: Callable[[], None]
    alive: Callable[[], bool] = lambda: True


# ----------------------------------------------------------------------------------------------
# Ports and names
# ----------------------------------------------------------------------------------------------


def default_run_name() -> str:
    """The `name:` of tasks/ray-cluster.dstack.yml (in the current directory, else in this checkout)."""
    import yaml

    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        path = base / TASK_FILE
        if path.is_file():
            try:
                name = (yaml.safe_load(path.read_text()) or {}).get("name")
            except yaml.YAMLError:
                name = None
            if name:
                return str(name)
    raise CloudrlError(
        f"no {TASK_FILE} here to take the run name from: name the run, "
        f"`cloudrl dashboard RUN` (`dstack ps` lists your runs)"
    )


def pick_local_port(wanted: int | None) -> int:
    """`wanted` if given (0 = any free port); else 8265 (the CLI's default address) if free, else any."""
    if wanted:
        if not port_free(wanted):
            raise CloudrlError(f"--port {wanted} is in use on 127.0.0.1: pick another --port, or 0 for any free one")
        return wanted
    if wanted is None and port_free(DASHBOARD_PORT):
        return DASHBOARD_PORT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# dstack
# ----------------------------------------------------------------------------------------------


def forward_dstack(run_name: str | None, port: int | None, remote_port: int = DASHBOARD_PORT) -> Forward:
    from .dstack_compat import dstack_api

    # First: without dstack, this is the one line that names the fix.
    PortMapping = dstack_api(", or use `cloudrl dashboard --ssh HOST`").PortMapping
    import dstack.api as dstack_client

    name = run_name or default_run_name()
    try:
        client = dstack_client.Client.from_config()
        run = client.runs.get(name)
    except Exception as exc:
        raise _dstack_error(
            exc, "reach the dstack server (is `dstack server` running and `dstack project` configured?)"
        ) from None
    if run is None:
        raise CloudrlError(
            f"no dstack run named {name!r} in project {client.project!r}: start it with "
            f"`dstack apply -f {TASK_FILE}`, or name one that `dstack ps` lists"
        )
    if run.status != dstack_client.RunStatus.RUNNING:
        state = getattr(run.status, "value", run.status)
        hint = (
            "wait until `dstack ps` shows it running, then run this again"
            if state in ("pending", "submitted", "provisioning")
            else f"start it again with `dstack apply -f {TASK_FILE}`"
        )
        raise CloudrlError(f"dstack run {name!r} is {state}, not running: {hint}")
    local = pick_local_port(port)
    try:
        attached = run.attach(
            bind_address="127.0.0.1", ports_overrides=[PortMapping(local_port=local, container_port=remote_port)]
        )
    except Exception as exc:
        if "not exposed" in str(exc):
            raise CloudrlError(
                f"dstack run {name!r} does not expose port {remote_port}: list it under `ports:` "
                f"in its task file ({TASK_FILE} does) and apply it again"
            ) from None
        raise _dstack_error(exc, f"attach to run {name!r}") from None
    if not attached:
        raise CloudrlError(f"dstack run {name!r} ended before it could be attached: `dstack logs {name}` says why")
    forwarded = (run.ports or {}).get(remote_port)
    if forwarded is None:  # a tunnel held by another process that does not carry the dashboard
        run.detach()
        raise CloudrlError(
            f"the tunnel dstack holds for {name!r} does not forward port {remote_port}: "
            f"stop that `dstack attach`/`dstack apply` and run this again"
        )
    return Forward(f"http://127.0.0.1:{forwarded}", owned=forwarded == local, close=run.detach)


def _dstack_error(exc: Exception, what: str) -> Exception:
    if not type(exc).__module__.startswith("dstack"):
        return exc  # not dstack's: a bug, keep the traceback
    return CloudrlError(f"dstack could not {what}: {str(exc).strip() or type(exc).__name__}")


# ----------------------------------------------------------------------------------------------
# ssh
# ----------------------------------------------------------------------------------------------


def forward_ssh(
    host: str, port: int | None, remote_port: int = DASHBOARD_PORT, ssh_options: list[str] | None = None
) -> Forward:
    if host.startswith("-"):
        # ssh would read it as an option (`-oProxyCommand=...` runs a command here).
        raise CloudrlError(f"--ssh {host!r} is not a host name: a host never starts with '-' (give user@host)")
    ssh = shutil.which("ssh")
    if ssh is None:
        raise CloudrlError("the `ssh` command is not installed here: install OpenSSH's client")
    interactive = sys.stdin.isatty()
    local = pick_local_port(port)
    args = [
        ssh,
        "-N",
        "-L",
        f"127.0.0.1:{local}:127.0.0.1:{remote_port}",
        "-o",
        "ExitOnForwardFailure=yes",
        "-o",
        "ServerAliveInterval=15",
        "-o",
        "ServerAliveCountMax=3",
        "-o",
        "ConnectTimeout=10",
    ]
    if not interactive:
        args += ["-o", "BatchMode=yes"]  # no terminal: fail instead of waiting on a password prompt
    for option in ssh_options or []:
        args += ["-o", option]
    args += ["--", host]  # the end of the options: whatever `host` says, it is the destination
    errors = tempfile.TemporaryFile()
    # With a terminal, ssh shares it (and our process group) to ask for a password if it must.
    proc = subprocess.Popen(
        args,
        stdin=None if interactive else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=errors,
        start_new_session=not interactive,
    )

    def stderr_tail() -> str:
        errors.seek(0)
        lines = [ln for ln in errors.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1].strip() if lines else "no message"

    def close() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        errors.close()

    url = f"http://127.0.0.1:{local}"
    probe = ClusterClient(Address(url, "--address"))
    deadline = time.monotonic() + (SSH_READY_TIMEOUT_TTY_S if interactive else SSH_READY_TIMEOUT_S)
    last = "no answer yet"
    while True:
        if proc.poll() is not None:
            message = stderr_tail()
            close()
            hint = ""
            if "Permission denied" in message and not interactive:
                hint = ": no terminal to type a password, so use a key (ssh-copy-id, or -o IdentityFile=KEY)"
            elif "Could not resolve hostname" in message:
                hint = (
                    ": the name does not resolve here; check its spelling, give the head's IP address "
                    "(user@10.0.0.5), or add a `Host` entry with its HostName to ~/.ssh/config"
                )
            raise CloudrlError(f"ssh to {host} exited ({message}){hint}")
        try:
            probe.ray_version()
            return Forward(url, owned=True, close=close, alive=lambda: proc.poll() is None)
        except AuthRefused:  # the forward works: the cluster wants a token, and waiting will not bring one
            close()
            raise
        except (ClusterUnreachable, CloudrlError) as exc:
            last = str(exc).split(" (", 1)[-1].split(")", 1)[0]
        if time.monotonic() > deadline:
            close()
            raise CloudrlError(
                f"ssh to {host} is connected, but nothing answers on its 127.0.0.1:{remote_port} "
                f"({last}): is the Ray head running there with its dashboard on port "
                f"{remote_port}? (--remote-port sets another)"
            )
        time.sleep(0.3)


# ----------------------------------------------------------------------------------------------
# Holding the forward
# ----------------------------------------------------------------------------------------------


def describe(forward: Forward, what: str) -> str:
    try:
        version = f"Ray {ClusterClient(Address(forward.url, '--address')).ray_version()}"
    except (ClusterUnreachable, CloudrlError):
        version = "the dashboard does not answer yet; the cluster may still be starting"
    lines = [f"Ray dashboard of {what}: {forward.url}  ({version})"]
    flag = "" if forward.url.endswith(f":{DASHBOARD_PORT}") else f" --address {forward.url}"
    lines.append(f"submit:  cloudrl submit{flag}")
    if forward.owned:
        lines.append("forwarding until Ctrl+C")
    else:
        lines.append(
            "this tunnel belongs to the `dstack apply` or `dstack attach` that opened it; it stays up while that runs"
        )
    return "\n".join(lines)


def hold(forward: Forward) -> None:
    """Keep the forward until Ctrl+C or until it dies; always closes what we own."""
    interrupted = False
    try:
        _wait_for_interrupt(forward)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        forward.close()
    if not interrupted:
        raise CloudrlError(
            f"the forward to {forward.url} stopped by itself (the connection dropped): run `cloudrl dashboard` again"
        )


def _wait_for_interrupt(forward: Forward) -> None:
    while forward.alive():
        time.sleep(0.5)


def run_dashboard(
    run_name: str | None, ssh_host: str | None, port: int | None, remote_port: int, ssh_options: list[str], echo: Echo
) -> None:
    check_port("--port", port, zero_means_any=True)
    check_port("--remote-port", remote_port)
    if ssh_host:
        if run_name:
            raise CloudrlError("pass either a dstack RUN or --ssh HOST, not both")
        forward, what = forward_ssh(ssh_host, port, remote_port, ssh_options), ssh_host
    else:
        if ssh_options:
            raise CloudrlError("--ssh-option only applies with --ssh HOST")
        forward = forward_dstack(run_name, port, remote_port)
        what = f"dstack run {run_name or default_run_name()}"
    echo(describe(forward, what))
    if forward.owned:
        hold(forward)

"""`cloudrl local up/down`: a Ray cluster of N nodes on this machine, so submit, dashboard, logs and
stop work with no cloud.

Each node is one `ray start --block` process in its own session, with its own temp dir and its own
ports (picked free, so clusters of other users or tests on the same machine are left alone). The
state file ($CLOUDRL_CACHE or ~/.cache/cloudrl, `local-cluster.json`) records every node's PID and
start time; `down` stops exactly those process trees and their process groups, never `ray stop`
(which would stop every Ray on the machine). The state is written as each node starts, so a failed
or interrupted `up` is torn down completely.

Ray turns 127.0.0.1 into the machine's own IP for its node address, so the GCS and raylet ports
listen on the machine's interfaces as with any `ray start` (without token authentication, see
`_node_env`); the dashboard (and the Jobs API) binds 127.0.0.1 only. Use it on a trusted network.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .errors import CloudrlError

STATE_NAME = "local-cluster.json"
DEFAULT_DASHBOARD_PORT = 8265
NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")
HEAD_PORTS = ("port", "ray-client-server-port")

Echo = Callable[[str], None]
_STARTED: list[subprocess.Popen] = []


# ----------------------------------------------------------------------------------------------
# State
# ----------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("CLOUDRL_CACHE") or Path.home() / ".cache" / "cloudrl")


def state_path() -> Path:
    return cache_dir() / STATE_NAME


def load_state() -> dict[str, Any] | None:
    path = state_path()
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise CloudrlError(f"{path} is not readable JSON: stop any Ray processes it named by hand, then delete it") from None


def _save_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def running_dashboard_url() -> str | None:
    """The dashboard URL of the local cluster if its head process is still alive."""
    state = load_state()
    if state and state.get("nodes") and _alive(state["nodes"][0]) and state.get("dashboard_url"):
        return state["dashboard_url"]
    return None


# ----------------------------------------------------------------------------------------------
# Up
# ----------------------------------------------------------------------------------------------


def local_preset_cpus() -> int:
    """CPUs the `local` preset's roles reserve, so a default local cluster can run it."""
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.placement import plan

    return math.ceil(sum(req.total("CPU") for req in plan(load_config("local"))))


def default_cpus_per_node(nodes: int) -> int:
    """The machine's cores split over the nodes, at least 2, and enough in total for the local preset.

    These are Ray's logical CPUs (what it schedules by), so they may exceed the physical cores.
    """
    cores = os.cpu_count() or 2
    return max(2, cores // nodes, math.ceil(local_preset_cpus() / nodes))


def default_dashboard_port() -> int:
    """8265 (the CLI's default address) unless CLOUDRL_LOCAL_DASHBOARD_PORT says otherwise (0 = any free)."""
    value = os.environ.get("CLOUDRL_LOCAL_DASHBOARD_PORT", "")
    try:
        return int(value) if value else DEFAULT_DASHBOARD_PORT
    except ValueError:
        raise CloudrlError(f"CLOUDRL_LOCAL_DASHBOARD_PORT={value!r} is not a port number") from None


def up(nodes: int = 1, cpus_per_node: int | None = None, gpus_per_node: int | None = None,
       object_store_mb: int = 512, dashboard_port: int | None = None, timeout_s: float = 120.0,
       echo: Echo = print) -> dict[str, Any]:
    """Start the cluster and wait until all its nodes are alive; tear everything down on failure."""
    if dashboard_port is None:
        dashboard_port = default_dashboard_port()
    if nodes < 1:
        raise CloudrlError(f"--nodes {nodes}: a cluster needs at least 1 node")
    existing = load_state()
    if existing:
        if existing.get("nodes") and _alive(existing["nodes"][0]):
            raise CloudrlError(f"a local cluster is already running ({existing.get('dashboard_url')}): "
                               f"use it with --local, or stop it with `cloudrl local down`")
        echo("cleaning up a local cluster that is no longer running")
        _teardown(existing)
    ray_exe = _ray_executable()
    cpus = cpus_per_node or default_cpus_per_node(nodes)
    if gpus_per_node is None and nodes > 1:
        gpus_per_node = 0  # Ray would give every node all of the machine's GPUs
    root = tempfile.mkdtemp(prefix="cloudrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    state: dict[str, Any] = {"root": root, "nodes": [], "dashboard_url": None, "cpus_per_node": cpus,
                             "num_nodes": nodes}
    _save_state(state)
    try:
        dash = _pick_dashboard_port(dashboard_port, echo)
        ports = _free_ports(len(HEAD_PORTS) + len(NODE_PORTS) * nodes, exclude={dash})
        head_ports = dict(zip(HEAD_PORTS, ports[: len(HEAD_PORTS)]))
        url = f"http://127.0.0.1:{dash}"
        gcs = f"127.0.0.1:{head_ports['port']}"
        state.update(dashboard_url=url, gcs_address=gcs)
        for i in range(nodes):
            node_ports = dict(zip(NODE_PORTS, ports[len(HEAD_PORTS) + i * len(NODE_PORTS):]))
            args = [ray_exe, "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                    f"--num-cpus={cpus}", f"--object-store-memory={object_store_mb * 1024 * 1024}",
                    f"--temp-dir={root}/n{i}", "--min-worker-port=0", "--max-worker-port=0"]
            if gpus_per_node is not None:
                args.append(f"--num-gpus={gpus_per_node}")
            if i == 0:
                args += ["--head", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                         f"--dashboard-port={dash}"] + [f"--{k}={v}" for k, v in head_ports.items()]
            else:
                args.append(f"--address={gcs}")
            args += [f"--{k}={v}" for k, v in node_ports.items()]
            state["nodes"].append(_spawn(args, Path(root) / f"n{i}.log"))
            _save_state(state)
            if i == 0:  # workers join a head whose GCS answers; the dashboard comes up right after it
                _wait_for(lambda: _dashboard_answers(url), state, timeout_s, "the head's dashboard to answer")
        _wait_for(lambda: _alive_nodes(url) >= nodes, state, timeout_s, f"{nodes} nodes to join")
    except CloudrlError as exc:
        kept = _keep_logs(state)
        _teardown(state)
        raise CloudrlError(f"{exc} (node logs: {kept})") from None
    except BaseException:
        _teardown(state)
        raise
    return state


def _keep_logs(state: dict[str, Any]) -> Path:
    """Copy the nodes' `ray start` logs out of the temp dir that teardown deletes."""
    kept = cache_dir() / "local-up-failed"
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True, exist_ok=True)
    for node in state.get("nodes", []):
        with contextlib.suppress(OSError):
            shutil.copy(node["log"], kept)
    return kept


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return str(beside)
    found = shutil.which("ray")
    if not found:
        raise CloudrlError("the `ray` command is not installed here: pip install 'ray[default]' in this environment")
    return found


def _node_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray turns token auth on by itself when ~/.ray/auth_token happens to exist; the local cluster is
    # deterministic instead: no token, like a dstack cluster behind its tunnel, so the browser needs none.
    env["RAY_AUTH_MODE"] = "disabled"
    # Job entrypoints run `python3` through the node's PATH: make it this environment's Python.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _spawn(args: list[str], log: Path) -> dict[str, Any]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=_node_env(), start_new_session=True)
    import psutil

    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    _STARTED.append(proc)  # the node outlives this call on purpose; keep Popen from warning about it
    return {"pid": proc.pid, "create_time": created, "log": str(log)}


def _pick_dashboard_port(wanted: int, echo: Echo) -> int:
    if wanted == 0:
        return _free_ports(1)[0]
    if port_free(wanted):
        return wanted
    port = _free_ports(1)[0]
    echo(f"port {wanted} is taken on 127.0.0.1 (another cluster or a dstack forward?): the dashboard uses {port}")
    return port


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` on 127.0.0.1 right now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int, exclude: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """n distinct ports the OS considers free right now (held open together so they differ)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _dashboard_answers(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/api/version", timeout=(1, 3)).status_code == 200
    except requests.exceptions.RequestException:
        return False


def _alive_nodes(url: str) -> int:
    from .ray_api import Address, Dashboard

    try:
        return len(Dashboard(Address(url, "local")).alive_nodes())
    except CloudrlError:  # the state API starts a little after the dashboard itself
        return 0


def _wait_for(ready: Callable[[], bool], state: dict[str, Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for i, node in enumerate(state["nodes"]):
            if not _alive(node):
                raise CloudrlError(f"Ray node {i} exited while waiting for {what}: {_log_tail(node['log'])}")
        if time.monotonic() > deadline:
            raise CloudrlError(f"timed out after {timeout_s:g} s waiting for {what}: the machine may be "
                               f"overloaded; raise --timeout or use fewer --nodes")
        time.sleep(0.5)


def _log_tail(path: str) -> str:
    try:
        lines = [ln.strip() for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["empty log"])[-1][:300]


# ----------------------------------------------------------------------------------------------
# Down
# ----------------------------------------------------------------------------------------------


def down(echo: Echo = print) -> int:
    """Stop every process `up` started; returns how many processes were stopped."""
    state = load_state()
    if state is None:
        echo("no local cluster is running")
        return 0
    stopped = _teardown(state)
    count = len(state.get("nodes", []))
    echo(f"stopped the local cluster ({count} node{'s' if count != 1 else ''}, {stopped} processes)")
    return stopped


def _teardown(state: dict[str, Any]) -> int:
    stopped = 0
    for node in reversed(state.get("nodes", [])):  # workers first, the head last
        stopped += _stop_node(node)
    if state.get("root"):
        shutil.rmtree(state["root"], ignore_errors=True)
    state_path().unlink(missing_ok=True)
    return stopped


def _own_process(node: dict[str, Any]) -> Any:
    """The node's `ray start` process, only if the PID still belongs to it (PIDs get reused)."""
    import psutil

    try:
        proc = psutil.Process(node["pid"])
        if abs(proc.create_time() - node["create_time"]) > 0.5 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def _alive(node: dict[str, Any]) -> bool:
    return _own_process(node) is not None


def _stop_node(node: dict[str, Any], grace_s: float = 5.0) -> int:
    import psutil

    procs = []
    leader = _own_process(node)
    if leader is not None:
        try:
            procs = [leader] + leader.children(recursive=True)
        except psutil.Error:
            procs = [leader]
    # Processes of this node that lost their parent are still in its process group (the leader's
    # session); only those started after the leader can be ours.
    known = {p.pid for p in procs}
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if (p.pid not in known and p.info["create_time"] >= node["create_time"] - 0.5
                    and os.getpgid(p.pid) == node["pid"]):
                procs.append(p)
        except (psutil.Error, OSError):
            continue
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    alive = _wait_gone(procs, grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_gone(alive, 5.0)
    return len(procs)


def _wait_gone(procs: list[Any], timeout_s: float) -> list[Any]:
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
                else:
                    _reap(p.pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _reap(pid: int) -> None:
    """Collect the exit status of our own children (when `up` ran in this process)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass

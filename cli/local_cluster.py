"""`cloudrl local up/down`: a Ray cluster of N nodes on this machine, so submit, dashboard, logs and
stop work with no cloud.

Each node is one `ray start --block` process in its own session, with its own temp dir and its own
ports (picked free, so clusters of other users or tests on the same machine are left alone). The
state file ($CLOUDRL_CACHE or ~/.cache/cloudrl, `local-cluster.json`) records every node's PID and
start time; `down` stops exactly those process trees and their process groups, never `ray stop`
(which would stop every Ray on the machine). The state is written as each node starts, so a failed
or interrupted `up` is torn down completely.

Every cluster runs with Ray token authentication and a random token of its own, written 0600 next to
the state file (`local_state.new_token_file`); the CLI sends it to this cluster's dashboard and to no
other address. Everything binds 127.0.0.1 where Ray allows it (the dashboard and Jobs API do), but Ray
turns 127.0.0.1 into the machine's own IP for its node address, so the GCS, raylet, job agent and Ray
Client ports listen on the machine's interfaces as with any `ray start`: the token is what protects
those. No node's metrics agent exports Prometheus metrics (RAY_enable_metrics_collection=0 unless this
shell sets it); the head's dashboard and autoscaler metrics ports (no code execution) stay open.

`up(debugger="legacy")` (`cloudrl local up --debugger legacy`, docs/debugging.md) runs the nodes' workers
with Ray's pdb, as CLOUDRL_DEBUGGER=legacy does on a bundle's nodes: a breakpoint() pauses its worker in a
pdb on 127.0.0.1 until `ray debug` attaches. Not `post-mortem`: its debugpy listens on the node address,
which Ray makes this machine's network address. Off by default: without it, Ray 2.60 skips a breakpoint()
with a warning. The nodes also carry CLOUDRL_DEBUGGER and the attach command, which the trainer prints at
the start of every job's log.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cloudrl.trainer.errors import ClusterUnreachable
from cloudrl.trainer.paths import cache_dir

from .errors import CloudrlError
from .local_state import load_state, local_token, new_token_file, save_state, state_path
from .node_processes import alive, spawn, stop_node
from .pins import DASHBOARD_PORT
from .ray_api import Address, ClusterClient

HEAD_PORTS = ("port", "ray-client-server-port")
"""The head's ports the other nodes and clients must know in advance, picked free here. Every other
port is 0: the raylet and agents bind a free port themselves and report it to the GCS, so nodes on one
machine never race each other (or anything else) for a port picked a moment earlier. The agent's HTTP
port is the one with a fixed default (52365), which several nodes would share, so it is set to 0 too."""
SELF_BOUND_PORTS = (
    "node-manager-port",
    "object-manager-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)
NODES_PER_CORE = 4
"""Ray nodes per CPU core `up` allows: each node starts several Python processes (seconds of CPU each)
and, idle, still polls and reports; beyond this they miss the join timeout instead of failing at once."""
NODE_MB = 600
"""Memory of one node's own processes (`ray start`, raylet, agents, log monitor; ~500 MB measured),
besides its object store."""
HEAD_MB = 1200
"""What the head node adds: GCS, dashboard and its modules (~1.1 GB measured)."""
DEBUGGERS = ("legacy",)
"""`--debugger` values: those of CLOUDRL_DEBUGGER on a bundle's nodes that keep the debugger on 127.0.0.1."""

Echo = Callable[[str], None]
"""Where a command prints its progress lines: typer.echo from the CLI, print by default."""


# ----------------------------------------------------------------------------------------------
# Up
# ----------------------------------------------------------------------------------------------


def local_preset_cpus() -> int:
    """CPUs the `local` preset's roles reserve, so a default local cluster can run it."""
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.roles.placement import plan

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
        return int(value) if value else DASHBOARD_PORT
    except ValueError:
        raise CloudrlError(f"CLOUDRL_LOCAL_DASHBOARD_PORT={value!r} is not a port number") from None


def check_capacity(nodes: int, object_store_mb: int) -> None:
    """Refuse, before starting anything, more nodes than this machine's cores and free memory hold."""
    import psutil

    cores = os.cpu_count() or 1
    free_mb = psutil.virtual_memory().available // 2**20
    per_node = NODE_MB + object_store_mb
    by_cores, by_memory = cores * NODES_PER_CORE, max(0, (free_mb - HEAD_MB) // per_node)
    limit = min(by_cores, by_memory)
    if nodes <= limit:
        return
    memory = (
        f"{free_mb / 1024:.1f} GB of free memory at ~{per_node / 1024:.1f} GB per node (--object-store-mb "
        f"{object_store_mb} + {NODE_MB} MB of Ray processes)"
    )
    if limit < 1:
        raise CloudrlError(
            f"this machine cannot run a Ray node: {memory}, plus {HEAD_MB} MB for the head: "
            f"free memory or lower --object-store-mb"
        )
    raise CloudrlError(
        f"--nodes {nodes} is more than this machine can run: at most {limit} ({cores} CPU cores x "
        f"{NODES_PER_CORE} allow {by_cores}; {memory} allows {by_memory}): use --nodes {limit} or fewer"
    )


def node_args(ray_exe: str, temp_dir: str, cpus: int, object_store_mb: int, gpus: int | None) -> list[str]:
    """`ray start --block` for one node on 127.0.0.1 with its own temp dir and self-chosen ports: what a head
    and a worker of a local cluster share (a worker adds `--address`, the head its dashboard and ports)."""
    args = [
        ray_exe,
        "start",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        f"--num-cpus={cpus}",
        f"--object-store-memory={object_store_mb * 1024 * 1024}",
        f"--temp-dir={temp_dir}",
        "--min-worker-port=0",
        "--max-worker-port=0",
    ]
    if gpus is not None:
        args.append(f"--num-gpus={gpus}")
    return args + [f"--{k}=0" for k in SELF_BOUND_PORTS]


def up(
    nodes: int = 1,
    cpus_per_node: int | None = None,
    gpus_per_node: int | None = None,
    object_store_mb: int = 512,
    dashboard_port: int | None = None,
    timeout_s: float = 120.0,
    echo: Echo = print,
    debugger: str | None = None,
) -> dict[str, Any]:
    """Start the cluster and wait until all its nodes are alive; tear everything down on failure.
    Ctrl+C at any point stops exactly what this call started, then exits 130 with one line.
    `debugger`: None (off) or `legacy` (the module docstring)."""
    if nodes < 1:
        raise CloudrlError(f"--nodes {nodes}: a cluster needs at least 1 node")
    check_debugger(debugger)
    check_capacity(nodes, object_store_mb)
    try:
        return _start(
            nodes, cpus_per_node, gpus_per_node, object_store_mb, dashboard_port, timeout_s, echo, debugger or None
        )
    except KeyboardInterrupt:
        print(
            "interrupted: stopped every Ray node `cloudrl local up` had started; nothing is left running",
            file=sys.stderr,
        )
        raise SystemExit(130) from None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl+C takes effect when the block ends: a node is never started without being recorded in
    the state file, nor left half stopped. (The handler is reset in started processes.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending:
        raise KeyboardInterrupt


def _start(
    nodes: int,
    cpus_per_node: int | None,
    gpus_per_node: int | None,
    object_store_mb: int,
    dashboard_port: int | None,
    timeout_s: float,
    echo: Echo,
    debugger: str | None = None,
) -> dict[str, Any]:
    if dashboard_port is None:
        dashboard_port = default_dashboard_port()
    existing = load_state()
    if existing:
        if existing.get("nodes") and alive(existing["nodes"][0]):
            raise CloudrlError(
                f"a local cluster is already running ({existing.get('dashboard_url')}): "
                f"use it with --local, or stop it with `cloudrl local down`"
            )
        echo("cleaning up a local cluster that is no longer running")
        _teardown(existing)
    ray_exe = _ray_executable()
    cpus = cpus_per_node or default_cpus_per_node(nodes)
    if gpus_per_node is None and nodes > 1:
        gpus_per_node = 0  # Ray would give every node all of the machine's GPUs
    state: dict[str, Any] = {
        "root": None,
        "nodes": [],
        "dashboard_url": None,
        "cpus_per_node": cpus,
        "num_nodes": nodes,
        "debugger": debugger,
    }
    try:
        with _sigint_deferred():
            root = tempfile.mkdtemp(prefix="cloudrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
            state["root"] = root
            state["token_file"] = str(new_token_file())
            save_state(state)
        token = local_token(state) or ""
        dashboard_port = _pick_dashboard_port(dashboard_port, echo)
        head_ports = dict(zip(HEAD_PORTS, _free_ports(len(HEAD_PORTS), exclude={dashboard_port})))
        url = f"http://127.0.0.1:{dashboard_port}"
        gcs = f"127.0.0.1:{head_ports['port']}"
        state.update(dashboard_url=url, gcs_address=gcs)
        if debugger:
            state["debugger_attach"] = attach_command(gcs, state["token_file"], ray_exe)
        node_env = {**_node_env(token), **debugger_env(debugger, state.get("debugger_attach", ""))}
        for i in range(nodes):
            args = node_args(ray_exe, f"{root}/n{i}", cpus, object_store_mb, gpus_per_node)
            if i == 0:
                args += [
                    "--head",
                    "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard_port}",
                ] + [f"--{k}={v}" for k, v in head_ports.items()]
            else:
                args.append(f"--address={gcs}")
            with _sigint_deferred():
                state["nodes"].append(spawn(args, Path(root) / f"n{i}.log", node_env))
                save_state(state)
            if i == 0:  # workers join a head whose GCS answers; the dashboard comes up right after it
                _wait_for(lambda: _dashboard_answers(url, token), state, timeout_s, "the head's dashboard to answer")
        _wait_for(lambda: _alive_nodes(url) >= nodes, state, timeout_s, f"{nodes} nodes to join")
        with _sigint_deferred():
            # The cluster's identity: a client that later finds another session at this URL refuses it.
            state["session_name"] = _session_name(url, token)
            save_state(state)
    except CloudrlError as exc:
        with _sigint_deferred():
            kept = _keep_logs(state)
            _teardown(state)
        raise CloudrlError(f"{exc} (node logs: {kept})") from None
    except BaseException:  # Ctrl+C included
        with _sigint_deferred():
            _teardown(state)
        raise
    return state


def _keep_logs(state: dict[str, Any]) -> Path:
    """Copy the nodes' `ray start` logs, and the raylet's and GCS's own, out of the temp dir that teardown
    deletes: a node that never registers says why only in its raylet log."""
    kept = cache_dir() / "local-up-failed"
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True, exist_ok=True)
    for i, node in enumerate(state.get("nodes", [])):
        with contextlib.suppress(OSError):
            shutil.copy(node["log"], kept)
        if state.get("root"):
            for log in (Path(state["root"]) / f"n{i}" / "session_latest" / "logs").glob("*.err"):
                with contextlib.suppress(OSError):
                    shutil.copy(log, kept / f"n{i}-{log.name}")
    return kept


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return str(beside)
    found = shutil.which("ray")
    if not found:
        raise CloudrlError("the `ray` command is not installed here: pip install 'ray[default]' in this environment")
    return found


def auth_env(state: dict[str, Any]) -> dict[str, str]:
    """What a process needs in its environment to join the local cluster `state` describes by its GCS
    address (a driver, or one more `ray start` node)."""
    token = local_token(state)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {"RAY_AUTH_MODE": "disabled"}


def _node_env(token: str | None = None) -> dict[str, str]:
    """The environment of one node's `ray start`: `token`, or that of the cluster the state file names."""
    if token is None:
        token = local_token(load_state() or {}) or ""
    # A debugger is what `up(debugger=...)` asks for, never what this shell happens to hold.
    dropped = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "CLOUDRL_DEBUGGER", "CLOUDRL_DEBUGGER_ATTACH")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # No node's metrics agent serves Prometheus metrics on the machine's interfaces without a token (a bundle
    # node's CLOUDRL_RAY_METRICS=off): this shell's RAY_enable_metrics_collection=1 turns it back on.
    env.setdefault("RAY_enable_metrics_collection", "0")
    # Token auth, with this cluster's own token: without it, anyone who reaches the machine's address
    # (or any local user, through 127.0.0.1) could run code here. Set explicitly, never left to Ray's
    # default, which depends on whether ~/.ray/auth_token happens to exist.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = token
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    # Job entrypoints run `python3` through the node's PATH: make it this environment's Python.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # A job's relative trainer.run_dir lands in the directory the cluster was started from, also when
    # `submit` ships files and the job's working directory is Ray's temporary copy of them.
    env.setdefault("CLOUDRL_RUNS_DIR", os.getcwd())
    return env


def check_debugger(debugger: str | None) -> None:
    """A `--debugger` value this cluster can run, checked before any node starts."""
    if not debugger or debugger in DEBUGGERS:
        return
    if debugger == "post-mortem":
        raise CloudrlError(
            "--debugger post-mortem is for a cluster's private network, not this machine: its debugpy would "
            "listen on this machine's network address and takes no token; use --debugger legacy (pdb on "
            "127.0.0.1, attach with `ray debug`)"
        )
    raise CloudrlError(f"--debugger {debugger} is not a debugger here: use --debugger legacy, or leave it out")


def attach_command(gcs: str, token_file: str, ray_exe: str = "ray") -> str:
    """The `ray debug` command that attaches to a paused worker of this cluster. The token is read from
    its file when the command runs, so it is never printed (nor written into the job's log)."""
    return (
        f"RAY_DEBUG=legacy RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(cat {shlex.quote(token_file)}) "
        f"{shlex.quote(ray_exe)} debug --address {gcs}"
    )


def debugger_env(debugger: str | None, attach: str) -> dict[str, str]:
    """What the nodes' environment adds for `debugger`; every Ray worker and job driver inherits it."""
    if debugger != "legacy":
        return {}
    # The pdb on 127.0.0.1 only (never Ray's --ray-debugger-external), and no post-mortem pauses.
    return {
        "RAY_DEBUG": "legacy",
        "REMOTE_PDB_HOST": "127.0.0.1",
        "RAY_DEBUG_POST_MORTEM": "0",
        "CLOUDRL_DEBUGGER": debugger,
        "CLOUDRL_DEBUGGER_ATTACH": attach,
    }


def _pick_dashboard_port(wanted: int, echo: Echo) -> int:
    if wanted == 0:
        return _free_ports(1)[0]
    if port_free(wanted):
        return wanted
    port = _free_ports(1)[0]
    echo(f"port {wanted} is taken on 127.0.0.1 (another cluster or a dstack forward?): the dashboard uses {port}")
    return port


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` on 127.0.0.1 right now. SO_REUSEADDR, as servers bind: a port
    whose last connections linger in TIME_WAIT (a client that polled the previous cluster) is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def _dashboard_answers(url: str, token: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/api/version", headers=_bearer(token), timeout=(1, 3)).status_code == 200
    except requests.exceptions.RequestException:
        return False


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _session_name(url: str, token: str) -> str | None:
    import requests

    try:
        return requests.get(f"{url}/api/version", headers=_bearer(token), timeout=(3, 5)).json().get("session_name")
    except (requests.exceptions.RequestException, ValueError):
        return None


def _alive_nodes(url: str) -> int:
    try:
        return len(ClusterClient(Address(url, "local")).alive_nodes())
    except (ClusterUnreachable, CloudrlError):  # the state API starts a little after the dashboard itself
        return 0


def _wait_for(ready: Callable[[], bool], state: dict[str, Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for i, node in enumerate(state["nodes"]):
            if not alive(node):
                raise CloudrlError(f"Ray node {i} exited while waiting for {what}: {_log_tail(node['log'])}")
        if time.monotonic() > deadline:
            raise CloudrlError(
                f"timed out after {timeout_s:g} s waiting for {what}: the machine may be "
                f"overloaded; raise --timeout or use fewer --nodes"
            )
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
        stopped += stop_node(node)
    if state.get("root"):
        shutil.rmtree(state["root"], ignore_errors=True)
    if state.get("token_file"):
        Path(state["token_file"]).unlink(missing_ok=True)
    state_path().unlink(missing_ok=True)
    return stopped

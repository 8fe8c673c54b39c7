"""The processes of `cloudrl local up`'s nodes: started in their own sessions, and stopped exactly
(their process trees and process groups, checked by PID and start time, since PIDs get reused), never
with `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

_STARTED: list[subprocess.Popen] = []


def spawn(args: list[str], log: Path, env: dict[str, str]) -> dict[str, Any]:
    """Start one node's `ray start --block` in its own session; returns its record for the state file."""
    mark = secrets.token_hex(8)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, NODE_MARK: mark},
            start_new_session=True,
        )
    import psutil

    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    _STARTED.append(proc)  # the node outlives this call on purpose; keep Popen from warning about it
    return {"pid": proc.pid, "create_time": created, "log": str(log), "mark": mark}


def own_process(node: dict[str, Any]) -> Any:
    """The node's `ray start` process, only if the PID still belongs to it (PIDs get reused)."""
    import psutil

    try:
        proc = psutil.Process(node["pid"])
        if abs(proc.create_time() - node["create_time"]) > 0.5 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except psutil.Error:
        return None


def alive(node: dict[str, Any]) -> bool:
    return own_process(node) is not None


def foreign_listener(state: dict[str, Any], port: int) -> str | None:
    """Who else listens on 127.0.0.1:`port` than the local cluster's head node (its `ray start` and every
    process under it, the dashboard among them), as `pid N (name)`; None when only the cluster does, or when
    this system cannot tell (no listener table for this user: the session check still applies)."""
    import psutil

    nodes = state.get("nodes") or []
    head = own_process(nodes[0]) if nodes else None
    ours = set()
    if head is not None:
        try:
            ours = {head.pid} | {child.pid for child in head.children(recursive=True)}
        except psutil.Error:
            ours = {head.pid}
    try:
        connections = psutil.net_connections(kind="tcp4")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or conn.laddr.port != port:
            continue
        if conn.laddr.ip not in ("127.0.0.1", "0.0.0.0") or conn.pid in ours:
            continue
        if conn.pid is None:
            return "a process of another user"
        try:
            return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
        except psutil.Error:
            return f"pid {conn.pid}"
    return None


NODE_MARK = "CLOUDRL_NODE_MARK"
"""The environment variable that carries a node's random mark into every process it starts, so that
stop_node finds the ones that left its process tree and its process group too."""


def node_processes(node: dict[str, Any]) -> list[Any]:
    """Every live process of the node: its `ray start`, that process's descendants, and, started after it,
    any process in its process group (its session: an orphan keeps it) or carrying its mark."""
    import psutil

    procs = []
    leader = own_process(node)
    if leader is not None:
        try:
            procs = [leader] + leader.children(recursive=True)
        except psutil.Error:
            procs = [leader]
    known = {p.pid for p in procs}
    mark = node.get("mark")
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if p.pid in known or p.info["create_time"] < node["create_time"] - 0.5:
                continue
            if os.getpgid(p.pid) == node["pid"] or (mark and p.environ().get(NODE_MARK) == mark):
                procs.append(p)
        except (psutil.Error, OSError):
            continue
    return procs


def stop_node(node: dict[str, Any], grace_s: float = 5.0) -> int:
    """SIGTERM every process of the node, SIGKILL what is left after `grace_s`; returns how many there were.
    A node still starting spawns daemons while the others exit: the node is looked at again until it has
    none left (or the grace ends), and every process that appears is signalled too."""
    seen: set[Any] = set()  # psutil processes: equal when PID and start time are
    for sig, bound_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        signalled: set[Any] = set()
        deadline = time.monotonic() + bound_s
        while True:
            seen.update(node_processes(node))
            alive = _wait_gone(list(seen), 0.0)
            if not alive or time.monotonic() > deadline:
                break
            for p in alive:
                if p not in signalled:
                    signalled.add(p)
                    with contextlib.suppress(Exception):
                        p.send_signal(sig)
            _wait_gone(alive, 0.5)
        if not alive:
            break
    return len(seen)


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

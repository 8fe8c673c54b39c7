"""Run a dstack task's own commands on a simulated multi-node cluster, the way dstack's runner would.

Each node is a network namespace with one veth into a bridge that lives in a namespace of its own with
no uplink, so the nodes reach each other on 10.213.<net>.0/24 and nothing else. Each node also gets a
private mount and UTS namespace with its own /tmp/ray (a per-node directory bind-mounted there), as
separate containers would. Where network namespaces are unavailable (not root, no `ip netns`), a
loopback cluster stands in: every node on its own 127.0.0.x address with its own ports and Ray temp dir.

What is taken from dstack's runner (dstack 0.22.5): each node runs `<shell> -i -c "<commands joined by
' && '>"` with the shell `/bin/sh` when the task sets an `image` (`/bin/bash` otherwise), from the
working directory (here the repository root, which is what the task's `files:` mapping reproduces),
with `DSTACK_NODE_RANK`, `DSTACK_NODES_NUM`, `DSTACK_MASTER_NODE_IP`, `DSTACK_NODES_IPS` (one address
a line, in rank order), `DSTACK_GPUS_PER_NODE` and `DSTACK_GPUS_NUM` set, plus the task's `env`, whose
name-only entries `dstack apply` fills from the user's shell.

Every process is stopped by PID: the node's process group, then anything still left inside the node's
namespace or carrying the cluster's marker variable (Ray daemons start their own process groups).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER_VAR = "CLOUDRL_BUNDLE_TEST_CLUSTER"


# --- what dstack's runner does with a task ----------------------------------------------------------


def load_task(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def node_groups(task: dict) -> list[dict]:
    """The task's node groups in rank order; a plain `nodes: N` task is one group."""
    if task.get("groups"):
        return task["groups"]
    return [{"nodes": task.get("nodes", 1), "commands": task.get("commands", [])}]


def nodes_num(task: dict) -> int:
    return sum(group.get("nodes", 1) for group in node_groups(task))


def node_argv(task: dict, rank: int) -> list[str]:
    """The argv dstack's runner executes on the node of this rank."""
    first = 0
    for group in node_groups(task):
        if rank < first + group.get("nodes", 1):
            commands = group["commands"]
            break
        first += group.get("nodes", 1)
    else:
        raise ValueError(f"rank {rank} is outside the task's {nodes_num(task)} nodes")
    shell = task.get("shell")
    if shell is None:
        shell = "/bin/sh" if task.get("image") else "/bin/bash"
    elif not shell.startswith("/"):
        shell = f"/bin/{shell}"
    joined = []
    for command in commands:
        command = command.strip()
        joined.append("{ %s }" % command if command.endswith("&") else command)
    return [shell, "-i", "-c", " && ".join(joined)]


def task_env(task: dict, local_env: dict[str, str]) -> dict[str, str]:
    """The task's `env` as the runner receives it; name-only entries come from `local_env`."""
    raw = task.get("env") or {}
    items = raw.items() if isinstance(raw, dict) else (
        (entry.split("=", 1) if "=" in entry else (entry, None)) for entry in raw)
    env = {}
    for name, value in items:
        if value is None:
            if name not in local_env:  # what `dstack apply` does too
                raise KeyError(f"Environment variable {name} is not set")
            value = local_env[name]
        env[name] = str(value)
    return env


def check_shipped_files(task_path: Path, task: dict, workdir: Path) -> None:
    """The task's `files:` (local path relative to the YAML, container path relative to the working
    dir) must land where the repository already has them, so running from the repository root is
    exactly what dstack would give the node."""
    for entry in task.get("files") or []:
        local, _, remote = entry.partition(":") if isinstance(entry, str) else (
            entry["local_path"], ":", entry["path"])
        remote = remote or local
        source = (task_path.parent / local).resolve()
        assert source.is_file(), f"{task_path.name} ships {local}, which does not exist"
        assert (workdir / remote).resolve() == source, (
            f"{task_path.name} ships {local} to {remote}, which is not where the repository has it")


def dstack_env(rank: int, ips: list[str], gpus_per_node: int) -> dict[str, str]:
    return {
        "DSTACK_RUN_NAME": "cloudrl-ray",
        "DSTACK_NODE_RANK": str(rank),
        "DSTACK_NODES_NUM": str(len(ips)),
        "DSTACK_MASTER_NODE_IP": ips[0],
        "DSTACK_NODES_IPS": "\n".join(ips),
        "DSTACK_GPUS_PER_NODE": str(gpus_per_node),
        "DSTACK_GPUS_NUM": str(gpus_per_node * len(ips)),
        "DSTACK_WORKING_DIR": str(REPO_ROOT),
    }


def base_env() -> dict[str, str]:
    """A container-like environment whose python3 and ray are this interpreter's."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }


# --- availability -----------------------------------------------------------------------------------


def netns_unavailable_reason() -> str | None:
    """None when this process can create network namespaces, else why not."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y {package})"
    probe = f"clrprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


# --- processes --------------------------------------------------------------------------------------


class Node:
    """One node's command, started in its own session; its output goes to a log file."""

    def __init__(self, rank: int, ip: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.rank, self.ip, self.env, self.log_path = rank, ip, env, log_path
        self.started_at = time.monotonic()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of `pattern` in the node's output; fails after `timeout` or if the node
        exits without printing it."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(pattern, self.output())
            if match:
                return match
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.rank} exited ({self.proc.returncode}) before "
                                     f"printing {pattern!r}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"node {self.rank} did not print {pattern!r} within "
                                     f"{timeout:.0f}s:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.rank} still running after {timeout:.0f}s:\n"
                                 f"{self.output()[-4000:]}") from None


def _marked_pids(marker: str) -> list[int]:
    """PIDs whose environment carries `MARKER_VAR=marker` (Ray daemons and workers inherit it)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _kill_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# --- clusters ---------------------------------------------------------------------------------------


class Cluster:
    """Nodes that run one task's commands; `stop()` removes every trace, `exec()` runs a command as if
    from inside a node's container (for the head: where dstack's SSH tunnel ends)."""

    kind = ""

    def __init__(self, size: int, workdir: Path):
        self.size, self.workdir = size, workdir
        self.id = uuid.uuid4().hex[:6]
        self.nodes: dict[int, Node] = {}
        self.ips: list[str] = []

    # subclasses: node_prefix(rank), node_env(rank), create(), _remove(), _extra_pids()
    def node_prefix(self, rank: int) -> list[str]:
        return []

    def node_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        return env

    def create(self) -> None:
        pass

    def _remove(self) -> None:
        pass

    def _extra_pids(self) -> list[int]:
        return []

    def start(self, rank: int, argv: list[str], env: dict[str, str]) -> Node:
        env = {**self.node_env(rank, env), MARKER_VAR: self.id}
        node = Node(rank, self.ips[rank], self.node_prefix(rank) + argv, env,
                    self.workdir / f"node{rank}.log")
        self.nodes[rank] = node
        return node

    def exec(self, rank: int, argv: list[str], timeout: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        full_env = {**base_env(), **(env or {}), MARKER_VAR: self.id}
        return subprocess.run(self.node_prefix(rank) + argv, env=full_env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        """Stop every process this cluster started (by PID), then remove its namespaces."""
        for node in self.nodes.values():
            if node.proc.poll() is None:
                try:
                    os.killpg(node.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(n.proc.poll() is None for n in self.nodes.values()):
            time.sleep(0.1)
        for _ in range(20):
            left = sorted(set(_marked_pids(self.id)) | set(self._extra_pids()))
            if not left:
                break
            _kill_pids(left, signal.SIGKILL)
            time.sleep(0.25)
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._remove()

    def leftover_pids(self) -> list[int]:
        return sorted(set(_marked_pids(self.id)) | set(self._extra_pids()))


class NetnsCluster(Cluster):
    kind = "netns"

    def __init__(self, size: int, workdir: Path, net: int):
        super().__init__(size, workdir)
        self.net = net
        self.bridge_ns = f"clr{self.id}br"
        self.ns = [f"clr{self.id}n{rank}" for rank in range(size)]
        self.ips = [f"10.213.{net}.{rank + 1}" for rank in range(size)]
        self._made: list[str] = []

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)

    def create(self) -> None:
        self._ip("netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        self._ip("-n", self.bridge_ns, "link", "set", "lo", "up")
        self._ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for rank, (ns, ip) in enumerate(zip(self.ns, self.ips)):
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are created inside namespaces, so the host's own network never sees them.
            port = f"p{rank}"
            self._ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
            self._ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            self._ip("-n", self.bridge_ns, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
            (self.workdir / f"node{rank}-tmp").mkdir(exist_ok=True)

    def node_prefix(self, rank: int) -> list[str]:
        node_tmp = self.workdir / f"node{rank}-tmp"
        # Private /tmp/ray (Ray's session directory) and hostname per node, like separate containers.
        # Only /tmp/ray: the test's own interpreter may live under /tmp and must stay visible.
        setup = 'mkdir -p /tmp/ray && mount --bind "$0" /tmp/ray && hostname "$1" && shift && exec "$@"'
        return ["ip", "netns", "exec", self.ns[rank], "unshare", "--mount", "--uts",
                "--propagation", "private", "sh", "-c", setup, str(node_tmp), f"node-{rank}"]

    def ns_exec_prefix(self, rank: int) -> list[str]:
        """Only the node's network, not its /tmp: for probes like `ss`."""
        return ["ip", "netns", "exec", self.ns[rank]]

    def exec(self, rank, argv, timeout, env=None):
        full_env = {**base_env(), **(env or {}), MARKER_VAR: self.id}
        return subprocess.run(self.ns_exec_prefix(rank) + argv, env=full_env, cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def _extra_pids(self) -> list[int]:
        pids = []
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                 timeout=20)
            pids += [int(p) for p in out.stdout.split()]
        return pids

    def _remove(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._made.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackCluster(Cluster):
    """Stand-in where namespaces are unavailable: nodes share the host's network, each on its own
    127.0.0.x address, with ports picked free (other Ray clusters may hold the defaults on this
    machine) and its own Ray temp dir."""

    kind = "loopback"

    def __init__(self, size: int, workdir: Path):
        super().__init__(size, workdir)
        self.ips = [f"127.0.0.{11 + rank}" for rank in range(size)]
        self.ray_port = free_port()
        self.dashboard_port = free_port()
        # Short: Ray's unix sockets live under it and AF_UNIX paths stop at 107 bytes.
        self.ray_root = Path(tempfile.mkdtemp(prefix="clr-", dir="/tmp"))

    def _remove(self) -> None:
        shutil.rmtree(self.ray_root, ignore_errors=True)

    def node_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        ray_tmp = self.ray_root / f"n{rank}"
        ray_tmp.mkdir(exist_ok=True)
        args = [f"--temp-dir={ray_tmp}", f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}"]
        if rank == 0:
            args.append(f"--ray-client-server-port={free_port()}")
        own = env.get("CLOUDRL_RAY_START_ARGS", "")
        return {**env, "CLOUDRL_RAY_PORT": str(self.ray_port),
                "CLOUDRL_DASHBOARD_PORT": str(self.dashboard_port),
                "CLOUDRL_RAY_START_ARGS": " ".join([own, *args]).strip()}

"""Run a dstack task's own commands on a simulated multi-node cluster, the way dstack's runner would.

Each node is a network namespace with one veth into a bridge that lives in a namespace of its own with
no uplink, so the nodes reach each other on 10.213.<net>.0/24 and nothing else. Each node also gets a
private mount and UTS namespace with a disk of its own, as separate machines have: its own /tmp (so
/tmp/ray, Ray's session directory), its own home (so ~/.cache/cloudrl and ~/.cache/huggingface) and its
own working directory holding only what the task's `files:` ship. Only "the image" stays shared: this
interpreter's prefixes and the repository (the venv and the editable cloudrl install live there), even
where those lie under /tmp or the home directory. A file that exists only on the host (the submitting
machine) is therefore on no node.

Where network namespaces are unavailable (not root, no `ip netns`), a loopback cluster stands in: every
node on its own 127.0.0.x address with its own ports, and its own HOME, XDG_CACHE_HOME, HF_HOME,
CLOUDRL_CACHE, TMPDIR and working directory, set through the environment. That guarantee is weaker:
the nodes and the host still share one filesystem, so a literal /tmp path (or any absolute path) is
visible to every node.

What is taken from dstack's runner (dstack 0.22.5): each node runs `<shell> -i -c "<commands joined by
' && '>"` with the shell `/bin/sh` when the task sets an `image` (`/bin/bash` otherwise), from the
working directory the task's `files:` are copied into, with `DSTACK_NODE_RANK`, `DSTACK_NODES_NUM`,
`DSTACK_MASTER_NODE_IP`, `DSTACK_NODES_IPS` (one address a line, in rank order),
`DSTACK_GPUS_PER_NODE` and `DSTACK_GPUS_NUM` set, plus the task's `env`, whose name-only entries
`dstack apply` fills from the user's shell.

Every process is stopped by PID: the node's process group, then anything still left inside the node's
namespace or carrying the cluster's marker variable (Ray daemons start their own process groups). The
mounts live only in the nodes' private mount namespaces, which vanish with their last process.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from cloudrl.cli.local_cluster import SELF_BOUND_PORTS
from dstack_runner import REPO_ROOT, base_env
from servers import free_port

MARKER_VAR = "CLOUDRL_BUNDLE_TEST_CLUSTER"


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


# --- a node's own disk ------------------------------------------------------------------------------


def image_paths() -> list[Path]:
    """What every node shares, as its image would hold it: this interpreter's prefixes (the venv and
    the Python it was made from) and the repository (cloudrl is installed editable from it)."""
    return sorted({Path(p).resolve() for p in (sys.prefix, sys.base_prefix, REPO_ROOT)})


def home_dir() -> Path:
    return Path(base_env()["HOME"]).resolve()


def _q(path: Path | str) -> str:
    return shlex.quote(str(path))


def _outermost(paths) -> list[Path]:
    """`paths` without those inside another one of them: binding the outer one carries them along."""
    kept: list[Path] = []
    for path in sorted(set(paths)):
        if not any(path.is_relative_to(outer) for outer in kept):
            kept.append(path)
    return kept


def private_disk_script(covers: list[tuple[Path, Path]], keep: list[Path], hostname: str, cwd: Path) -> str:
    """Shell lines for a fresh private mount namespace: lay each (target, own) of `covers` over its
    target, e.g. the node's own tmp dir over /tmp, keeping every path of `keep` and `cwd` reachable
    where it was; then set the hostname, cd to `cwd` and exec "$@".

    A kept path under a target is first bound into the same relative place inside the node's own
    dir, which `mount --rbind` then carries over the target along with it. The other covers' own dirs
    are kept the same way: a cover reads its source after the covers before it, and the node's home
    dir lies under /tmp whenever the cluster's workdir does."""
    lines = ["set -e"]
    # Outer targets first, so an inner one (a home under /tmp) is covered on the node's own disk.
    for target, own in sorted(covers):
        needed = [*keep, cwd, *(other for _, other in covers if other != own)]
        for path in _outermost(p for p in needed if p.is_relative_to(target)):
            if path == target:
                raise ValueError(f"{target} holds the image; the nodes cannot each have their own")
            inside = own / path.relative_to(target)
            lines += [f"mkdir -p {_q(inside)}", f"mount --rbind {_q(path)} {_q(inside)}"]
        lines += [f"mkdir -p {_q(target)}", f"mount --rbind {_q(own)} {_q(target)}"]
    lines += [f"hostname {_q(hostname)}", f"cd {_q(cwd)}", 'exec "$@"']
    return "\n".join(lines)


# --- processes --------------------------------------------------------------------------------------


class Node:
    """One node's command, started in its own session; its output goes to a log file."""

    def __init__(self, rank: int, ip: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path):
        self.rank, self.ip, self.env, self.log_path = rank, ip, env, log_path
        self.started_at = time.monotonic()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

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
                raise AssertionError(
                    f"node {self.rank} exited ({self.proc.returncode}) before "
                    f"printing {pattern!r}:\n{self.output()[-4000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"node {self.rank} did not print {pattern!r} within {timeout:.0f}s:\n{self.output()[-4000:]}"
                )
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the node's command and every process it started (its Ray daemons and workers): the node
        gone at once, as a reclaimed spot instance goes."""
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(timeout=10)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"node {self.rank} still running after {timeout:.0f}s:\n{self.output()[-4000:]}"
            ) from None


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
    """Nodes that run one task's commands, each on a disk of its own; `stop()` removes every trace.
    `exec()` runs a command as if from the user's machine at the end of dstack's SSH tunnel into a
    node (the node's network, the host's filesystem); `run_in_node()` as if on the node itself."""

    kind = ""

    def __init__(self, size: int, workdir: Path):
        self.size, self.workdir = size, workdir
        self.id = uuid.uuid4().hex[:6]
        self.nodes: dict[int, Node] = {}
        self.ips: list[str] = []

    # subclasses: disk(rank), node_prefix(rank), node_env(rank), disk_env(rank), create(), _remove(),
    # _extra_pids()
    def disk(self, rank: int) -> Path:
        """The host directory that holds the node's own disk: tmp/, home/ and workflow/."""
        raise NotImplementedError

    def node_prefix(self, rank: int) -> list[str]:
        return []

    def node_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        return env

    def disk_env(self, rank: int) -> dict[str, str]:
        """Variables that point the node at its own disk (where no mount namespace does it)."""
        return {}

    def create(self) -> None:
        for rank in range(self.size):
            for _, own in self.own_dirs(rank):
                own.mkdir(parents=True, exist_ok=True)
            self.workflow_dir(rank).mkdir(parents=True, exist_ok=True)

    def _remove(self) -> None:
        pass

    def _extra_pids(self) -> list[int]:
        return []

    def own_dirs(self, rank: int) -> list[tuple[Path, Path]]:
        """(where the node looks, where that lies on the host) for its /tmp and its home."""
        disk = self.disk(rank)
        return [(Path("/tmp").resolve(), disk / "tmp"), (home_dir(), disk / "home")]

    def workflow_dir(self, rank: int) -> Path:
        """The node's working dir, holding what the task ships; the same path on node and host."""
        return self.disk(rank) / "workflow"

    def node_path(self, rank: int, path: str | Path) -> Path:
        """Where `path` as the node sees it (`/tmp/...`, `~/...`, or relative to its working dir)
        lies on the host. Loopback stand-in: /tmp here means the node's TMPDIR."""
        path = str(path)
        if path == "~" or path.startswith("~/"):
            return self.disk(rank) / "home" / path[2:]
        if not path.startswith("/") or Path(path).is_relative_to(self.workflow_dir(rank)):
            return self.workflow_dir(rank) / path
        for target, own in self.own_dirs(rank):
            if Path(path).is_relative_to(target):
                return own / Path(path).relative_to(target)
        raise ValueError(f"{path} is not on node {rank}'s own disk")

    def ship(self, rank: int, files: dict[str, Path]) -> None:
        """Copy the task's `files:` into the node's working dir, as dstack does before its commands."""
        for remote, source in files.items():
            dest = self.workflow_dir(rank) / remote
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)

    def start(self, rank: int, argv: list[str], env: dict[str, str], files: dict[str, Path] | None = None) -> Node:
        """Start the node's command from its working dir, after `files` ({path there: local file})
        were copied into it."""
        self.ship(rank, files or {})
        env = {
            **self.node_env(rank, env),
            **self.disk_env(rank),
            "DSTACK_WORKING_DIR": str(self.workflow_dir(rank)),
            MARKER_VAR: self.id,
        }
        node = Node(
            rank,
            self.ips[rank],
            self.node_prefix(rank) + argv,
            env,
            self.workdir / f"node{rank}.log",
            cwd=self.workflow_dir(rank),
        )
        self.nodes[rank] = node
        return node

    def ns_exec_prefix(self, rank: int) -> list[str]:
        return []

    def exec(
        self, rank: int, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run `argv` as the user's machine at the end of dstack's SSH tunnel into the node (for the
        head): on the node's network, with the host's filesystem and environment."""
        return self._run(self.ns_exec_prefix(rank) + argv, {**base_env(), **(env or {})}, REPO_ROOT, timeout)

    def run_in_node(
        self, rank: int, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Run `argv` on the node itself: its network, /tmp, home and working dir."""
        full_env = {**base_env(), **self.disk_env(rank), **(env or {})}
        return self._run(self.node_prefix(rank) + argv, full_env, self.workflow_dir(rank), timeout)

    def _run(self, argv: list[str], env: dict[str, str], cwd: Path, timeout: float):
        return subprocess.run(
            argv,
            env={**env, MARKER_VAR: self.id},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

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
        # Paths every node sees as on the host (a test may add one, e.g. a stand-in image dir).
        self.keep = image_paths()
        self._made: list[str] = []

    def disk(self, rank: int) -> Path:
        return self.workdir / f"node{rank}-disk"

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
            self._ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
            self._ip("-n", self.bridge_ns, "link", "set", port, "up")
            self._ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")
        super().create()

    def node_prefix(self, rank: int) -> list[str]:
        """The node's network, plus a private mount namespace in which its own tmp and home dirs lie
        over /tmp and the home dir, and a hostname of its own: like a separate machine."""
        script = private_disk_script(self.own_dirs(rank), self.keep, f"node-{rank}", self.workflow_dir(rank))
        return [
            "ip",
            "netns",
            "exec",
            self.ns[rank],
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "node-disk",
        ]

    def ns_exec_prefix(self, rank: int) -> list[str]:
        """Only the node's network, with the host's filesystem: the user's machine at the end of
        dstack's SSH tunnel into the node, and probes like `ss`."""
        return ["ip", "netns", "exec", self.ns[rank]]

    def _extra_pids(self) -> list[int]:
        pids = []
        for ns in self._made:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
            pids += [int(p) for p in out.stdout.split()]
        return pids

    def _remove(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._made.clear()


class LoopbackCluster(Cluster):
    """Stand-in where namespaces are unavailable: nodes share the host's network, each on its own
    127.0.0.x address, with ports picked free (other Ray clusters may hold the defaults on this
    machine). Each node's own disk is only pointed at through its environment (HOME, the caches,
    TMPDIR, Ray's temp dir) and its working dir: the filesystem itself, /tmp included, is shared."""

    kind = "loopback"

    def __init__(self, size: int, workdir: Path):
        super().__init__(size, workdir)
        self.ips = [f"127.0.0.{11 + rank}" for rank in range(size)]
        self.ray_port = free_port()
        self.dashboard_port = free_port()
        # The nodes' disks. Short: Ray's unix sockets live under them and AF_UNIX paths stop at 107
        # bytes.
        self.ray_root = Path(tempfile.mkdtemp(prefix="clr-", dir="/tmp"))

    def disk(self, rank: int) -> Path:
        return self.ray_root / f"n{rank}"

    def _remove(self) -> None:
        shutil.rmtree(self.ray_root, ignore_errors=True)

    def disk_env(self, rank: int) -> dict[str, str]:
        home = self.disk(rank) / "home"
        return {
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "HF_HOME": str(home / ".cache" / "huggingface"),
            "CLOUDRL_CACHE": str(home / ".cache" / "cloudrl"),
            "TMPDIR": str(self.disk(rank) / "tmp"),
        }

    def node_env(self, rank: int, env: dict[str, str]) -> dict[str, str]:
        ray_tmp = self.disk(rank) / "tmp" / "ray"  # where /tmp/ray is on a node of its own
        ray_tmp.mkdir(parents=True, exist_ok=True)
        # Port 0: each process binds a free port itself (see cli/local_cluster.py's SELF_BOUND_PORTS).
        args = [f"--temp-dir={ray_tmp}", *(f"--{name}=0" for name in SELF_BOUND_PORTS)]
        if rank == 0:
            args.append(f"--ray-client-server-port={free_port()}")
        own = env.get("CLOUDRL_RAY_START_ARGS", "")
        return {
            **env,
            "CLOUDRL_RAY_PORT": str(self.ray_port),
            "CLOUDRL_DASHBOARD_PORT": str(self.dashboard_port),
            "CLOUDRL_RAY_START_ARGS": " ".join([own, *args]).strip(),
        }

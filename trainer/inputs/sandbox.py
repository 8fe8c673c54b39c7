"""Run untrusted (model-written) Python in a sandbox: a process of its own, never the caller's.

    from cloudrl.trainer.inputs.sandbox import Limits, run_python, run_many

    result = run_python("print(sum(range(10)))", Limits(timeout_s=2))
    result.ok, result.stdout, result.reason          # True, "45\\n", ""

Two ways wall the code off, with the same limits and the same tests: bubblewrap (`bwrap`), for a trainer that
runs as root on a node that has it (started as the run's own unprivileged uid, its root directory holding only
/usr, the system libraries and the Python installation), else the hand-written launcher; CLOUDRL_SANDBOX
(auto, bwrap, launcher) chooses. Both start from sandbox_launcher.py. Each run gets:

- a wall-time limit: the whole process tree is killed after `timeout_s` (CPU time is capped a little
  above it too), reported as "timed out after 5s";
- a memory limit: `memory_mb` for the whole program (all its processes and its scratch files) through a
  memory cgroup of its own where the node allows one (sandbox_cgroup.py), and `memory_mb` of address
  space per process (`RLIMIT_AS`); reported as "memory limit 512 MB";
- at most MAX_PROCESSES processes and threads (UNCAPPED_PROCESSES where there is no cgroup, so its memory
  stays within twice `memory_mb`), files up to the scratch size, 256 open files, no core dumps;
- no network: a network namespace of its own, whose only interface is its own loopback (down under the
  launcher), so neither the internet nor services on the trainer's 127.0.0.1 can be reached;
- nothing of the caller's environment: `python -I` with a minimal environment (PATH=/usr/bin:/bin, HOME
  and TMPDIR the scratch directory, one-thread BLAS), so no tokens or keys; a PID namespace and a fresh
  /proc, so other processes' command lines and environments are out of sight;
- a scratch directory of its own: a tmpfs of `memory_mb` over /tmp, its working directory, that vanishes
  with the run; every other mount is read-only and nosuid in its view, and as root it runs as an
  unprivileged uid/gid of its own (not shared with other runs, so one run's processes count against no
  other's limit and cannot signal another's);
- no privileges: every capability dropped (bounding set included) and no_new_privs set before the code
  starts, so neither uid 0 of its user namespace (without root) nor a setuid binary can undo the read-only
  view; System V IPC (shared memory, semaphores, queues) of its own, gone with the run;
- a seccomp filter (sandbox_launcher.py): no UNIX socket (those on the host's filesystem are otherwise
  reachable through the read-only view), no namespace of its own, none of the kernel interfaces a Python
  program has no use for (ptrace, keyrings, bpf, userfaultfd, io_uring, modules, mounts);
- a lower CPU priority (nice 10) than the trainer.

What it does not protect: files readable by everyone on the host (the code of the environment, /etc, a
world-readable dataset) can be read; CPU cache and timing side channels; kernel exploits (this is
namespaces, limits and a seccomp filter, not a virtual machine); and without root, where it uses a user namespace, it runs as the caller's user outside, so
files that user can read are readable (writes are still blocked by the read-only view). It needs root or
unprivileged user namespaces (Linux), which it tries for real once per process; where neither works it
refuses with SandboxUnavailable rather than run code unconfined.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import TrainerError
from . import sandbox_cgroup

MAX_PROCESSES = 32
"""Processes and threads a run may have at once (RLIMIT_NPROC of its own uid) inside its memory cgroup."""
UNCAPPED_PROCESSES = 2
"""The same where the node allows the run no memory cgroup: `RLIMIT_AS` bounds each process alone, so
few processes keep the whole program within twice `memory_mb`."""
NICE = 10
"""CPU priority below the trainer's."""
SETUP_EXIT = 125
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
SANDBOX_ENV = "CLOUDRL_SANDBOX"
"""auto (bubblewrap where it works, else the hand-written launcher), bwrap (refuse without it) or launcher."""
_UID_BASE = 2_000_000_000
"""Runs as root take a uid/gid at random above this: no account on the host has it."""
_GRACE_S = 5.0
"""After the kill, the longest wait for the killed process tree's pipes to close."""
_ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxUnavailable(TrainerError, RuntimeError):
    """This machine cannot isolate untrusted code (no root, no user namespaces): nothing was run."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    """Wall time before the whole process tree is killed."""
    memory_mb: int = 512
    """Address space of each process, and the size of its scratch directory."""
    output_bytes: int = 16384
    """Bytes of stdout and of stderr kept each; the rest is read and dropped."""


@dataclass(frozen=True)
class Execution:
    ok: bool
    """Exited 0 within the limits."""
    stdout: str
    stderr: str
    reason: str
    """Empty when ok, else one short line: "timed out after 5s", "memory limit 512 MB", "exit code 1", ..."""


def run_python(code: str, limits: Limits = Limits(), stdin: str = "") -> Execution:
    """Run `code` as a Python program in a sandbox of its own (see the module docstring) with `stdin`.
    A program that fails, hangs or overruns a limit is a failed Execution; only a machine that cannot
    isolate it raises (SandboxUnavailable)."""
    as_root = os.geteuid() == 0
    if not as_root and not _user_namespaces():
        raise SandboxUnavailable(
            "the sandbox cannot isolate code here: it needs root or unprivileged user namespaces, and creating "
            "one failed (see sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, "
            "kernel.apparmor_restrict_unprivileged_userns, or the container's seccomp profile); run the trainer "
            "as root or enable them"
        )
    group = sandbox_cgroup.create(int(limits.memory_mb) << 20)
    try:
        return _run(code, limits, stdin, as_root, group)
    finally:
        if group is not None:
            group.remove()


def _run(code: str, limits: Limits, stdin: str, as_root: bool, group: sandbox_cgroup.MemoryCgroup | None) -> Execution:
    status_read, status_write = os.pipe()
    ident = _UID_BASE + secrets.randbelow(1 << 24)
    settings = {
        "as_root": as_root,
        "uid": ident,
        "gid": ident,
        "memory_mb": int(limits.memory_mb),
        "scratch_mb": int(limits.memory_mb),
        "cpu_s": max(1, int(limits.timeout_s + 1)),
        "max_processes": MAX_PROCESSES if group is not None else UNCAPPED_PROCESSES,
        "cgroup_procs": group.procs if group is not None else None,
        "nice": NICE,
        "python": _interpreter(),
        "expose": _installation(),
        "env": _ENV,
        "status_fd": status_write,
        "bwrap": _bubblewrap(as_root),
    }
    payload = json.dumps({"code": code, "stdin": stdin}).encode()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_LAUNCHER), json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_ENV,
            cwd="/",
            start_new_session=True,
            pass_fds=(status_write,),
        )
    finally:
        os.close(status_write)
    try:
        outputs, timed_out = _collect(proc, payload, status_read, limits)
    finally:
        _kill(proc)
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_read)
    stdout, stderr, status = (_text(b) for b in outputs)
    if status.startswith("error "):
        said = stderr.strip().splitlines()[-1:] if settings["bwrap"] else []  # bwrap's, the code never ran
        raise SandboxUnavailable(f"the sandbox could not isolate the code: {': '.join([status[6:].strip(), *said])}")
    if group is not None and group.oom_killed():
        return Execution(False, stdout, stderr, f"memory limit {limits.memory_mb} MB")
    if timed_out:
        return Execution(False, stdout, stderr, f"timed out after {limits.timeout_s:g}s")
    ok, reason = _verdict(status, stderr, limits)
    return Execution(ok, stdout, stderr, reason)


def check_available() -> None:
    """Run a trivial program once, so a process that will run model-written code fails at its start, in one
    line (SandboxUnavailable), on a node that cannot isolate it, rather than at its first reward."""
    result = run_python("pass", Limits(timeout_s=30))
    if not result.ok:
        raise SandboxUnavailable(
            f"the sandbox could not run a trivial program here ({result.reason}: "
            f"{(result.stderr.strip().splitlines() or [''])[-1][:200]}): model-written code cannot be run safely"
        )


def run_many(codes: list[str], limits: Limits = Limits(), max_parallel: int = 0) -> list[Execution]:
    """Run each program with `run_python`, at most `max_parallel` at once (0: the CPUs this process may use),
    results in the order of `codes`."""
    workers = max_parallel if max_parallel > 0 else len(os.sched_getaffinity(0))
    if not codes:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(codes)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda code: run_python(code, limits), codes))


def _interpreter() -> str:
    """The interpreter the code runs in: this process's (its packages importable), unless it lives under /tmp,
    which the sandbox covers with its scratch directory (a virtualenv made in /tmp), then the installation that
    one was made from (the standard library only)."""
    for python in (sys.executable, os.path.realpath(sys.executable)):
        if not Path(python).is_relative_to("/tmp"):
            return python
    raise SandboxUnavailable(
        f"the sandbox runs code with {sys.executable}, which lives under /tmp, where each run gets its own empty "
        "scratch directory: run the trainer with a Python installed outside /tmp"
    )


def _installation() -> list[str]:
    """The directories the sandboxed interpreter needs: its environment, its base installation, its binary's."""
    found = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))]
    found.append(os.path.dirname(os.path.realpath(sys.executable)))
    return list(dict.fromkeys(found))


@functools.cache
def _bubblewrap(as_root: bool) -> str | None:
    """The bubblewrap (`bwrap`) the sandbox runs code with: for a root trainer, where this node has one that
    works as an unprivileged uid (tried for real once per process), unless CLOUDRL_SANDBOX=launcher asks for
    the hand-written path; None: the hand-written path (sandbox_launcher.py). A trainer that is not root runs
    the hand-written path (bubblewrap would need a uid of its own to start as)."""
    choice = os.environ.get(SANDBOX_ENV, "auto")
    if choice not in ("auto", "bwrap", "launcher"):
        raise SandboxUnavailable(f"{SANDBOX_ENV}={choice}: give auto, bwrap or launcher")
    if choice == "launcher" or (choice == "auto" and not as_root):
        return None
    if not as_root:
        raise SandboxUnavailable(
            f"{SANDBOX_ENV}=bwrap: the sandbox runs bubblewrap for a trainer that runs as root only; run it as "
            f"root, or leave {SANDBOX_ENV} unset"
        )
    found = shutil.which("bwrap")
    if found is not None and not _bubblewrap_works(found):
        found = None
    if found is None and choice == "bwrap":
        raise SandboxUnavailable(
            f"{SANDBOX_ENV}=bwrap: no bubblewrap that runs here (install the bubblewrap package; it needs "
            f"unprivileged user namespaces), or leave {SANDBOX_ENV} unset"
        )
    return found


def _bubblewrap_works(bwrap: str) -> bool:
    """Whether `bwrap` can make its namespaces as an unprivileged uid of the sandbox's range."""
    ident = _UID_BASE + secrets.randbelow(1 << 24)
    try:
        probe = subprocess.run(
            [bwrap, "--unshare-all", "--uid", str(ident), "--ro-bind", "/", "/", "--cap-drop", "ALL", "true"],
            env=_ENV,
            cwd="/",
            capture_output=True,
            timeout=30,
            user=ident,
            group=ident,
            extra_groups=[],
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


_NAMESPACES = 0x10000000 | 0x00020000 | 0x40000000 | 0x20000000 | 0x08000000  # user, mount, network, PID, IPC
_PROBE = f"import ctypes, sys\nsys.exit(ctypes.CDLL(None, use_errno=True).unshare({_NAMESPACES}) != 0)\n"
"""Enters user, mount, network, PID and IPC namespaces, as the launcher does: exit 0 where that works."""


@functools.cache
def _user_namespaces() -> bool:
    """Whether this process's user may create the namespaces the launcher needs, tried for real in a child
    (a sysctl answers for some kernels only, and containers refuse them in other ways). Asked once."""
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _PROBE], env=_ENV, cwd="/", capture_output=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _collect(proc: subprocess.Popen, payload: bytes, status_fd: int, limits: Limits) -> tuple[list[bytes], bool]:
    """Feed the payload, read stdout, stderr and the status pipe (keeping `output_bytes` of each) until
    they close, killing the process tree at the deadline. Returns the three outputs and whether it timed out."""
    proc.stdin.write(payload)
    proc.stdin.close()
    kept = [bytearray(), bytearray(), bytearray()]
    streams = {proc.stdout.fileno(): 0, proc.stderr.fileno(): 1, status_fd: 2}
    deadline = time.monotonic() + limits.timeout_s
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                if timed_out:  # the killed tree still holds a pipe open after the grace period
                    break
                timed_out = True
                _kill(proc)
                deadline = time.monotonic() + _GRACE_S
                continue
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    del streams[key.fd]
                    continue
                buffer = kept[streams[key.fd]]
                buffer += chunk[: max(0, limits.output_bytes - len(buffer))]
    try:
        proc.wait(_GRACE_S)
    except subprocess.TimeoutExpired:  # killed already; the kernel reaps it once it leaves the D state
        pass
    return [bytes(b) for b in kept], timed_out


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group; the sandboxed tree dies with the launcher (its PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _verdict(status: str, stderr: str, limits: Limits) -> tuple[bool, str]:
    """(ok, reason) from the launcher's `exit N` / `signal N` line and the program's stderr."""
    kind, _, number = status.strip().partition(" ")
    if kind not in ("exit", "signal") or not number.isdigit():
        return False, "the sandbox ended without a status"
    code = int(number)
    if "MemoryError" in stderr or (kind == "signal" and code == signal.SIGSEGV and "Cannot allocate" in stderr):
        return False, f"memory limit {limits.memory_mb} MB"
    if kind == "exit":
        return code == 0, "" if code == 0 else f"exit code {code}"
    if code in (signal.SIGXCPU, signal.SIGKILL):
        return False, f"cpu time limit {max(1, int(limits.timeout_s + 1))}s"
    if code == signal.SIGXFSZ:
        return False, f"file size limit {limits.memory_mb} MB"
    return (
        False,
        f"killed by {signal.Signals(code).name}" if code in signal.Signals._value2member_map_ else f"signal {code}",
    )

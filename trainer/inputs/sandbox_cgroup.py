"""A memory cgroup per sandbox run: one bound on everything the program holds, all its processes and its
scratch files together (`RLIMIT_AS` bounds each process alone).

The run's cgroup is made under this process's own memory cgroup (cgroup v2, or v1's memory hierarchy),
its limit set to the run's `memory_mb` with no swap, and the launcher joins it before anything else, so the
program and every process it starts are inside. Where the node allows no such cgroup (no permission, a v2
hierarchy without the memory controller delegated), `create` returns None and the sandbox holds the run to
two processes instead (sandbox.py), so its memory stays within twice `memory_mb`. Which of the two applies
is decided once per process, by making a cgroup for real.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
REMOVE_WAIT_S = 2.0
"""How long `remove` waits for the killed program's processes to leave the cgroup before giving up on it."""


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int

    @property
    def procs(self) -> str:
        """The file a process writes `0` into to join."""
        return str(self.path / "cgroup.procs")

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for going over the limit."""
        events = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        try:
            fields = dict(line.split() for line in events.read_text().splitlines() if line.count(" ") == 1)
        except (OSError, ValueError):
            return False
        return int(fields.get("oom_kill", "0")) > 0

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (they are killed with the launcher); one still busy
        after REMOVE_WAIT_S is left behind."""
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def _own_cgroups() -> tuple[Path | None, Path | None]:
    """This process's cgroup directories: (v2's, v1's memory hierarchy's), None where absent."""
    v2 = v1 = None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            v2 = CGROUP_ROOT / path.lstrip("/")
        elif "memory" in controllers.split(","):
            v1 = CGROUP_ROOT / "memory" / path.lstrip("/")
    return v2, v1


def _make(parent: Path, version: int, limit_bytes: int) -> MemoryCgroup | None:
    """A new cgroup under `parent` holding at most `limit_bytes` with no swap, or None where the node refuses."""
    path = parent / f"cloudrl-sandbox-{secrets.token_hex(6)}"
    try:
        path.mkdir()
    except OSError:
        return None
    group = MemoryCgroup(path, version)
    settings = (
        [("memory.max", limit_bytes), ("memory.swap.max", 0)]
        if version == 2
        else [("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)]
    )
    try:
        for name, value in settings:
            target = path / name
            if name.endswith(("swap.max", "memsw.limit_in_bytes")) and not target.exists():
                continue  # no swap accounting on this node: no swap to bound
            target.write_text(str(value))
        if not os.access(group.procs, os.W_OK):
            raise PermissionError(group.procs)
    except OSError:
        group.remove()
        return None
    return group


@functools.cache
def _parent() -> tuple[Path, int] | None:
    """Where runs' cgroups go (a directory, the cgroup version), found once by making one; None if nowhere."""
    v2, v1 = _own_cgroups()
    for parent, version in ((v2, 2), (v1, 1)):
        if parent is not None and parent.is_dir():
            probe = _make(parent, version, 64 << 20)
            if probe is not None:
                probe.remove()
                return parent, version
    return None


def create(limit_bytes: int) -> MemoryCgroup | None:
    """A memory cgroup for one run, limited to `limit_bytes`; None where this node allows none."""
    found = _parent()
    return None if found is None else _make(found[0], found[1], limit_bytes)

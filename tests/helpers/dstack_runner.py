"""What dstack's runner does with a task, read from the task YAML: which command each node rank runs,
with which environment and which shipped files (dstack 0.22.5's behaviour; see tests/helpers/bundle_netns.py,
which runs these commands on simulated nodes).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


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
        joined.append(f"{{ {command} }}" if command.endswith("&") else command)
    return [shell, "-i", "-c", " && ".join(joined)]


def task_env(task: dict, local_env: dict[str, str]) -> dict[str, str]:
    """The task's `env` as the runner receives it; name-only entries come from `local_env`."""
    raw = task.get("env") or {}
    items = (
        raw.items()
        if isinstance(raw, dict)
        else ((entry.split("=", 1) if "=" in entry else (entry, None)) for entry in raw)
    )
    env = {}
    for name, value in items:
        if value is None:
            if name not in local_env:  # what `dstack apply` does too
                raise KeyError(f"Environment variable {name} is not set")
            value = local_env[name]
        env[name] = str(value)
    return env


def shipped_files(task_path: Path, task: dict) -> dict[str, Path]:
    """The task's `files:` as {path relative to the node's working dir: local file}; local paths are
    relative to the YAML."""
    shipped = {}
    for entry in task.get("files") or []:
        local, _, remote = entry.partition(":") if isinstance(entry, str) else (entry["local_path"], ":", entry["path"])
        remote = remote or local
        source = (task_path.parent / local).resolve()
        assert source.is_file(), f"{task_path.name} ships {local}, which does not exist"
        assert not Path(remote).is_absolute(), f"{task_path.name} ships {local} outside the working dir"
        shipped[remote] = source
    return shipped


def check_shipped_files(task_path: Path, task: dict, workdir: Path) -> None:
    """The task's `files:` must land where the repository already has them, so the task's commands
    work the same from a node's working dir and from the repository root."""
    for remote, source in shipped_files(task_path, task).items():
        assert (workdir / remote).resolve() == source, (
            f"{task_path.name} ships {source.name} to {remote}, not where the repository has it"
        )


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


# An image that already holds everything tasks/ray-bootstrap.sh ensures: Ray at cloudrl's pin answers the
# version check, every trainer package imports, pip has nothing to do. Any other command (ray_bringup.py's steps,
# the retriever server) runs on this interpreter.
_READY_IMAGE_PYTHON = """#!/usr/bin/env bash
case "$1 $2" in
    "-c import ray; print(ray.__version__)") echo {ray_version} ;;
    "-c import "*) [[ "$2" =~ ^import\\ [A-Za-z0-9_.]+$ ]] || exec {python} "$@" ;;
    "-m pip") ;;
    *) exec {python} "$@" ;;
esac
"""


def ready_image_python(directory: Path) -> Path:
    """A CLOUDRL_PYTHON for the bootstrap whose image needs no install: the bootstrap's paths past its install
    step run in a second instead of waiting on pip and the imports of the trainer's packages."""
    from cloudrl.cli.pins import RAY_VERSION

    path = directory / "python3"
    path.write_text(_READY_IMAGE_PYTHON.format(ray_version=RAY_VERSION, python=sys.executable))
    path.chmod(0o755)
    return path

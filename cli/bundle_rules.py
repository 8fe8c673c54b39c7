"""What `cloudrl validate` checks in one parsed dstack YAML beyond dstack's own parser.

2. Rules the dstack server checks only after `dstack apply` has planned, or that fail even later
   (dstack 0.22.5): resource names, a fleet with exactly one of `nodes`/`ssh_config`, cloud-only keys on
   SSH fleets (and SSH-only keys on cloud fleets), SSH hosts without a user or key, GPU specs whose
   name or count dstack would not read as meant, `files:` that do not exist.
3. cloudrl's own: the Ray pin of the shipped bootstrap equals cloudrl's (cli/pins.py), no dashboard on a
   non-loopback address, no unpinned `pip install ray`, fleets for multi-node tasks use `placement:
   cluster`, fleets live in fleets/ and tasks in tasks/. More of them, and the rules that compare a task
   with its fleets, are in bundle_checks.py.

Layer 1 (dstack's parser) and the command live in validate.py, which imports this module. dstack is
reached only through dstack_compat.py, inside the functions: `cloudrl --help` stays fast and works
without it.
"""

from __future__ import annotations

import difflib
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dstack_compat import dstack_api
from .pins import RAY_VERSION

BUNDLE_DIRS = {"fleets": "fleet", "tasks": "task"}
# The pin line of tasks/ray-bootstrap.sh.
RAY_PIN = re.compile(r'^\s*CLOUDRL_RAY_VERSION=["\']?([^"\'\s]*)["\']?', re.MULTILINE)
DASHBOARD_HOST = re.compile(r"--dashboard-host(?:=|\s+)[\"']?([^\s\"']+)")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
# A command or script that starts Ray: `ray start`, or Ray's CLI module run by a chosen interpreter.
STARTS_RAY = re.compile(r"\bray start\b|\bray\.scripts\.scripts\b")
# `H100x8`, `8xH100`, `A100*4`: a count glued to a GPU name.
GLUED_COUNT = re.compile(r"^(?:(\d+)\s*[x×*]\s*([A-Za-z].*)|([A-Za-z].*?)\s*[x×*]\s*(\d+))$")


@dataclass(frozen=True)
class Problem:
    """One thing `dstack apply` (or the cluster) would trip on."""

    path: str
    key: str
    message: str
    fix: str
    # A warning is printed but does not fail `cloudrl validate` (something it cannot check from here).
    warning: bool = False

    def __str__(self) -> str:
        line = f"{'warning: ' if self.warning else ''}{self.path}: {self.key}: {self.message} — {self.fix}"
        return " ".join(line.split())  # one line, always


def dstack_models() -> dict[str, Any]:
    """The parts of dstack's configuration models the three layers read."""
    api = dstack_api()
    return {
        "parse": api.parse_apply_configuration,
        "error": api.ConfigurationError,
        "GPUSpec": api.GPUSpec,
        # Fields of the top level and of the nested mappings people mistype most, for "did you mean".
        "fields": {
            "task": api.TaskConfiguration,
            "fleet": api.FleetConfiguration,
            "service": api.ServiceConfiguration,
            "dev-environment": api.DevEnvironmentConfiguration,
            "resources": api.ResourcesSpec,
            "groups": api.NodeGroup,
            "ssh_config": api.SSHParams,
            "hosts": api.SSHHostParams,
            "proxy_jump": api.SSHProxyParams,
        },
        "cloud_fleet_keys": set(api.CloudFleetProps.model_fields),
        "ssh_fleet_keys": set(api.SSHFleetProps.model_fields),
    }


def rule_problems(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    """Layers 2 and 3 for one YAML whose top level is a mapping with a `type:`."""
    checks = [_dir_rules, _name_rules]
    if data.get("type") == "fleet":
        checks += [_fleet_kind_rules, _ssh_rules, _placement_rules]
    if data.get("type") == "task":
        checks += [_files_rules, _ray_rules]
    problems = []
    for resources_key, resources in _resources(data):
        problems += _gpu_rules(rel, resources_key, resources)
    for check in checks:
        problems += check(rel, data, path, root)
    return problems


def rel_path(path: Path, root: Path) -> str:
    """`path` as written from the bundle root (a symlink keeps its own name, not its target's)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    return str(path) if rel.startswith("..") else Path(rel).as_posix()


# --- 2. what the dstack server checks later -------------------------------------------------------


def _dir_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    folder = Path(rel).parts[0] if len(Path(rel).parts) > 1 else ""
    want = BUNDLE_DIRS.get(folder)
    if want and data.get("type") != want:
        return [
            Problem(
                rel,
                "type",
                f"is `{data.get('type')}` but {folder}/ holds `type: {want}` files",
                f"move the file or set `type: {want}`",
            )
        ]
    return []


def _name_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    name = data.get("name")
    if name is None or (isinstance(name, str) and dstack_api().is_valid_resource_name(name)):
        return []
    suggestion = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")
    suggestion = re.sub(r"^[^a-z]+", "", suggestion)[:41] or "cloudrl"
    return [
        Problem(
            rel,
            "name",
            f"{name!r} is rejected by the dstack server (^[a-z][a-z0-9-]{{1,40}}$)",
            f"use lowercase letters, digits and dashes, starting with a letter, e.g. `{suggestion}`",
        )
    ]


def _fleet_kind_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    has_nodes, has_ssh = data.get("nodes") is not None, data.get("ssh_config") is not None
    if has_nodes and has_ssh:
        return [
            Problem(
                rel,
                "ssh_config",
                "a fleet has either `nodes` (cloud) or `ssh_config` (your hosts), not both",
                "remove `nodes` for an SSH fleet, or `ssh_config` for a cloud fleet",
            )
        ]
    if not has_nodes and not has_ssh:
        return [
            Problem(
                rel,
                "nodes",
                "a fleet needs `nodes` (cloud) or `ssh_config` (your hosts)",
                "add `nodes: 2` for a cloud fleet or `ssh_config:` with `hosts:` for on-prem",
            )
        ]
    dstack = dstack_models()
    problems = []
    if has_ssh:
        for key in sorted(dstack["cloud_fleet_keys"] & set(data)):
            problems.append(
                Problem(
                    rel,
                    key,
                    "is a cloud fleet key; the dstack server rejects it on an SSH fleet",
                    "remove it: SSH fleets use what the hosts have",
                )
            )
    else:
        for key in sorted(dstack["ssh_fleet_keys"] & set(data)):
            problems.append(
                Problem(
                    rel,
                    key,
                    "is an SSH fleet key; the dstack server rejects it on a cloud fleet",
                    "remove it (set env in the task instead)" if key == "env" else "remove it",
                )
            )
    return problems


def _ssh_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    ssh = data.get("ssh_config")
    if not isinstance(ssh, dict) or not isinstance(ssh.get("hosts"), list):
        return []
    problems = []
    internal_ips = 0
    for i, host in enumerate(ssh["hosts"]):
        params = host if isinstance(host, dict) else {"hostname": host}
        name = params.get("hostname", f"#{i}")
        if not (params.get("user") or ssh.get("user")):
            problems.append(
                Problem(
                    rel,
                    f"ssh_config.hosts[{i}]",
                    f"no SSH user for host {name}",
                    "set `user:` under ssh_config (all hosts) or on the host",
                )
            )
        if not (params.get("identity_file") or ssh.get("identity_file")):
            problems.append(
                Problem(
                    rel,
                    f"ssh_config.hosts[{i}]",
                    f"no SSH key for host {name}",
                    "set `identity_file:` under ssh_config (all hosts) or on the host",
                )
            )
        internal_ips += bool(params.get("internal_ip"))
    if internal_ips and internal_ips != len(ssh["hosts"]):
        problems.append(
            Problem(
                rel,
                "ssh_config.hosts",
                "`internal_ip` is set on some hosts only",
                "set it on every host, or on none and use `network:`",
            )
        )
    if internal_ips and ssh.get("network"):
        problems.append(
            Problem(
                rel, "ssh_config.network", "`network` and hosts' `internal_ip` exclude each other", "keep one of them"
            )
        )
    return problems


def _resources(data: dict) -> list[tuple[str, dict]]:
    found = []
    if isinstance(data.get("resources"), dict):
        found.append(("resources", data["resources"]))
    for i, group in enumerate(_list(data.get("groups"))):
        if isinstance(group, dict) and isinstance(group.get("resources"), dict):
            found.append((f"groups[{i}].resources", group["resources"]))
    return found


def _gpu_rules(rel: str, resources_key: str, resources: dict) -> list[Problem]:
    """A GPU spec dstack parses but not as meant: a count glued to the name (`H100x8` is one GPU called
    H100x8, for which no cloud has offers), a name no cloud sells, or no count at all (`1..`)."""
    if "gpu" not in resources or resources["gpu"] is None:
        return []
    key, spec = f"{resources_key}.gpu", resources["gpu"]
    dstack = dstack_models()
    if isinstance(spec, (str, int)):
        try:
            parsed = dstack["GPUSpec"].parse(spec)
        except ValueError:
            return []  # the parser has said it already
    elif isinstance(spec, dict):
        parsed = spec
    else:
        return []
    names = parsed.get("name") or []
    names = names if isinstance(names, list) else [names]
    known = _known_gpu_names()
    for name in names:
        if not known or str(name).lower() in known:
            continue
        glued = GLUED_COUNT.match(str(name))
        if glued:
            gpu, count = (glued.group(2), glued.group(1)) if glued.group(1) else (glued.group(3), glued.group(4))
            return [
                Problem(
                    rel,
                    key,
                    f"dstack reads {spec!r} as one GPU named {name!r}, not {count} GPUs",
                    f"write the count as its own token: `gpu: {str(spec).replace(str(name), f'{gpu}:{count}')}`",
                )
            ]
        close = [known[c] for c in difflib.get_close_matches(str(name).lower(), sorted(known), n=3)]
        return [
            Problem(
                rel,
                key,
                f"no GPU is named {name!r}, so dstack would find no offers",
                "use a GPU name dstack knows, e.g. " + (", ".join(close) if close else "H100, A100, MI300X"),
            )
        ]
    if parsed.get("count") is None:
        return [
            Problem(
                rel,
                key,
                f"{spec!r} gives no GPU count, which dstack reads as 1 or more GPUs",
                f"add the count per node, e.g. `gpu: {spec}:8`",
            )
        ]
    return []


def _known_gpu_names() -> dict[str, str]:
    """{lowercase: as written} for the GPU names dstack matches offers against."""
    try:
        from gpuhunt import KNOWN_ACCELERATORS  # dstack's own catalogue of GPU names
    except ImportError:
        return {}
    return {accelerator.name.lower(): accelerator.name for accelerator in KNOWN_ACCELERATORS}


def _files_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    problems = []
    for i, local in enumerate(_shipped(data)):
        if local is not None and not (path.parent / local).exists():
            problems.append(
                Problem(
                    rel,
                    f"files[{i}]",
                    f"ships {local}, which does not exist",
                    f"create it, or fix the path (relative to {rel_path(path.parent, root)}/)",
                )
            )
    return problems


def _shipped(data: dict) -> list[str | None]:
    """The local paths of the task's `files:` entries (None where an entry is not understood)."""
    shipped: list[str | None] = []
    for entry in _list(data.get("files")):
        local = (
            entry.split(":", 1)[0]
            if isinstance(entry, str)
            else (entry.get("local_path") if isinstance(entry, dict) else None)
        )
        shipped.append(local if isinstance(local, str) and local else None)
    return shipped


def _list(value: Any) -> list:
    """A list the YAML should hold here; [] for any other shape (dstack's parser reports those)."""
    return value if isinstance(value, list) else []


# --- 3. cloudrl's own ----------------------------------------------------------------------------


def _commands(data: dict) -> list[tuple[str, str]]:
    """(key, command) for the task's commands and its node groups' commands."""
    found = [(f"commands[{i}]", c) for i, c in enumerate(_list(data.get("commands"))) if isinstance(c, str)]
    for g, group in enumerate(_list(data.get("groups"))):
        if isinstance(group, dict):
            found += [
                (f"groups[{g}].commands[{i}]", c)
                for i, c in enumerate(_list(group.get("commands")))
                if isinstance(c, str)
            ]
    return found


def _is_multinode(data: dict) -> bool:
    nodes = data.get("nodes")
    groups = _list(data.get("groups"))
    return (isinstance(nodes, int) and nodes > 1) or sum(
        g.get("nodes", 1) for g in groups if isinstance(g, dict) and isinstance(g.get("nodes", 1), int)
    ) > 1


def _runs_ray(data: dict, path: Path) -> bool:
    texts = [c for _, c in _commands(data)] + [_read(path.parent / local) for local in _shipped(data) if local]
    return any(STARTS_RAY.search(text) or "ray-bootstrap" in text for text in texts)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def _placement_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    nodes = data.get("nodes")
    size = 0
    if isinstance(nodes, int):
        size = nodes
    elif isinstance(nodes, str):
        size = max((int(n) for n in re.findall(r"\d+", nodes)), default=0)
    elif isinstance(nodes, dict):
        size = max((v for v in nodes.values() if isinstance(v, int)), default=0)
    hosts = (data.get("ssh_config") or {}).get("hosts") if isinstance(data.get("ssh_config"), dict) else None
    size = max(size, len(hosts) if isinstance(hosts, list) else 0)
    # An explicit `placement: any` is a fleet for single-node tasks (fleets/rollout-spot.dstack.yml); a task of
    # several nodes that names it is refused where tasks meet fleets (bundle_checks.fleet_problems).
    if size > 1 and data.get("placement") not in ("cluster", "any"):
        return [
            Problem(
                rel,
                "placement",
                "dstack runs multi-node tasks only on fleets with cluster placement",
                "set `placement: cluster`",
            )
        ]
    return []


def _ray_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    problems = []
    sources = [(rel, key, command) for key, command in _commands(data)]
    for local in _shipped(data):
        script = path.parent / local if local else None
        if script is None or not script.is_file():
            continue
        text = _read(script)
        script_rel = rel_path(script, root)
        sources += [(script_rel, f"line {n}", line) for n, line in enumerate(text.splitlines(), 1)]
        if not STARTS_RAY.search(text):
            continue
        pin = RAY_PIN.search(text)
        if pin is None:
            problems.append(
                Problem(
                    script_rel,
                    "CLOUDRL_RAY_VERSION",
                    "starts Ray without cloudrl's version pin",
                    f'add CLOUDRL_RAY_VERSION="{RAY_VERSION}" and install ray[default]==that',
                )
            )
        elif pin.group(1) != RAY_VERSION:
            problems.append(
                Problem(
                    script_rel,
                    "CLOUDRL_RAY_VERSION",
                    f"pins Ray {pin.group(1)} but cloudrl pins {RAY_VERSION}: the client on your "
                    f"machine would not match the cluster",
                    f'set CLOUDRL_RAY_VERSION="{RAY_VERSION}" (cli/pins.py)',
                )
            )
    for where, key, text in sources:
        for host in DASHBOARD_HOST.findall(text):
            if host not in LOOPBACK_HOSTS:
                problems.append(
                    Problem(
                        where,
                        key,
                        f"the Ray dashboard listens on {host}: anyone who reaches the node can submit jobs",
                        "use --dashboard-host=127.0.0.1; dstack forwards the port through its SSH tunnel",
                    )
                )
        problems += _unpinned_ray(where, key, text)
    return problems


def _unpinned_ray(rel: str, key: str, command: str) -> list[Problem]:
    """A Ray install (`pip`, `pip3`, `python -m pip`, `uv pip`) that is not cloudrl's pin, or that goes
    through `pip3`, which may belong to another Python than the one that runs Ray."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return []
    problems = []
    for i, word in enumerate(words):
        if word != "install" or i == 0 or words[i - 1] not in ("pip", "pip3"):
            continue
        for requirement in words[i + 1 :]:
            if requirement in ("&&", ";", "|", "||") or requirement.endswith(";"):
                break
            match = re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?(.*)$", requirement)
            if not match or match.group(1).lower() != "ray":
                continue
            if match.group(3) != f"=={RAY_VERSION}":
                problems.append(
                    Problem(
                        rel,
                        key,
                        f"installs {requirement!r}, not cloudrl's Ray {RAY_VERSION}",
                        f"pin it: 'ray[default]=={RAY_VERSION}'",
                    )
                )
            elif words[i - 1] == "pip3" and (i < 2 or words[i - 2] != "-m"):
                problems.append(
                    Problem(
                        rel,
                        key,
                        "installs Ray with `pip3`, which may belong to another Python "
                        "than the one that runs `ray start`",
                        "use `python3 -m pip install` with the interpreter that starts Ray",
                    )
                )
    return problems

"""`cloudrl validate`: check the dstack bundle (fleets/, tasks/) before `dstack apply` gets to see it.

Every YAML under fleets/ and tasks/ goes through three layers, and each problem is one line
`path: key: problem — fix`:

1. dstack's own configuration parser, the one `dstack apply` runs first (no server needed);
2. rules the dstack server checks only after `dstack apply` has planned, or that fail even later
   (dstack 0.22.5): resource names, a fleet with exactly one of `nodes`/`ssh_config`, cloud-only keys on
   SSH fleets (and SSH-only keys on cloud fleets), SSH hosts without a user or key, GPU specs whose
   name or count dstack would not read as meant, `files:` that do not exist;
3. cloudrl's own: the Ray pin of the shipped bootstrap equals cloudrl's (cli/pins.py), no dashboard on a
   non-loopback address, no unpinned `pip install ray`, multi-node Ray tasks start the head first,
   fleets for multi-node tasks use `placement: cluster`, fleets live in fleets/ and tasks in tasks/.

dstack is imported inside the functions: `cloudrl --help` stays fast and works without it.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from .errors import CloudrlError
from .pins import RAY_VERSION

BUNDLE_DIRS = {"fleets": "fleet", "tasks": "task"}
# What the dstack server accepts as a run, fleet, volume or gateway name.
RESOURCE_NAME = re.compile(r"^[a-z][a-z0-9-]{1,40}$")
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

    def __str__(self) -> str:
        return f"{self.path}: {self.key}: {self.message} — {self.fix}"


def bundle_files(root: Path) -> list[Path]:
    """The dstack YAMLs of the bundle: *.yml and *.yaml under root/fleets and root/tasks."""
    dirs = [root / name for name in BUNDLE_DIRS if (root / name).is_dir()]
    if not dirs:
        raise CloudrlError(f"no fleets/ or tasks/ in {root.resolve()}: run `cloudrl validate` in the cloudrl "
                           f"checkout or pass its path (cloudrl validate PATH)")
    return sorted(p for d in dirs for p in d.rglob("*") if p.suffix in (".yml", ".yaml") and p.is_file())


def validate_bundle(root: Path) -> list[Problem]:
    """Every problem in every bundle file, in file order; a script shared by several tasks is reported
    once."""
    problems: list[Problem] = []
    for path in bundle_files(root):
        for problem in validate_file(path, root):
            if problem not in problems:
                problems.append(problem)
    return problems


def validate_file(path: Path, root: Path) -> list[Problem]:
    """The problems of one dstack YAML; `root` is the bundle root, for the paths in the messages."""
    rel = _rel(path, root)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        return [Problem(rel, "-", f"is not valid YAML{where} ({problem})", "fix the YAML syntax there")]
    if not isinstance(data, dict) or "type" not in data:
        return [Problem(rel, "type", "no `type:` at the top",
                        "start the file with `type: task` (tasks/) or `type: fleet` (fleets/)")]

    problems = _parser_problems(rel, data)
    checks = [_dir_rules, _name_rules]
    if data.get("type") == "fleet":
        checks += [_fleet_kind_rules, _ssh_rules, _placement_rules]
    if data.get("type") == "task":
        checks += [_files_rules, _startup_order_rules, _ray_rules]
    for resources_key, resources in _resources(data):
        problems += _gpu_rules(rel, resources_key, resources)
    for check in checks:
        problems += check(rel, data, path, root)
    # One line per key: the parser's message wins over a later rule's on the same key.
    seen: set[tuple[str, str]] = set()
    unique = []
    for problem in problems:
        if (problem.path, problem.key) not in seen or problem.key == "-":
            seen.add((problem.path, problem.key))
            unique.append(problem)
    return unique


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# --- 1. dstack's parser --------------------------------------------------------------------------


def _dstack_models() -> dict[str, Any]:
    try:
        from dstack._internal.core.errors import ConfigurationError
        from dstack._internal.core.models import configurations, fleets, resources
    except ImportError:
        raise CloudrlError("dstack is not installed: pip install 'cloudrl[dstack]' (`cloudrl validate` runs "
                           "dstack's own configuration parser)") from None
    return {
        "parse": configurations.parse_apply_configuration,
        "error": ConfigurationError,
        "GPUSpec": resources.GPUSpec,
        # Fields of the top level and of the nested mappings people mistype most, for "did you mean".
        "fields": {
            "task": configurations.TaskConfiguration,
            "fleet": fleets.FleetConfiguration,
            "service": configurations.ServiceConfiguration,
            "dev-environment": configurations.DevEnvironmentConfiguration,
            "resources": resources.ResourcesSpec,
            "groups": configurations.NodeGroup,
            "ssh_config": fleets.SSHParams,
            "hosts": fleets.SSHHostParams,
            "proxy_jump": fleets.SSHProxyParams,
        },
        "cloud_fleet_keys": set(fleets.BackendFleetConfiguraionProps.model_fields),
        "ssh_fleet_keys": set(fleets.SSHFleetConfigurationProps.model_fields),
    }


def _parser_problems(rel: str, data: dict) -> list[Problem]:
    dstack = _dstack_models()
    try:
        dstack["parse"](data)
        return []
    except dstack["error"] as e:
        errors = e.args[0].errors() if e.args and hasattr(e.args[0], "errors") else None
        if errors is None:
            return [Problem(rel, "-", f"dstack rejects it: {e}", "fix what dstack names")]
    problems = []
    for err in errors:
        key = _key_of(data, err["loc"], names_a_key=err["type"] in ("missing", "extra_forbidden"))
        message, fix = _explain(err, key, data, dstack["fields"])
        problems.append(Problem(rel, key, message, fix))
    # A union (e.g. an SSH host is a string or a mapping) reports every arm; drop the arm errors on a key
    # when a deeper key explains the problem.
    keys = [p.key for p in problems]
    return [p for p in problems if not any(k != p.key and k.startswith(p.key) for k in keys)]


def _key_of(data: dict, loc: tuple, names_a_key: bool) -> str:
    """The YAML key a pydantic error location points at, skipping pydantic's own steps (the `type`
    tag, union arms, the fields a shorthand string such as `gpu: H100:8` is parsed into). When the
    error is about a key itself (missing, unknown), the last step is that key even if absent."""
    loc = list(loc)
    if loc and loc[0] == data.get("type"):
        loc = loc[1:]
    if not loc:
        return "type"
    key, node = "", data
    for i, step in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(step, str) and (step in node or (last and names_a_key)):
            key = f"{key}.{step}" if key else step
            node = node.get(step)
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            key, node = f"{key}[{step}]", node[step]
    return key or "type"


def _explain(err: dict, key: str, data: dict, fields: dict[str, Any]) -> tuple[str, str]:
    kind = err["type"]
    msg = err["msg"].removeprefix("Value error, ")
    last = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
    if kind == "union_tag_invalid":
        return (f"dstack has no configuration type {data.get('type')!r}",
                "use `type: task` (in tasks/) or `type: fleet` (in fleets/)")
    if kind == "extra_forbidden":
        parent = [re.sub(r"\[\d+\]$", "", part) for part in key.split(".")[:-1]]
        model = fields.get(parent[-1] if parent else data.get("type"))
        close = difflib.get_close_matches(last, list(model.model_fields) if model else [], n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        return (f"dstack does not know the key `{last}`", f"remove it or fix its spelling{hint}")
    if kind == "missing":
        return (f"`{last}` is required here", f"add `{last}:`")
    if key.endswith("gpu") or ".gpu." in key:
        return (f"dstack cannot read this GPU spec ({msg})",
                "write NAME:COUNT or MEMORY:COUNT, e.g. `gpu: H100:8` or `gpu: 80GB..:8`")
    if msg.startswith("Input should be "):
        return (f"dstack does not accept {_value_at(data, key)!r}", "set it to " + msg[len("Input should be "):])
    return (f"dstack rejects it: {msg}", "fix the value as dstack says; see dstack's reference for this key")


def _value_at(data: Any, key: str) -> Any:
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            node = node[int(part[1:-1])] if isinstance(node, list) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
    return node


# --- 2. what the dstack server checks later -------------------------------------------------------


def _dir_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    folder = Path(rel).parts[0] if len(Path(rel).parts) > 1 else ""
    want = BUNDLE_DIRS.get(folder)
    if want and data.get("type") != want:
        return [Problem(rel, "type", f"is `{data.get('type')}` but {folder}/ holds `type: {want}` files",
                        f"move the file or set `type: {want}`")]
    return []


def _name_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    name = data.get("name")
    if name is None or (isinstance(name, str) and RESOURCE_NAME.match(name)):
        return []
    suggestion = re.sub(r"[^a-z0-9-]+", "-", str(name).lower()).strip("-")
    suggestion = re.sub(r"^[^a-z]+", "", suggestion)[:41] or "cloudrl"
    return [Problem(rel, "name", f"{name!r} is rejected by the dstack server (^[a-z][a-z0-9-]{{1,40}}$)",
                    f"use lowercase letters, digits and dashes, starting with a letter, e.g. `{suggestion}`")]


def _fleet_kind_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    has_nodes, has_ssh = data.get("nodes") is not None, data.get("ssh_config") is not None
    if has_nodes and has_ssh:
        return [Problem(rel, "ssh_config", "a fleet has either `nodes` (cloud) or `ssh_config` (your hosts), "
                        "not both", "remove `nodes` for an SSH fleet, or `ssh_config` for a cloud fleet")]
    if not has_nodes and not has_ssh:
        return [Problem(rel, "nodes", "a fleet needs `nodes` (cloud) or `ssh_config` (your hosts)",
                        "add `nodes: 2` for a cloud fleet or `ssh_config:` with `hosts:` for on-prem")]
    dstack = _dstack_models()
    problems = []
    if has_ssh:
        for key in sorted(dstack["cloud_fleet_keys"] & set(data)):
            problems.append(Problem(rel, key, "is a cloud fleet key; the dstack server rejects it on an SSH fleet",
                                    "remove it: SSH fleets use what the hosts have"))
    else:
        for key in sorted(dstack["ssh_fleet_keys"] & set(data)):
            problems.append(Problem(rel, key, "is an SSH fleet key; the dstack server rejects it on a cloud fleet",
                                    "remove it (set env in the task instead)" if key == "env" else "remove it"))
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
            problems.append(Problem(rel, f"ssh_config.hosts[{i}]", f"no SSH user for host {name}",
                                    "set `user:` under ssh_config (all hosts) or on the host"))
        if not (params.get("identity_file") or ssh.get("identity_file")):
            problems.append(Problem(rel, f"ssh_config.hosts[{i}]", f"no SSH key for host {name}",
                                    "set `identity_file:` under ssh_config (all hosts) or on the host"))
        internal_ips += bool(params.get("internal_ip"))
    if internal_ips and internal_ips != len(ssh["hosts"]):
        problems.append(Problem(rel, "ssh_config.hosts", "`internal_ip` is set on some hosts only",
                                "set it on every host, or on none and use `network:`"))
    if internal_ips and ssh.get("network"):
        problems.append(Problem(rel, "ssh_config.network", "`network` and hosts' `internal_ip` exclude each other",
                                "keep one of them"))
    return problems


def _resources(data: dict) -> list[tuple[str, dict]]:
    found = []
    if isinstance(data.get("resources"), dict):
        found.append(("resources", data["resources"]))
    for i, group in enumerate(data.get("groups") or []):
        if isinstance(group, dict) and isinstance(group.get("resources"), dict):
            found.append((f"groups[{i}].resources", group["resources"]))
    return found


def _gpu_rules(rel: str, resources_key: str, resources: dict) -> list[Problem]:
    """A GPU spec dstack parses but not as meant: a count glued to the name (`H100x8` is one GPU called
    H100x8, for which no cloud has offers), a name no cloud sells, or no count at all (`1..`)."""
    if "gpu" not in resources or resources["gpu"] is None:
        return []
    key, spec = f"{resources_key}.gpu", resources["gpu"]
    dstack = _dstack_models()
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
    names = [names] if isinstance(names, str) else names
    known = _known_gpu_names()
    for name in names:
        if not known or str(name).lower() in known:
            continue
        glued = GLUED_COUNT.match(str(name))
        if glued:
            gpu, count = (glued.group(2), glued.group(1)) if glued.group(1) else (glued.group(3), glued.group(4))
            return [Problem(rel, key, f"dstack reads {spec!r} as one GPU named {name!r}, not {count} GPUs",
                            f"write the count as its own token: `gpu: {str(spec).replace(name, f'{gpu}:{count}')}`")]
        close = [known[c] for c in difflib.get_close_matches(str(name).lower(), sorted(known), n=3)]
        return [Problem(rel, key, f"no GPU is named {name!r}, so dstack would find no offers",
                        "use a GPU name dstack knows, e.g. " + (", ".join(close) if close else "H100, A100, MI300X"))]
    if parsed.get("count") is None:
        return [Problem(rel, key, f"{spec!r} gives no GPU count, which dstack reads as 1 or more GPUs",
                        f"add the count per node, e.g. `gpu: {spec}:8`")]
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
            problems.append(Problem(rel, f"files[{i}]", f"ships {local}, which does not exist",
                                    f"create it, or fix the path (relative to {_rel(path.parent, root)}/)"))
    return problems


def _shipped(data: dict) -> list[str | None]:
    """The local paths of the task's `files:` entries (None where an entry is not understood)."""
    shipped: list[str | None] = []
    for entry in data.get("files") or []:
        if isinstance(entry, str):
            shipped.append(entry.split(":", 1)[0])
        elif isinstance(entry, dict):
            shipped.append(entry.get("local_path"))
        else:
            shipped.append(None)
    return shipped


# --- 3. cloudrl's own ----------------------------------------------------------------------------


def _commands(data: dict) -> list[tuple[str, str]]:
    """(key, command) for the task's commands and its node groups' commands."""
    found = [(f"commands[{i}]", c) for i, c in enumerate(data.get("commands") or []) if isinstance(c, str)]
    for g, group in enumerate(data.get("groups") or []):
        if isinstance(group, dict):
            found += [(f"groups[{g}].commands[{i}]", c)
                      for i, c in enumerate(group.get("commands") or []) if isinstance(c, str)]
    return found


def _is_multinode(data: dict) -> bool:
    nodes = data.get("nodes")
    groups = data.get("groups") or []
    return (isinstance(nodes, int) and nodes > 1) or sum(
        g.get("nodes", 1) for g in groups if isinstance(g, dict) and isinstance(g.get("nodes", 1), int)) > 1


def _runs_ray(data: dict, path: Path) -> bool:
    texts = [c for _, c in _commands(data)] + [_read(path.parent / local) for local in _shipped(data) if local]
    return any(STARTS_RAY.search(text) or "ray-bootstrap" in text for text in texts)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def _startup_order_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    order = data.get("startup_order")
    if not (_is_multinode(data) and _runs_ray(data, path)) or order in ("master-first", "any"):
        return []
    if order is None:
        return [Problem(rel, "startup_order", "not set, so dstack may start workers before the Ray head",
                        "set `startup_order: master-first` (or `any` to pull images on all nodes at once; "
                        "the bootstrap's workers retry either way)")]
    return [Problem(rel, "startup_order", f"{order}: the Ray head starts only after every worker runs",
                    "set `startup_order: master-first`")]


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
    if size > 1 and data.get("placement") != "cluster":
        return [Problem(rel, "placement", "dstack runs multi-node tasks only on fleets with cluster placement",
                        "set `placement: cluster`")]
    return []


def _ray_rules(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    problems = []
    sources = [(rel, key, command) for key, command in _commands(data)]
    for i, local in enumerate(_shipped(data)):
        script = path.parent / local if local else None
        if script is None or not script.is_file():
            continue
        text = _read(script)
        script_rel = _rel(script, root)
        sources += [(script_rel, f"line {n}", line) for n, line in enumerate(text.splitlines(), 1)]
        if not STARTS_RAY.search(text):
            continue
        pin = RAY_PIN.search(text)
        if pin is None:
            problems.append(Problem(script_rel, "CLOUDRL_RAY_VERSION", "starts Ray without cloudrl's version pin",
                                    f'add CLOUDRL_RAY_VERSION="{RAY_VERSION}" and install ray[default]==that'))
        elif pin.group(1) != RAY_VERSION:
            problems.append(Problem(script_rel, "CLOUDRL_RAY_VERSION",
                                    f"pins Ray {pin.group(1)} but cloudrl pins {RAY_VERSION}: the client on your "
                                    f"machine would not match the cluster",
                                    f'set CLOUDRL_RAY_VERSION="{RAY_VERSION}" (cli/pins.py)'))
    for where, key, text in sources:
        for host in DASHBOARD_HOST.findall(text):
            if host not in LOOPBACK_HOSTS:
                problems.append(Problem(where, key, f"the Ray dashboard listens on {host}: anyone who reaches "
                                        f"the node can submit jobs", "use --dashboard-host=127.0.0.1; dstack "
                                        "forwards the port through its SSH tunnel"))
        if where == rel:  # pins in the YAML's own commands; the bootstrap installs its pin by variable
            problems += _unpinned_ray(rel, key, text)
    return problems


def _unpinned_ray(rel: str, key: str, command: str) -> list[Problem]:
    try:
        words = shlex.split(command)
    except ValueError:
        return []
    problems = []
    for i, word in enumerate(words):
        if word != "install" or i == 0 or words[i - 1] != "pip":
            continue
        for requirement in words[i + 1:]:
            if requirement in ("&&", ";", "|"):
                break
            match = re.match(r"^([A-Za-z0-9._-]+)(\[[^\]]*\])?(.*)$", requirement)
            if match and match.group(1).lower() == "ray" and match.group(3) != f"=={RAY_VERSION}":
                problems.append(Problem(rel, key, f"installs {requirement!r}, not cloudrl's Ray {RAY_VERSION}",
                                        f"pin it: 'ray[default]=={RAY_VERSION}'"))
    return problems


# --- the command ---------------------------------------------------------------------------------


def validate(
    root: Annotated[Path, typer.Argument(
        help="The cloudrl checkout whose fleets/ and tasks/ to check.", show_default="the current directory")
    ] = Path("."),
) -> None:
    """Check every dstack YAML under fleets/ and tasks/ as `dstack apply` and the dstack server would.

    dstack's own parser (no server needed), then the rules dstack checks only server-side, then cloudrl's (Ray pin, loopback dashboard). One line per problem: file, key, problem, fix; exit 1 if any.
    """
    files = bundle_files(root)
    problems = validate_bundle(root)
    for problem in problems:
        typer.echo(str(problem))
    if problems:
        typer.secho(f"{len(problems)} problem(s) in {len({p.path for p in problems})} file(s); "
                    f"fix them before `dstack apply`", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {len(files)} files in fleets/ and tasks/ pass dstack's parser, its server-side "
               f"rules and cloudrl's")

"""More of `cloudrl validate`'s rules: what would make a bundle fail or surprise on a real cloud although
dstack's parser accepts it.

Per task or fleet: a GPU spec that pins no vendor (dstack's own defaulting decides, run here), the Ray
dashboard port not forwarded from the head, changed, or listed on a worker group; a command that runs a
script no `files:` entry ships, or the bootstrap shipped without the files beside it that it uses; secrets
written into `env:`; a Ray task without the RAY_AUTH_TOKEN the bootstrap requires; an image whose tag names
a vLLM outside cloudrl's supported line. Per shipped script: CRLF line endings and what `bash -n` rejects.
Across files: a task compared with every fleet of the bundle it names in `fleets:` (node count, disk,
memory, spot policy, GPU vendor and count).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

from cloudrl.trainer.presets import load_yaml

from .bundle_rules import Problem, _commands, _list, _shipped, rel_path
from .dstack_compat import dstack_api
from .pins import DASHBOARD_PORT

# The vLLM line cloudrl's rollouts support: pyproject's `vllm>=0.32,<0.33` (a test keeps them equal).
SUPPORTED_VLLM = "0.32"
# Images the bundle names whose existence could not be confirmed when it was written: a warning, not an error.
UNCONFIRMED_IMAGES = {"vllm/vllm-openai-rocm:v0.32.0"}
VLLM_IN_TAG = re.compile(r"vllm[_-]?v?(\d+)\.(\d+)|vllm[^:]*:v?(\d+)\.(\d+)", re.IGNORECASE)
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)
SCRIPT_WORD = re.compile(r"^[\w./-]+\.(sh|py)$")
# The files tasks/ray-bootstrap.sh uses from its own directory, so a task ships them beside it; and what for.
BOOTSTRAP_FILES = {
    "ray_bringup.py": "which every node runs (its Ray flags; on the head the wait for the nodes, the fabric "
    "check, the ready line)",
    "retriever.sh": "which it sources when CLOUDRL_RETRIEVER_INDEX is set",
}


def task_and_fleet_problems(rel: str, data: dict, path: Path, root: Path) -> list[Problem]:
    problems = _vendor_problems(rel, data) + _secret_problems(rel, data)
    if data.get("type") == "task":
        problems += _image_problems(rel, data) + _files_vs_commands(rel, data)
        if _runs_bootstrap(data, path):
            problems += _dashboard_port_problems(rel, data) + _auth_problems(rel, data) + _exposure_warnings(rel, data)
        for local in _shipped(data):
            if local and (path.parent / local).is_file() and local.endswith(".sh"):
                problems += script_problems(path.parent / local, root)
    return problems


def _runs_bootstrap(data: dict, path: Path) -> bool:
    """The task runs cloudrl's bootstrap (not a Ray of its own, whose ports and auth are its business)."""
    return any("ray-bootstrap" in command for _, command in _commands(data))


# --- GPU vendor ----------------------------------------------------------------------------------


def _resource_specs(data: dict) -> list[tuple[str, Any]]:
    """(key, dstack ResourcesSpec) of the file's resources and its groups' resources that dstack parses."""
    api = dstack_api()
    found = []
    entries = [("resources", data.get("resources"))] + [
        (f"groups[{i}].resources", g.get("resources"))
        for i, g in enumerate(_list(data.get("groups")))
        if isinstance(g, dict)
    ]
    for key, raw in entries:
        if isinstance(raw, dict):
            try:
                found.append((key, api.ResourcesSpec.model_validate(raw)))
            except Exception:  # the parser reports it
                continue
    return found


def _vendor(spec: Any, image: str | None, docker: Any) -> Any:
    """The GPU vendor dstack settles on for this spec (dstack's own defaulting), None if it pins none."""
    gpu = spec.gpu.model_copy(deep=True)
    dstack_api().set_default_gpu_spec_vendor(gpu_spec=gpu, image=image, docker=docker)
    return gpu.vendor


def _vendor_problems(rel: str, data: dict) -> list[Problem]:
    # Fleets have no image: dstack leaves their vendor open unless the spec or a GPU name pins it.
    is_task = data.get("type") == "task"
    image = data.get("image") if is_task else "-"
    problems = []
    for key, spec in _resource_specs(data):
        if spec.gpu is None or spec.gpu.count.max == 0 or (is_task and image is None and not data.get("docker")):
            continue
        if _vendor(spec, image, data.get("docker")) is None:
            raw = str((data.get("resources") if key == "resources" else _group(data, key).get("resources"))["gpu"])
            vendor = "amd" if "rocm" in str(data.get("image", "")).lower() else "nvidia"
            why = (
                "with `image:` set dstack does not default to NVIDIA"
                if is_task
                else "a fleet does not default to NVIDIA"
            )
            problems.append(
                Problem(
                    rel,
                    f"{key}.gpu",
                    f"{raw!r} names no GPU vendor: {why}, so the nodes may be "
                    "AMD, Intel Gaudi or another vendor the tasks' image cannot use",
                    f"name it: `gpu: {vendor}:{raw}`",
                )
            )
    return problems


def _group(data: dict, key: str) -> dict:
    return data["groups"][int(re.search(r"\d+", key).group())]


# --- secrets, image, dashboard, auth, files ------------------------------------------------------


def _env_items(data: dict) -> list[tuple[str, str, str | None]]:
    """(key, name, value or None when passed by name) of the file's `env`."""
    raw = data.get("env")
    if isinstance(raw, dict):
        return [(f"env.{k}", str(k), None if v is None else str(v)) for k, v in raw.items()]
    items = []
    for i, entry in enumerate(_list(raw)):
        if isinstance(entry, str):
            name, sep, value = entry.partition("=")
            items.append((f"env[{i}]", name.strip(), value if sep else None))
    return items


def _secret_problems(rel: str, data: dict) -> list[Problem]:
    problems = []
    for key, name, value in _env_items(data):
        if value and SECRET_NAME.search(name) and "${{" not in value:
            problems.append(
                Problem(
                    rel,
                    key,
                    f"writes the value of the secret {name} into the file: it is stored in plain text in the "
                    f"repository and with the run on the dstack server",
                    f"pass it by name (`- {name}`, read from your shell at `dstack apply`) or as a dstack secret "
                    f"(`- {name}=${{{{ secrets.{name.lower()} }}}}`)",
                )
            )
    return problems


def _image_problems(rel: str, data: dict) -> list[Problem]:
    image = data.get("image")
    if not isinstance(image, str):
        return []
    match = VLLM_IN_TAG.search(image)
    if match:
        major, minor = match.group(1) or match.group(3), match.group(2) or match.group(4)
        if f"{major}.{minor}" != SUPPORTED_VLLM:
            return [
                Problem(
                    rel,
                    "image",
                    f"{image} ships vLLM {major}.{minor}, but cloudrl's vLLM rollouts and "
                    f"weight sync need vLLM {SUPPORTED_VLLM}.x",
                    f"use an image with vLLM {SUPPORTED_VLLM} (e.g. vllm/vllm-openai:v{SUPPORTED_VLLM}.0)",
                )
            ]
    if image in UNCONFIRMED_IMAGES:
        return [
            Problem(
                rel,
                "image",
                f"{image} was not confirmed to exist when this bundle was written",
                f"check it with `docker manifest inspect {image}` before `dstack apply`",
                warning=True,
            )
        ]
    return []


def dashboard_port(data: dict) -> int:
    for _, name, value in _env_items(data):
        if name == "CLOUDRL_DASHBOARD_PORT" and value and value.isdigit():
            return int(value)
    return DASHBOARD_PORT


def _container_ports(ports: Any) -> list[int]:
    found = []
    for entry in _list(ports):
        try:
            if isinstance(entry, int):
                found.append(entry)
            elif isinstance(entry, str):
                found.append(dstack_api().PortMapping.parse(entry).container_port)
            elif isinstance(entry, dict):
                found.append(int(entry["container_port"]))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def joins_a_running_cluster(data: dict) -> bool:
    """The task's nodes join the head of a cluster another run brought up (CLOUDRL_JOIN_HEAD in its env):
    it starts no head, so it has no dashboard to forward."""
    return any(name == "CLOUDRL_JOIN_HEAD" for _, name, _ in _env_items(data))


def _dashboard_port_problems(rel: str, data: dict) -> list[Problem]:
    port = dashboard_port(data)
    if joins_a_running_cluster(data):
        return []
    groups = [g for g in _list(data.get("groups")) if isinstance(g, dict)]
    head_key = "groups[0].ports" if groups else "ports"
    head_ports = _container_ports(groups[0].get("ports") if groups else data.get("ports"))
    problems = []
    if port not in head_ports:
        listed = f"forwards {', '.join(map(str, head_ports))} but" if head_ports else "does not forward"
        problems.append(
            Problem(
                rel,
                head_key,
                f"{listed} the head's dashboard port {port} (Jobs API, `cloudrl "
                f"submit`), so `dstack apply` gives you no way to reach it",
                f"list `- {port}` under {head_key} (the bootstrap's dashboard port is "
                f"CLOUDRL_DASHBOARD_PORT, default {DASHBOARD_PORT})",
            )
        )
    for i, group in enumerate(groups[1:], 1):
        if port in _container_ports(group.get("ports")):
            problems.append(
                Problem(
                    rel,
                    f"groups[{i}].ports",
                    f"lists the dashboard port {port} on a worker group: "
                    "only the head (rank 0) serves the dashboard, workers keep it closed",
                    f"remove {port} from this group's ports; the head group forwards it",
                )
            )
    return problems


def _auth_problems(rel: str, data: dict) -> list[Problem]:
    env = {name: value for _, name, value in _env_items(data)}
    if "RAY_AUTH_TOKEN" in env or str(env.get("CLOUDRL_RAY_AUTH", "")).lower() == "off":
        return []
    return [
        Problem(
            rel,
            "env",
            "does not pass RAY_AUTH_TOKEN: the bootstrap refuses to start Ray without token authentication",
            "add `- RAY_AUTH_TOKEN` (or `- RAY_AUTH_TOKEN=${{ secrets.ray_auth_token }}`) "
            "to env; `- CLOUDRL_RAY_AUTH=off` runs without it on a trusted network",
        )
    ]


TOKEN_MIN_BITS = 128


def token_bits(token: str) -> float:
    """About how many random bits a token can hold: 4 per hex character, 6 per character otherwise (the
    most a base64 character carries), so that `changeme` or `test` never pass for strong."""
    token = token.strip()
    return len(token) * (4 if re.fullmatch(r"[0-9a-fA-F]+", token) else 6)


def _exposure_warnings(rel: str, data: dict) -> list[Problem]:
    """Warnings (not failures) for switches that open the cluster wider: token auth off, a debugger on
    (its ports take no token), a cluster token too short to resist guessing."""
    import os

    env = {name: value for _, name, value in _env_items(data)}
    for name in ("CLOUDRL_RAY_AUTH", "CLOUDRL_DEBUGGER"):  # passed by name: read from this shell at apply
        if name in env and env[name] is None:
            env[name] = os.environ.get(name)
    warnings = []
    if str(env.get("CLOUDRL_RAY_AUTH") or "").lower() == "off":
        warnings.append(
            Problem(
                rel,
                "env.CLOUDRL_RAY_AUTH",
                "is off: anyone who reaches the cluster's Ray ports can run code on every node",
                "pass `- RAY_AUTH_TOKEN` instead (export RAY_AUTH_TOKEN=$(openssl rand -hex 32)), or keep the "
                "network private (docs/cluster.md, threat model)",
                warning=True,
            )
        )
    if env.get("CLOUDRL_DEBUGGER"):
        warnings.append(
            Problem(
                rel,
                "env.CLOUDRL_DEBUGGER",
                f"turns on Ray's debugger ({env['CLOUDRL_DEBUGGER']}): a paused worker listens for a debugger "
                f"that takes no token, and attaching runs code",
                "pass CLOUDRL_DEBUGGER only while debugging (`dstack apply -e CLOUDRL_DEBUGGER=...`), and attach "
                "through SSH (docs/debugging.md)",
                warning=True,
            )
        )
    if "RAY_AUTH_TOKEN" in env:
        token = env["RAY_AUTH_TOKEN"]
        source = "the file"
        if token is None:  # passed by name: dstack reads it from this shell at `dstack apply`
            token, source = os.environ.get("RAY_AUTH_TOKEN"), "your shell"
        if token and "${{" not in token and token_bits(token) < TOKEN_MIN_BITS:
            warnings.append(
                Problem(
                    rel,
                    "env.RAY_AUTH_TOKEN",
                    f"the token in {source} holds at most {token_bits(token):.0f} random bits, fewer than "
                    f"{TOKEN_MIN_BITS}: it can be guessed",
                    "make one with `export RAY_AUTH_TOKEN=$(openssl rand -hex 32)`",
                    warning=True,
                )
            )
    return warnings


def _files_vs_commands(rel: str, data: dict) -> list[Problem]:
    """A command that runs a relative script path which no `files:` entry lands at (the task has no repo:
    the node's working dir holds only what `files:` ships)."""
    if data.get("files") is None or data.get("repos"):
        return []
    landed = set()
    for entry in _list(data.get("files")):
        if isinstance(entry, str):
            local, _, remote = entry.partition(":")
            landed.add(Path(remote or local).as_posix())
        elif isinstance(entry, dict):
            landed.add(Path(str(entry.get("path") or entry.get("local_path"))).as_posix())
    problems = []
    for shipped in sorted(landed):
        if Path(shipped).name != "ray-bootstrap.sh":
            continue
        missing = [
            (name, (Path(shipped).parent / name).as_posix(), why)
            for name, why in BOOTSTRAP_FILES.items()
            if (Path(shipped).parent / name).as_posix() not in landed
        ]
        if missing:
            problems.append(
                Problem(
                    rel,
                    "files",
                    f"ships {shipped} without " + " and ".join(f"{sibling}, {why}" for _, sibling, why in missing),
                    "add " + " and ".join(f"`- {name}:{sibling}`" for name, sibling, _ in missing),
                )
            )
    for key, command in _commands(data):
        for word in command.split():
            if SCRIPT_WORD.match(word) and not word.startswith("/") and Path(word).as_posix() not in landed:
                problems.append(
                    Problem(
                        rel,
                        key,
                        f"runs {word}, which no `files:` entry ships (they land at: "
                        f"{', '.join(sorted(landed)) or 'nothing'})",
                        f"ship it (`- {Path(word).name}:{word}`) or run the path `files:` gives",
                    )
                )
    return problems


# --- the shipped bootstrap -----------------------------------------------------------------------


def script_problems(script: Path, root: Path) -> list[Problem]:
    rel = rel_path(script, root)
    raw = script.read_bytes()
    if b"\r\n" in raw:
        line = raw[: raw.index(b"\r\n")].count(b"\n") + 1
        return [
            Problem(
                rel,
                f"line {line}",
                "has Windows (CRLF) line endings: bash reads the `\\r` as part of each command",
                f"convert it to LF: `sed -i 's/\\r$//' {rel}` (or dos2unix)",
            )
        ]
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        first = result.stderr.strip().splitlines()[0] if result.stderr.strip() else "syntax error"
        where = re.search(r"line (\d+): (.*)", first)
        key, message = (f"line {where.group(1)}", where.group(2)) if where else ("-", first)
        return [
            Problem(rel, key, f"bash cannot parse it ({message})", f"fix the syntax there; `bash -n {rel}` checks it")
        ]
    return []


# --- a task against the fleets it names ----------------------------------------------------------


def fleet_problems(files: list[Path], root: Path) -> list[Problem]:
    """Each task that names fleets of this bundle in `fleets:`, compared with each of them."""
    api = dstack_api()
    fleets, tasks = {}, []
    for path in files:
        try:
            data = load_yaml(path.read_text(encoding="utf-8"))
            conf = api.parse_apply_configuration(data)
        except Exception:  # reported by the per-file layers
            continue
        if data.get("type") == "fleet" and conf.name:
            fleets[conf.name] = (rel_path(path, root), conf)
        elif data.get("type") == "task":
            tasks.append((rel_path(path, root), data, conf))
    problems = []
    for rel, data, task in tasks:
        if task.fleets is not None:
            for ref in task.fleets:  # names, or references with a project (imported fleets: not ours)
                name = ref if isinstance(ref, str) else None if getattr(ref, "project", None) else ref.name
                if name in fleets:
                    problems += _compare(rel, data, task, name, *fleets[name])
            continue
        # No `fleets:`: dstack may use any fleet, so it is a problem only when none of the bundle's fits.
        misfits = [(name, _compare(rel, data, task, name, *fleet)) for name, fleet in sorted(fleets.items())]
        if misfits and all(found for _, found in misfits):
            reasons = "; ".join(f"{found[0].key} {found[0].message}" for _, found in misfits)
            problems.append(
                Problem(
                    rel,
                    "fleets",
                    f"fits none of the bundle's fleets: {reasons}",
                    "make the task fit its fleet and name that fleet in `fleets:`",
                )
            )
    return problems


def _compare(rel: str, data: dict, task: Any, name: str, fleet_rel: str, fleet: Any) -> list[Problem]:
    where = f"fleet {name} ({fleet_rel})"
    groups = task.groups or []
    nodes = sum(g.nodes for g in groups) if groups else (task.nodes or 1)
    if fleet.ssh_config is not None:
        most, what = len(fleet.ssh_config.hosts), "hosts"
    else:
        most, what = (fleet.nodes.max if fleet.nodes.max is not None else None), "nodes at most"
    problems = []
    if most is not None and nodes > most:
        problems.append(
            Problem(
                rel,
                "groups" if groups else "nodes",
                f"asks for {nodes} nodes but {where} has {most} {what}: the run gets no offer",
                "lower it, or raise the fleet's " + ("hosts" if fleet.ssh_config else "`nodes` max (and target)"),
            )
        )
    placement = getattr(fleet.placement, "value", fleet.placement)
    if nodes > 1 and fleet.ssh_config is None and placement != "cluster":
        problems.append(
            Problem(
                rel,
                "groups" if groups else "nodes",
                f"asks for {nodes} nodes but {where} has `placement: {placement}`: dstack runs multi-node tasks "
                f"only on fleets with cluster placement",
                "set `placement: cluster` in the fleet, or run the task on one node",
            )
        )
    if fleet.ssh_config is not None:
        return problems  # SSH hosts have what they have: nothing more to compare from here
    ask_spot = task.spot_policy.value if task.spot_policy else "on-demand"
    fleet_spot = fleet.spot_policy.value if fleet.spot_policy else "on-demand"
    if ask_spot != fleet_spot and "auto" != ask_spot:
        problems.append(
            Problem(
                rel,
                "spot_policy",
                f"is {ask_spot} but {where} provisions {fleet_spot} instances, which a {ask_spot} run never uses",
                f"use the same spot_policy in both (`spot_policy: {fleet_spot}` here, or {ask_spot} in the fleet)",
            )
        )
    specs = [(f"groups[{i}].resources", g.resources) for i, g in enumerate(groups)] or [("resources", task.resources)]
    res = fleet.resources
    for key, spec in specs:
        if spec.disk and res.disk and spec.disk.size.min and spec.disk.size.min > (res.disk.size.min or 0):
            problems.append(
                Problem(
                    rel,
                    f"{key}.disk",
                    f"asks for {spec.disk.size} of disk but {where} provisions "
                    f"{res.disk.size.min} disks (the smallest its `disk:` allows): no instance fits",
                    "ask for at most the fleet's disk, or raise the fleet's `disk:`",
                )
            )
        if spec.memory.min and spec.memory.min > (res.memory.min or 0):
            problems.append(
                Problem(
                    rel,
                    f"{key}.memory",
                    f"asks for {spec.memory} of RAM but {where} only "
                    f"guarantees {res.memory}: its instances may have less",
                    "ask for at most the fleet's memory, or raise the fleet's `memory:`",
                )
            )
        if spec.gpu and res.gpu and spec.gpu.count.max != 0:
            task_vendor = _vendor(spec, task.image or "-", task.docker)
            fleet_vendor = _vendor(res, "-", None)
            if task_vendor and fleet_vendor and task_vendor != fleet_vendor:
                problems.append(
                    Problem(
                        rel,
                        f"{key}.gpu",
                        f"asks for {task_vendor.value} GPUs but {where} has {fleet_vendor.value} GPUs",
                        "use a fleet with the task's GPU vendor",
                    )
                )
            elif res.gpu.count.max is not None and (spec.gpu.count.min or 0) > res.gpu.count.max:
                problems.append(
                    Problem(
                        rel,
                        f"{key}.gpu",
                        f"asks for {spec.gpu.count.min} GPUs per node but "
                        f"{where}'s nodes have at most {res.gpu.count.max}",
                        "ask for at most the fleet's GPUs per node",
                    )
                )
    return problems

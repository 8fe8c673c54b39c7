"""`cloudrl logs --node N`: one node's Ray worker logs, read through the dashboard's log API.

The user's machine reaches only the dashboard, and the dashboard reaches every node's log files
through that node's Ray agent: `/api/v0/nodes` lists the nodes, `/api/v0/logs?node_id=..&glob=..`
a node's log files, `/api/v0/logs/file?node_id=..&filename=..&lines=..` the last lines of one.
N is the node's index (0 = the head, then the others by IP address), its IP address, or (a prefix
of) its Ray node id. With a job id (`cloudrl logs JOB --node N`) only that job's worker files are
shown: Ray names them worker-<worker id>-<job id>-<pid>.out/.err, after the Ray job id of the job's driver.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Any

from .errors import CloudrlError
from .jobs import safe_text

DEFAULT_GLOB = "worker-*"
"""Ray's per-process stdout/stderr files (worker-<id>-<job>-<pid>.out/.err): what tasks and actors print."""
READ_TIMEOUT_S = 20.0
WORKER_FILE_RE = re.compile(r"worker-[0-9a-f]+-(?P<job>[0-9a-f]+)-\d+\.(?:out|err)$")
"""Ray's name for a worker's log file (the dashboard's log manager parses it the same way)."""


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return 0, ipaddress.ip_address(ip)
    except ValueError:
        return 1, ip


def alive_nodes(client: Any) -> list[dict[str, Any]]:
    """The alive nodes in index order: the head first, then by IP address."""
    data = client.get_json("/api/v0/nodes?limit=10000&detail=true")
    try:
        rows = [r for r in data["data"]["result"]["result"] if r.get("state") == "ALIVE"]
    except (KeyError, TypeError):
        raise CloudrlError(
            f"{client.address.url}/api/v0/nodes answered in an unknown shape: "
            f"is the cluster's Ray version the same as here?"
        ) from None
    return sorted(rows, key=lambda r: (not r.get("is_head_node"), _ip_key(str(r.get("node_ip"))), r.get("node_id", "")))


def describe_nodes(nodes: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{i} = {n.get('node_ip')}{' (head)' if n.get('is_head_node') else ''} id {str(n.get('node_id'))[:8]}"
        for i, n in enumerate(nodes)
    )


def pick_node(nodes: list[dict[str, Any]], wanted: str, url: str) -> tuple[int, dict[str, Any]]:
    """The node `wanted` names: an index, an IP address or a node id prefix (8+ hex digits)."""
    wanted = wanted.strip()
    found: list[int] = []
    if wanted.isdigit() and int(wanted) < len(nodes):
        found = [int(wanted)]
    if not found:
        found = [i for i, n in enumerate(nodes) if n.get("node_ip") == wanted]
    if not found and len(wanted) >= 8:
        found = [i for i, n in enumerate(nodes) if str(n.get("node_id", "")).startswith(wanted.lower())]
    if len(found) == 1:
        return found[0], nodes[found[0]]
    what = "names several nodes" if found else "is no alive node"
    raise CloudrlError(
        f"--node {wanted} {what} of the cluster at {url}: pass an index, IP or node id "
        f"of one of: {describe_nodes(nodes) or 'no alive nodes'}"
    )


def job_or_node(job: str | None, node: str | None, follow: bool) -> None:
    """`cloudrl logs --node` shows files as they are, so it does not --follow. A usage error (exit 2)."""
    import typer

    if node is not None and follow:
        raise typer.BadParameter(
            "--node shows the last lines of one node's worker logs and does not follow them: drop --follow "
            "(`cloudrl logs JOB --follow` streams a job's driver log)",
            param_hint="'--node'",
        )


def node_logs_text(client: Any, node: str, lines: int = 50, glob: str = DEFAULT_GLOB, job: str | None = None) -> str:
    """The last `lines` lines of each of the node's log files matching `glob`, each under a header;
    with `job` (a submission id), only that job's worker files."""
    if lines < 1:
        raise CloudrlError(f"--lines {lines} is not a line count: use 1 or more")
    ray_job = _ray_job_id(client, job) if job else None
    nodes = alive_nodes(client)
    index, picked = pick_node(nodes, node, client.address.url)
    node_id, ip = picked["node_id"], picked.get("node_ip")
    query = urllib.parse.urlencode({"node_id": node_id, "glob": glob})
    listing = client.get_json(f"/api/v0/logs?{query}", read_timeout=READ_TIMEOUT_S)
    if not listing.get("result", True):
        raise CloudrlError(
            f"the dashboard at {client.address.url} could not list node {index}'s logs: "
            f"{listing.get('msg') or 'no details'}"
        )
    files = sorted({f for group in (listing.get("data", {}).get("result") or {}).values() for f in group})
    of_job = ""
    if ray_job:
        files = [f for f in files if (m := WORKER_FILE_RE.search(f)) and m["job"] == ray_job]
        of_job = f" of job {job} (Ray job {ray_job})"
    head = (
        f"# node {index} ({ip}, id {node_id[:8]}): {len(files)} file(s){of_job} matching {glob!r}, "
        f"last {lines} lines each"
    )
    if not files:
        return head + "\n"
    parts = [head]
    for name in files:
        query = urllib.parse.urlencode({"node_id": node_id, "filename": name, "lines": lines})
        response = client.get(f"/api/v0/logs/file?{query}", READ_TIMEOUT_S)
        text = response.text if response.status_code == 200 else f"(unreadable: HTTP {response.status_code})\n"
        parts.append(f"==> {name} <==\n{text.rstrip()}")
    return safe_text("\n".join(parts) + "\n")


def _ray_job_id(client: Any, job: str) -> str:
    """The Ray job id (hex) of submitted job `job`: what its workers' log file names carry."""
    from .jobs import job_info

    info = job_info(client, job)
    if not info.job_id:
        raise CloudrlError(
            f"job {job} has no Ray job id yet ({info.status}): its driver has not started, so no worker "
            f"has logged for it; try again once `cloudrl status {job}{client.address.flag}` shows it RUNNING"
        )
    return str(info.job_id).lower()

"""The Ray cluster as the CLI sees it: its dashboard's HTTP API and Ray's Jobs client, time-bounded.

The user's machine reaches only the dashboard (usually a port that dstack or ssh forwards to
127.0.0.1:8265), never the GCS port, so everything goes over HTTP: the version check, the alive nodes'
resources for the placement preflight, and the Jobs API through `ray.job_submission.JobSubmissionClient`.
Every request has a timeout, so a dead tunnel is an error sentence, not a hang. Ray is imported inside
functions to keep `cloudrl --help` fast.

Nothing that answers at an address is trusted for being there. The Ray token goes only to the cluster it
belongs to (`token_for`): the `cloudrl local` cluster's own token only to that cluster's dashboard, a
RAY_AUTH_TOKEN only over https:// or to this machine (plain http:// to another host needs
--insecure-http), the token file Ray keeps in ~/.ray only to this machine. And a client remembers the
Ray session it first talked to (`session_name` of /api/version): a different cluster answering at the
same address later (a dropped tunnel whose port another process took) is refused, never sent a job.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from cloudrl.trainer.errors import ClusterUnreachable, first_line
from cloudrl.trainer.urls import is_loopback

from .errors import CloudrlError, NoSuchJob
from .local_state import load_state, local_token, running_dashboard_url
from .node_processes import foreign_listener
from .pins import DASHBOARD_PORT
from .ray_compat import bounded_job_client

DEFAULT_ADDRESS = f"http://127.0.0.1:{DASHBOARD_PORT}"
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0
# The first request: a dashboard that answers at all answers /api/version at once.
PROBE_READ_TIMEOUT_S = 5.0
# Uploads and job submission can take longer than a status read on a slow tunnel.
SUBMIT_READ_TIMEOUT_S = 120.0

T = TypeVar("T")


@dataclass(frozen=True)
class Address:
    url: str
    """The dashboard's base URL, without a trailing slash."""
    source: str
    """Where it came from: --address, RAY_ADDRESS, default or local (the `cloudrl local` cluster)."""

    @property
    def flag(self) -> str:
        """What to add to a follow-up command so it reaches the same cluster."""
        if self.source == "--address":
            return f" --address {self.url}"
        if self.source == "local":
            return " --local"
        return ""

    def job_url(self, job_id: str) -> str:
        return f"{self.url}/#/jobs/{job_id}"


def resolve_address(address: str | None, local: bool = False, start_local: Callable[[], Any] | None = None) -> Address:
    """--address, else RAY_ADDRESS, else the port dstack forwards; `local` = the `cloudrl local` cluster
    (started by `start_local` when given and none runs)."""
    if local:
        if address:
            raise CloudrlError("pass either --local or --address, not both")
        if running_dashboard_url() is None and start_local is not None:
            start_local()
        url = running_dashboard_url()
        if url is None:
            raise CloudrlError("no local cluster is running: start one with `cloudrl local up`")
        return Address(url, "local")
    if address:
        source = "--address"
    elif os.environ.get("RAY_ADDRESS"):
        address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    else:
        address, source = DEFAULT_ADDRESS, "default"
    return Address(dashboard_url(address, source), source)


def dashboard_url(address: str, source: str) -> str:
    """`address` as a dashboard base URL (http:// added when it has no scheme), or a CloudrlError that
    says what is wrong with it: requests would fail later with a traceback on a bad host or port."""
    url = address.strip() if "://" in address else f"http://{address.strip()}"

    def bad(reason: str) -> CloudrlError:
        return CloudrlError(
            f"{source}={address} is not a dashboard URL ({reason}): cloudrl talks to the Ray "
            f"dashboard, e.g. --address {DEFAULT_ADDRESS}"
        )

    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parsed on access: a port out of range or not a number raises here
    except ValueError as exc:
        raise bad(str(exc).lower()) from None
    if parts.scheme not in ("http", "https"):
        raise bad(f"{parts.scheme}:// is not http:// or https://")
    if not parts.hostname:
        raise bad("no host")
    if any(c.isspace() for c in url):
        raise bad("it contains a space")
    if port == 0:
        raise bad("port 0")
    return url.rstrip("/")


def check_port(flag: str, port: int | None, zero_means_any: bool = False) -> None:
    """A TCP port given on the command line: 1..65535, or 0 where it means "any free port"."""
    low = 0 if zero_means_any else 1
    if port is not None and not low <= port <= 65535:
        raise CloudrlError(
            f"{flag} {port} is not a TCP port: use {low}..65535" + (" (0 = any free port)" if zero_means_any else "")
        )


def _where(address: Address) -> str:
    return {
        "--address": "",
        "RAY_ADDRESS": " (from RAY_ADDRESS)",
        "default": " (the default address)",
        "local": " (the local cluster)",
    }[address.source]


def unreachable_hint(address: Address) -> str:
    if address.source == "local":
        return "the local cluster is gone: restart it with `cloudrl local down && cloudrl local up`"
    return (
        "forward the dashboard of a dstack run with `cloudrl dashboard` (or `dstack attach cloudrl-ray`), "
        "start a cluster on this machine with `cloudrl local up` and pass --local, or pass --address"
    )


def local_cluster_for(url: str) -> dict[str, Any] | None:
    """The `cloudrl local` cluster's state when `url` is its dashboard, else None."""
    try:
        state = load_state()
    except CloudrlError:
        return None
    if state and state.get("dashboard_url") == url:
        return state
    return None


def token_for(address: Address, insecure_http: bool = False) -> tuple[str | None, str]:
    """The Ray token to send to `address` after it answered 401, and where it came from; (None, why)
    when this machine has none for it. Raises instead of handing a token to a host that could pass it on."""
    local = local_cluster_for(address.url)
    if local is not None:  # the cluster `cloudrl local up` started: its own token, never another one
        other = foreign_listener(local, urllib.parse.urlsplit(address.url).port or 80)
        if other is not None:  # a squatter on the port, since the cluster's dashboard is not listening there
            raise AuthRefused(
                f"{address.url} is answered by {other}, not by the local cluster's dashboard: the local "
                f"cluster's token is not sent to it; stop that process, or restart the cluster (`cloudrl local "
                f"down && cloudrl local up`)"
            )
        return local_token(local), "the local cluster's token"
    if address.source == "local":
        return None, "the local cluster has no token file"
    plain_remote = address.url.startswith("http://") and not is_loopback(address.url)
    if os.environ.get("RAY_AUTH_TOKEN"):
        if plain_remote and not insecure_http:
            raise AuthRefused(
                f"the cluster at {address.url}{_where(address)} asks for the Ray token, and plain http:// would "
                f"carry it readable to another host: forward the dashboard to this machine (`cloudrl dashboard`, "
                f"or `cloudrl dashboard --ssh HOST`), use an https:// address, or pass --insecure-http"
            )
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    if is_loopback(address.url):
        # The file Ray itself falls back to: a token for a cluster on this machine, never for another host.
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        try:
            return path.read_text().strip() or None, str(path)
        except OSError:
            pass
    return None, "no token is set here"


class ClusterClient:
    """One cluster's dashboard: plain HTTP reads plus Ray's Jobs client."""

    def __init__(self, address: Address, insecure_http: bool = False, expected_session: str | None = None):
        self.address = address
        self.insecure_http = insecure_http
        self._jobs: Any = None
        self._headers: dict[str, str] = {}
        self._probed = False
        local = local_cluster_for(address.url)
        self.expected_session = expected_session or (local or {}).get("session_name")
        """The Ray session this client must find at the address (None: whichever answers first)."""
        self.session: str | None = None
        """The Ray session that answered (from /api/version)."""

    # -- plain HTTP ---------------------------------------------------------------------------
    def get_json(self, path: str, read_timeout: float = READ_TIMEOUT_S) -> Any:
        r = self.get(path, read_timeout)
        url = f"{self.address.url}{path}"
        if r.status_code != 200:
            raise CloudrlError(
                f"{url} answered HTTP {r.status_code}: is {self.address.url}{_where(self.address)} a Ray "
                f"dashboard? {unreachable_hint(self.address)}"
            )
        try:
            return r.json()
        except ValueError:
            raise CloudrlError(
                f"{url} did not answer JSON: {self.address.url}{_where(self.address)} is not a Ray dashboard; "
                f"{unreachable_hint(self.address)}"
            ) from None

    def get(self, path: str, read_timeout: float = READ_TIMEOUT_S) -> Any:
        """GET `path` (with the token when the cluster asks for it); the response unless it is 401/403."""
        url = f"{self.address.url}{path}"
        r = self._get(url, read_timeout)
        found = "no token is set here"
        if r.status_code == 401 and not self._headers:
            token, source = token_for(self.address, self.insecure_http)
            if token:
                # A cluster with Ray token auth: retry with the token this machine has for it.
                self._headers = {"Authorization": f"Bearer {token}"}
                r = self._get(url, read_timeout)
                found = f"it rejected {source}"
            else:
                found = source
        elif self._headers:
            found = "it rejected the token sent"
        self._probed = True
        if r.status_code in (401, 403):
            raise AuthRefused(
                f"the cluster at {self.address.url} uses Ray token authentication and {found}: "
                f"set RAY_AUTH_TOKEN to the cluster's token (`ray get-auth-token` on its head node)"
            )
        return r

    def _get(self, url: str, read_timeout: float) -> Any:
        import requests

        try:
            return requests.get(url, headers=self._headers, timeout=(CONNECT_TIMEOUT_S, read_timeout))
        except requests.exceptions.ConnectTimeout:
            raise self._unreachable(f"no answer within {CONNECT_TIMEOUT_S:g} s") from None
        except requests.exceptions.ReadTimeout:
            raise self._unreachable(f"connected, but no reply within {read_timeout:g} s") from None
        except requests.exceptions.ConnectionError as exc:
            raise self._unreachable(connection_reason(exc)) from None

    def _unreachable(self, reason: str) -> ClusterUnreachable:
        return ClusterUnreachable(
            f"no Ray dashboard answers at {self.address.url}{_where(self.address)} ({reason}): "
            f"{unreachable_hint(self.address)}"
        )

    def ray_version(self) -> str:
        """The cluster's Ray version; records (and checks) which Ray session answers."""
        data = self.get_json("/api/version", read_timeout=PROBE_READ_TIMEOUT_S)
        if not isinstance(data, dict) or "ray_version" not in data:
            raise CloudrlError(f"{self.address.url}/api/version has no ray_version: is this a Ray dashboard?")
        session = str(data.get("session_name") or "") or None
        expected = self.expected_session or self.session
        if expected and session != expected:
            raise ClusterChanged(
                f"a different Ray cluster now answers at {self.address.url}{_where(self.address)} (session "
                f"{session or 'unknown'}, not {expected}): nothing was sent to it; if it is yours, run the "
                f"command again to talk to it"
            )
        self.session = session
        return str(data["ray_version"])

    def check_version(self) -> str:
        """Fail unless the cluster runs the Ray version installed here (jobs and runtime envs need it)."""
        import ray

        cluster, here = self.ray_version(), ray.__version__
        if cluster != here:
            raise CloudrlError(
                f"the cluster runs Ray {cluster} but this machine has Ray {here}: install the same version "
                f"here (pip install 'ray[default]=={cluster}') or bring the cluster up with Ray {here} "
                f"(tasks/ray-bootstrap.sh pins it)"
            )
        return cluster

    def alive_nodes(self) -> list[dict[str, float]]:
        """Each alive node's total resources (CPU, GPU, custom), from the dashboard's state API."""
        data = self.get_json(
            "/api/v0/nodes?limit=10000&detail=true&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE"
        )
        try:
            rows = data["data"]["result"]["result"]
        except (KeyError, TypeError):
            raise CloudrlError(
                f"{self.address.url}/api/v0/nodes answered in an unknown shape: "
                f"is the cluster's Ray version the same as here?"
            ) from None
        return [
            {k: float(v) for k, v in row.get("resources_total", {}).items()}
            for row in rows
            if row.get("state") == "ALIVE"
        ]

    # -- Jobs API -----------------------------------------------------------------------------
    @property
    def jobs(self) -> Any:
        """Ray's JobSubmissionClient for this address (created on first use)."""
        if self._jobs is None:
            if not self._probed:  # settles reachability and the auth header first, with our messages
                self.ray_version()
            self._jobs = self.call(
                lambda: bounded_job_client(
                    self.address.url, self._headers, CONNECT_TIMEOUT_S, READ_TIMEOUT_S, SUBMIT_READ_TIMEOUT_S
                ),
                what="connect",
            )
        return self._jobs

    def call(self, fn: Callable[[], T], what: str, job_id: str | None = None) -> T:
        """Run one Jobs API call, turning Ray's and requests' errors into one sentence."""
        import requests

        try:
            return fn()
        except ClusterUnreachable:  # from `self.jobs`'s own probe: a ConnectionError, but already one sentence
            raise
        except (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError) as exc:
            raise self._unreachable(f"{what}: {connection_reason(exc)}") from None
        except RuntimeError as exc:
            text = str(exc)
            if job_id and ("404" in text or "does not exist" in text):
                raise NoSuchJob(
                    f"no job {job_id!r} on {self.address.url}: `cloudrl list{self.address.flag}` shows its jobs"
                ) from None
            raise CloudrlError(f"the Ray Jobs API at {self.address.url} refused to {what}: {refusal(text)}") from None


# The last line of a Python traceback: `cloudrl.trainer.errors.RewardError: ...`, `KeyError: 'x'`.
EXCEPTION_RE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)(?:\([\w.]*\))?: \S")
STATUS_RE = re.compile(r"Request failed with status code (\d{3})")


def refusal(text: str) -> str:
    """Why the Jobs API said no, in one line. Ray answers a failure on its side with whole tracebacks (the
    dashboard's, wrapping its job agent's), whose first line says nothing; the last exception line is the cause."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if EXCEPTION_RE.match(ln)), None)
    status = STATUS_RE.search(text)
    if cause is None:
        return first_line(text)[:300]
    return f"{'HTTP ' + status.group(1) + ', ' if status else ''}{cause.rstrip('.')[:300]}"


def server_side(text: str) -> bool:
    """Whether a Jobs API refusal is the cluster's own failure (HTTP 500, e.g. its job agent not listening
    yet), which may pass, rather than a verdict on the request (any 4xx, also one wrapped in the 500)."""
    codes = STATUS_RE.findall(text)
    return bool(codes) and all(code.startswith("5") for code in codes)


class ClusterChanged(CloudrlError):
    """Another Ray cluster than the one first contacted answers at the address."""


class AuthRefused(CloudrlError):
    """The cluster wants a token this machine has not (or may not send), or rejected the one sent."""


def connection_reason(exc: BaseException) -> str:
    """What went wrong with a connection, in a few words (the start of a requests error is its URL)."""
    text = str(exc)
    for needle, reason in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
        ("Connection reset", "connection reset"),
        ("RemoteDisconnected", "the connection closed without a reply"),
    ):
        if needle in text:
            return reason
    return first_line(text)[:200]

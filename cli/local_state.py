"""Where the `cloudrl local` cluster's state file lives, and what it says.

Its own module because both sides read it: `local_cluster` writes it as nodes start and stop, and
`ray_api` reads the dashboard URL from it for --local, while `local_cluster` talks to that dashboard
through `ray_api`. Kept here, neither of those two imports the other back.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from cloudrl.trainer.paths import cache_dir

from .errors import CloudrlError
from .node_processes import alive

STATE_NAME = "local-cluster.json"
TOKEN_NAME = "local-cluster.token"
"""The local cluster's Ray token: random per cluster, mode 0600, next to the state file."""


def state_path() -> Path:
    return cache_dir() / STATE_NAME


def load_state() -> dict[str, Any] | None:
    path = state_path()
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        raise CloudrlError(
            f"{path} is not readable JSON: stop any Ray processes it named by hand, then delete it"
        ) from None


def save_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def running_dashboard_url() -> str | None:
    """The dashboard URL of the local cluster if its head process is still alive."""
    state = load_state()
    if state and state.get("nodes") and alive(state["nodes"][0]) and state.get("dashboard_url"):
        return state["dashboard_url"]
    return None


def new_token_file() -> Path:
    """A fresh random token for a new local cluster, written 0600 (created so, never chmod-ed after)."""
    path = state_path().with_name(TOKEN_NAME)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def local_token(state: dict[str, Any]) -> str | None:
    """The token of the local cluster `state` describes (None for one started without a token)."""
    path = state.get("token_file")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None

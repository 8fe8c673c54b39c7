"""The values cli/pins.py says must agree with the rest of the repository, read from each file as text.

The Ray version is written three times: pyproject.toml (what `pip install cloudrl` puts on the user's
machine), cli/pins.py (what the CLI and `cloudrl validate` compare against) and tasks/ray-bootstrap.sh
(what every cluster node installs). A client and a cluster on different Ray versions cannot submit jobs,
so an edit to one of them alone fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]


def only_match(pattern: str, path: str) -> str:
    """The one group of the one line of `path` that matches `pattern` (a second copy would drift)."""
    found = re.findall(pattern, (REPO / path).read_text(), re.MULTILINE)
    assert len(found) == 1, f"{path}: expected one line matching {pattern!r}, found {found}"
    return found[0]


def test_the_ray_version_is_the_same_in_pyproject_pins_and_the_bootstrap() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    rays = [d.replace(" ", "") for d in deps if re.match(r"ray\b", d)]
    assert len(rays) == 1 and rays[0].startswith("ray[default]=="), rays
    versions = {
        "pyproject.toml": rays[0].removeprefix("ray[default]=="),
        "cli/pins.py": only_match(r'^RAY_VERSION = "([^"]+)"', "cli/pins.py"),
        "tasks/ray-bootstrap.sh": only_match(r'^CLOUDRL_RAY_VERSION="([^"]+)"', "tasks/ray-bootstrap.sh"),
    }
    assert len(set(versions.values())) == 1, versions


def test_the_dashboard_port_is_the_bootstraps_default() -> None:
    pins = only_match(r"^DASHBOARD_PORT = (\d+)$", "cli/pins.py")
    bootstrap = only_match(r'^DASHBOARD_PORT="\$\{CLOUDRL_DASHBOARD_PORT:-(\d+)\}"', "tasks/ray-bootstrap.sh")
    assert pins == bootstrap, {"cli/pins.py": pins, "tasks/ray-bootstrap.sh": bootstrap}

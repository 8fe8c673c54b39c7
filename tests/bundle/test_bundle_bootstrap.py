"""tasks/ray-bootstrap.sh on its own, without a cluster: what it refuses to start with, a worker whose
head never answers, the Python steps of tasks/ray_bringup.py, and the one knob table in docs/cluster.md.
Fast: no Ray node is started."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import sys

import pytest
from bundle_netns import free_port
from dstack_runner import dstack_env, ready_image_python
from runs import REPO
from test_bundle_cluster import GPUS_PER_NODE, run_bootstrap


def test_bootstrap_refuses_to_start_without_a_ray_token():
    env = dstack_env(1, ["10.213.250.1", "10.213.250.2"], GPUS_PER_NODE)
    result = run_bootstrap(env, timeout=30, token=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "[cloudrl rank 1] error: RAY_AUTH_TOKEN is not set: the Ray cluster would accept jobs from anyone on its "
        "network. Run `export RAY_AUTH_TOKEN=$(openssl rand -hex 32)` where you run `dstack apply` or `sbatch` "
        "(keep it for `cloudrl submit`; a dstack task lists RAY_AUTH_TOKEN under its env), or set "
        "CLOUDRL_RAY_AUTH=off."
    ]
    assert "ray start" not in result.stdout


@pytest.mark.parametrize("token", ["changeme", "ab" * 15, "  secret-token  "])
def test_bootstrap_refuses_a_ray_token_too_short_to_resist_guessing(token):
    env = dstack_env(1, ["10.213.250.1", "10.213.250.2"], GPUS_PER_NODE)
    result = run_bootstrap({**env, "RAY_AUTH_TOKEN": token}, timeout=30, token=False)
    assert result.returncode == 1
    bits = len(token.strip()) * (4 if token == "ab" * 15 else 6)
    assert result.stderr.strip().splitlines() == [
        f"[cloudrl rank 1] error: RAY_AUTH_TOKEN holds at most {bits} random bits, fewer than 128: anyone on the "
        "cluster's network could guess it and run code on every node. Make one with `export "
        "RAY_AUTH_TOKEN=$(openssl rand -hex 32)` and pass the same to `cloudrl submit`."
    ]
    assert token.strip() not in result.stdout + result.stderr and "ray start" not in result.stdout


@pytest.mark.parametrize(
    "missing",
    ["DSTACK_NODE_RANK", "DSTACK_MASTER_NODE_IP", "DSTACK_NODES_NUM", "DSTACK_GPUS_PER_NODE", "DSTACK_NODES_IPS"],
)
def test_bootstrap_names_a_missing_dstack_variable(missing):
    env = dstack_env(1, ["10.213.250.1", "10.213.250.2"], GPUS_PER_NODE)
    del env[missing]
    result = run_bootstrap(env, timeout=30)
    assert result.returncode == 1
    assert f"error: {missing} is not set." in result.stderr
    assert "ray start" not in result.stdout + result.stderr


def test_bootstrap_rejects_an_ip_list_that_does_not_match_the_node_count():
    env = dstack_env(1, ["10.213.250.1", "10.213.250.2"], GPUS_PER_NODE)
    env["DSTACK_NODES_NUM"] = "3"
    result = run_bootstrap(env, timeout=30)
    assert result.returncode == 1
    assert "DSTACK_NODES_IPS lists 2 addresses but DSTACK_NODES_NUM=3" in result.stderr


def test_worker_gives_up_after_its_join_timeout_with_a_line_per_attempt(tmp_path):
    # Nothing listens on this loopback port: the worker retries, then fails naming the head. An image that
    # needs no install: the join loop starts at once.
    port = free_port()
    env = {
        **dstack_env(1, ["127.0.0.1", "127.0.0.2"], GPUS_PER_NODE),
        "CLOUDRL_RAY_PORT": str(port),
        "CLOUDRL_JOIN_TIMEOUT": "4",
        "CLOUDRL_PYTHON": str(ready_image_python(tmp_path)),
    }
    result = run_bootstrap(env, timeout=60)
    assert result.returncode == 1
    assert f"join attempt 1: Ray head 127.0.0.1:{port} not answering yet" in result.stdout
    assert result.stdout.count("join attempt") >= 2
    assert f"the Ray head at 127.0.0.1:{port} did not answer within 4s" in result.stderr


def test_ready_line_timings_read_right_when_a_workers_clock_is_ahead():
    """Phases come from several machines' clocks: a worker that began a moment "before" the head reads as
    such, never as `-0s after`."""
    bringup = load_bringup()

    def line(started):
        return bringup.timings(100.0, 108.0, 109.0, 130.0, {1: {"started": started, "installed": started + 9}}, 6.0)

    assert "last bootstrap began 0s after the head's" in line(99.7)
    assert "last bootstrap began 2s before the head's" in line(98.0)
    assert "last bootstrap began 5s after the head's" in line(105.2)
    assert "-" not in line(99.7) + line(98.0)


def load_bringup():
    spec = importlib.util.spec_from_file_location("ray_bringup", REPO / "tasks" / "ray_bringup.py")
    bringup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bringup)
    return bringup


def bringup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tasks" / "ray_bringup.py"), *args], capture_output=True, text=True, timeout=30
    )


# --- the node-side subcommands of ray_bringup.py ------------------------------------------------------


def test_resources_picks_this_nodes_share_by_rank_or_host_name():
    per_node = '{"0": {"trainer_node": 4}, "gpu-07": {"rollout_node": 1}}'
    assert bringup("resources", per_node, "0", "gpu-01", "").stdout == '{"trainer_node":4}\n'
    assert bringup("resources", per_node, "1", "gpu-07", "").stdout == '{"rollout_node":1}\n'
    assert bringup("resources", per_node, "2", "gpu-09", "").stdout == "\n"  # a node not named gets none
    assert bringup("resources", '{"rollout_node": 1}', "3", "x").stdout == '{"rollout_node":1}\n'


def test_with_resource_merges_into_the_one_resources_flag():
    added = bringup("with-resource", '--start-args=--num-cpus=2 --resources={"rollout_node":1}', "retriever=1")
    assert added.returncode == 0, added.stderr
    args = added.stdout.split()
    assert args[0] == "--num-cpus=2" and len([a for a in args if a.startswith("--resources=")]) == 1
    assert json.loads(args[-1].split("=", 1)[1]) == {"rollout_node": 1, "retriever": 1}
    alone = bringup("with-resource", "--start-args=", "retriever=1")
    assert alone.stdout.strip() == '--resources={"retriever":1}'


def test_interface_names_the_one_that_holds_the_address():
    assert bringup("interface", "127.0.0.1").stdout.strip() == socket.if_indextoname(1)  # lo, the first
    assert bringup("interface", "192.0.2.254").stdout.strip() == ""  # TEST-NET-1: held by no interface


def test_object_store_is_half_of_dev_shm_at_most_30_percent_of_ram():
    import os

    shm = os.statvfs("/dev/shm")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = int(bringup("object-store").stdout)
    assert size == max(min(shm.f_bavail * shm.f_frsize // 2, ram * 3 // 10), 78643200) > 0


def test_the_fabric_check_connects_to_the_head_by_address_not_auto():
    text = (REPO / "tasks" / "ray_bringup.py").read_text()
    assert 'address="auto"' not in text
    assert 'ray.init(address=f"{expected[0]}:{ray_port}"' in text


# --- the one knob table ------------------------------------------------------------------------------


def knob_table() -> dict[str, str]:
    """{variable: default} of the knob table in docs/cluster.md."""
    text = (REPO / "docs" / "cluster.md").read_text()
    section = text.split("### Knobs", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", section, re.M)}


def test_every_variable_the_bootstrap_reads_is_in_the_knob_table():
    tasks = REPO / "tasks"
    shell = (tasks / "ray-bootstrap.sh").read_text() + (tasks / "retriever.sh").read_text()
    read = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-?]", shell))
    read |= set(re.findall(r"^for name in ((?:DSTACK_\w+ ?)+); do", shell, re.M)[0].split())
    # CLOUDRL_NODE_IP is the fabric check's own, set for its probes.
    read |= set(re.findall(r'environ\.get\("([A-Z_]+)"', (tasks / "ray_bringup.py").read_text())) - {"CLOUDRL_NODE_IP"}
    assert {"CLOUDRL_READY_TIMEOUT", "CLOUDRL_RETRIEVER_PORT", "CLOUDRL_FABRIC_TIMEOUT", "DSTACK_NODES_IPS"} <= read
    assert sorted(read - set(knob_table())) == []
    assert sorted(set(knob_table()) - read) == []


def test_the_bootstrap_points_to_the_table_instead_of_listing_knobs():
    header = (REPO / "tasks" / "ray-bootstrap.sh").read_text().split("\nset -euo pipefail", 1)[0]
    assert 'docs/cluster.md ("Knobs")' in header
    assert not re.search(r"CLOUDRL_\w+=\d", header)  # no defaults restated there
    assert "knows nothing of the trainer" not in header


def test_the_ready_timeout_default_is_stated_once_in_the_script_and_once_in_the_table():
    assert knob_table()["CLOUDRL_READY_TIMEOUT"] == "900"
    bootstrap = (REPO / "tasks" / "ray-bootstrap.sh").read_text()
    assert bootstrap.count("900") == 1 and 'READY_TIMEOUT="${CLOUDRL_READY_TIMEOUT:-900}"' in bootstrap
    docs = (REPO / "docs" / "cluster.md").read_text()
    assert len(re.findall(r"\b900\b", docs)) == 1


def test_no_task_restates_a_bootstrap_default():
    import yaml

    defaults = {name: default.strip("`") for name, default in knob_table().items()}
    restated = []
    for path in sorted((REPO / "tasks").glob("*.yml")) + sorted((REPO / "fleets").glob("*.yml")):
        for entry in yaml.safe_load(path.read_text()).get("env") or []:
            name, _, value = str(entry).partition("=")
            if name in defaults and value == defaults[name]:
                restated.append(f"{path.name}: {entry}")
    assert restated == []


@pytest.mark.parametrize(
    ("head", "why"),
    [
        ("10.0.0.9;rm -rf /", "is not a host name or IPv4 address: give the running cluster's head address"),
        ("-h", "is not a host name or IPv4 address"),
        ("10.213.250.2", "is this node's own address: it names the head of a cluster that runs already"),
    ],
)
def test_a_join_only_worker_refuses_a_head_address_it_cannot_join(head, why):
    """CLOUDRL_JOIN_HEAD (a rollout node joining another run's cluster): a value that is no address, or the
    node's own, ends the bootstrap in one line before any Ray process starts."""
    env = dstack_env(1, ["10.213.250.1", "10.213.250.2"], GPUS_PER_NODE)
    result = run_bootstrap({**env, "CLOUDRL_JOIN_HEAD": head}, timeout=30)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"[cloudrl rank 1] error: CLOUDRL_JOIN_HEAD={head} {why}"), line
    assert "ray start" not in result.stdout

"""tasks/ray-bootstrap.sh on its own, without a cluster: what it refuses to start with, and a worker whose
head never answers. Fast: no Ray node is started."""

from __future__ import annotations

import time

import pytest
from bundle_netns import free_port
from conftest import REPO
from dstack_runner import dstack_env
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


def test_worker_gives_up_after_its_join_timeout_with_a_line_per_attempt():
    # Nothing listens on this loopback port: the worker retries, then fails naming the head.
    port = free_port()
    env = {
        **dstack_env(1, ["127.0.0.1", "127.0.0.2"], GPUS_PER_NODE),
        "CLOUDRL_RAY_PORT": str(port),
        "CLOUDRL_JOIN_TIMEOUT": "4",
    }
    started = time.monotonic()
    result = run_bootstrap(env, timeout=60)
    assert result.returncode == 1
    assert time.monotonic() - started < 40
    assert f"join attempt 1: Ray head 127.0.0.1:{port} not answering yet" in result.stdout
    assert result.stdout.count("join attempt") >= 2
    assert f"the Ray head at 127.0.0.1:{port} did not answer within 4s" in result.stderr


def test_ready_line_timings_read_right_when_a_workers_clock_is_ahead():
    """Phases come from several machines' clocks: a worker that began a moment "before" the head reads as
    such, never as `-0s after`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_bringup", REPO / "tasks" / "ray_bringup.py")
    bringup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bringup)

    def line(started):
        return bringup.timings(100.0, 108.0, 109.0, 130.0, {1: {"started": started, "installed": started + 9}}, 6.0)

    assert "last bootstrap began 0s after the head's" in line(99.7)
    assert "last bootstrap began 2s before the head's" in line(98.0)
    assert "last bootstrap began 5s after the head's" in line(105.2)
    assert "-" not in line(99.7) + line(98.0)

"""Shared fixtures: one local Ray instance for the trainer tests, and a private model cache. The helpers
the tests share are in tests/helpers/ (on the path: pyproject.toml's pytest `pythonpath`)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Built-in models are materialised into a cache of this test session only."""
    cache = tmp_path_factory.mktemp("cloudrl-cache")
    old = os.environ.get("CLOUDRL_CACHE")
    os.environ["CLOUDRL_CACHE"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("CLOUDRL_CACHE", None)
    else:
        os.environ["CLOUDRL_CACHE"] = old


@pytest.fixture(scope="session")
def ray_local(private_cache):
    """A real single-node Ray instance (8 logical CPUs) shared by the trainer tests.

    The trainer reuses an initialised Ray instead of starting its own, so each test pays only for
    its actors. Yields the GCS address, so subprocess drivers can join the same instance.
    """
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Without a mode, Ray turns token auth on when ~/.ray/auth_token exists and writes RAY_AUTH_MODE=token
    # into this process's environment, which every later subprocess would inherit. This private instance
    # has no token; `local_cluster` (helpers/runs.py) puts its own cluster's token in the environment.
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ctx = ray.init(
        address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", configure_logging=True
    )
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="session")
def tiny_straight_run(ray_local, tmp_path_factory):
    """One tiny straight run (tests/helpers/runs.py `TINY_STRAIGHT`), trained once per test session on
    `ray_local`: kill-and-resume's uninterrupted run, policy lag's in-turn run and eval-only's checkpoint."""
    from runs import train_tiny_straight_run

    return train_tiny_straight_run(tmp_path_factory.mktemp("tiny-straight"))


# Two pytest-xdist workers (README's test command: `-n 2 --dist loadgroup`). A test that starts a cluster, a
# network namespace or a vLLM engine, or uses the session's Ray instance, runs in a group that one worker runs
# whole, one test after the other, so what the group's tests share is made once: the session's Ray instance and
# the tiny straight run (group "session-ray"), the CLI tests' local cluster ("cli-cluster"), a module's own
# clusters or engines (the module's group). The two workers run two such tests at once (on 2 cores their
# bring-ups and the trainer's steps wait on each other's processes a good part of the time), and take the tests
# that start none of these once the groups are done.
CLUSTER_MARKERS = ("ray", "netns", "vllm")
CLUSTER_FIXTURES = {"ray_local", "tiny_straight_run"}


def cluster_group(item: pytest.Item) -> str | None:
    """The xdist group `item` runs in (see above), or None when it starts no cluster."""
    if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "session-ray"
    if not any(item.get_closest_marker(name) for name in CLUSTER_MARKERS):
        return None
    module = item.nodeid.split("::", 1)[0]
    return "cli-cluster" if module.startswith("tests/cli/") else module


def pytest_itemcollected(item: pytest.Item) -> None:
    # As each test is collected, so the group is there before xdist's collection hook reads it.
    group = cluster_group(item)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


# Where the time went: pyproject.toml's addopts print the 40 slowest test phases; this adds the total per test
# folder (setup, call and teardown, module fixtures included), so every CI log says which wing costs what.
_FOLDER_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    folder = report.nodeid.split("::", 1)[0].rsplit("/", 1)[0]
    _FOLDER_SECONDS[folder] = _FOLDER_SECONDS.get(folder, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after the slowest durations, so a CI log ends with the folders
def pytest_terminal_summary(terminalreporter) -> None:
    if not _FOLDER_SECONDS:
        return
    terminalreporter.section("seconds per test folder")
    total = sum(_FOLDER_SECONDS.values())
    for folder, seconds in sorted(_FOLDER_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {100 * seconds / total:5.1f}%  {folder}")
    terminalreporter.write_line(f"{total:8.1f} s  total")

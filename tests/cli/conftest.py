"""What the CLI tests share: one token-protected local cluster for the whole test run, and Qwen2.5-7B's shape
for the plan tests.

`cloudrl local up --nodes 2` starts it the first time a test asks for `cluster` (so `up` is under test),
with a state dir of its own; `cloudrl local down` stops it after the last test of tests/cli/, and that
teardown asserts that `down` stopped every process the cluster ran (the nodes' trees as they were at the
end, every job's workers included) and removed the state file. Tests that share it give their jobs names
no other test uses, stop what they leave running, and assert nothing about jobs they did not submit.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from cli_helpers import LocalCluster, cli_env, local_auth, local_state, pids_alive, process_tree, run_cli

HERE = Path(__file__).resolve().parent
NODES = 2


_running: LocalCluster | None = None
_failed_up: str | None = None


def _up(cache: Path) -> LocalCluster:
    env = cli_env(cache)
    pids: list[int] = []
    try:
        up = run_cli(["local", "up", "--nodes", str(NODES), "--timeout", "150"], env, timeout=200)
        state = local_state(cache)
        if state:
            pids = [p for node in state["nodes"] for p in process_tree(node["pid"])]
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"local cluster up: {NODES} node(s)" in up.stdout
        url = state["dashboard_url"]
        assert url.startswith("http://127.0.0.1:")
        token = Path(state["token_file"]).read_text().strip()
        return LocalCluster(url, cache, env, state, token, local_auth(cache), pids)
    except BaseException:
        run_cli(["local", "down"], env, timeout=120)
        for pid in pids_alive(pids):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        raise


def _down(cluster: LocalCluster) -> None:
    state = local_state(cluster.cache) or cluster.state
    pids = sorted(set(cluster.pids) | {p for node in state["nodes"] for p in process_tree(node["pid"])})
    try:
        down = run_cli(["local", "down"], cluster.env, timeout=120)
    finally:
        left = pids_alive(pids)
        for pid in left:  # never leave a process behind, even when `down` is broken
            subprocess.run(["kill", "-9", str(pid)], check=False)
    assert down.returncode == 0, down.stderr
    assert f"stopped the local cluster ({NODES} nodes" in down.stdout
    assert left == [], f"`cloudrl local down` left processes running: {left}"
    assert local_state(cluster.cache) is None


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    """The run's local cluster, started by the first test that asks for it (a failed `up` fails every
    test that asks, with its error, and is not retried)."""
    global _running, _failed_up
    if _failed_up is not None:
        pytest.fail(f"`cloudrl local up` failed earlier in this run: {_failed_up}", pytrace=False)
    if _running is None:
        try:
            _running = _up(tmp_path_factory.mktemp("cloudrl-cache"))
        except Exception as exc:
            _failed_up = f"{type(exc).__name__}: {str(exc)[:2000]}"
            raise
    return _running


def _in_tests_cli(item: pytest.Item | None) -> bool:
    return item is not None and HERE in Path(str(item.path)).resolve().parents


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of tests/cli/ (the next one lies elsewhere, or there is none), stop the cluster,
    so that the rest of the run does not share the machine with it; an assertion failing here fails
    that test's teardown."""
    global _running
    if _running is not None and not _in_tests_cli(nextitem):
        cluster, _running = _running, None
        _down(cluster)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run stopped early (Ctrl+C, -x) still stops the cluster."""
    global _running
    if _running is not None:
        cluster, _running = _running, None
        try:
            _down(cluster)
        except AssertionError as exc:
            session.config.get_terminal_writer().line(f"stopping the CLI tests' local cluster: {exc}", red=True)


@pytest.fixture(scope="module")
def qwen_7b(tmp_path_factory) -> str:
    """Qwen2.5-7B's shape as a config.json, without weights: all the plan reads."""
    from model_shapes import QWEN_7B

    path = tmp_path_factory.mktemp("qwen-7b")
    QWEN_7B.save_pretrained(path)
    return str(path)

"""Helpers for tests that run the trainer: short runs of the local preset (and one tiny straight run that several
tests share: tests/conftest.py's `tiny_straight_run` fixture), a local cluster, its metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A run of the local preset whose reward rises within 20 steps (tests/loop/test_trainer.py).
REWARD_RISES = {
    "data.arithmetic_max_operand": 2,
    "trainer.total_steps": 20,
    "trainer.val_every": 0,
    "trainer.save_every": 0,
    "trainer.loggers": "[jsonl]",
    "data.train_batch_size": 16,
    "rollout.n": 8,
    "actor.mini_batch_size": 32,
    "actor.micro_batch_size": 32,
    "critic.mini_batch_size": 32,
    "critic.micro_batch_size": 32,
}

# A run that proves something about one role starts only the roles it needs: every worker started costs seconds
# of imports and model loading on a 2-core machine, and the others would prove nothing there.
WITHOUT_CRITIC = {"algorithm.name": "grpo"}
ROLLOUT_IN_ACTOR = {"placement.rollout_in_actor": "true"}
REWARD_IN_DRIVER = {"reward.in_driver": "true"}


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: int, gpus_per_node: int):
    """A real Ray cluster of `nodes` nodes on 127.0.0.1, brought up and torn down by `cloudrl local`, with
    its token in this process's environment meanwhile. Logical GPUs: Ray hands out their ids as on GPU
    nodes; nothing runs CUDA. Yields its state."""
    from cloudrl.cli import local_cluster as cluster

    os.environ["CLOUDRL_LOCAL_DASHBOARD_PORT"] = "0"
    state = cluster.up(nodes=nodes, cpus_per_node=cpus_per_node, gpus_per_node=gpus_per_node, echo=lambda line: None)
    # The cluster requires its token: drivers, trainers and CLI calls started inside the block send it.
    auth = cluster.auth_env(state)
    saved = {k: os.environ.get(k) for k in auth}
    os.environ.update(auth)
    try:
        yield state
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        cluster.down(echo=lambda line: None)
        os.environ.pop("CLOUDRL_LOCAL_DASHBOARD_PORT", None)


def start_worker_node(state: dict, name: str, cpus: int, env: dict | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One more node joining the `local_cluster` at `state`: `ray start --block` in its own session (stop it
    with cloudrl.cli.node_processes.stop_node), `env` on top of the node's environment, `extra` flags last."""
    from cloudrl.cli import local_cluster as cluster
    from cloudrl.cli.node_processes import spawn

    root = Path(state["root"])
    args = cluster.node_args(cluster._ray_executable(), f"{root}/{name}", cpus, object_store_mb=200, gpus=0)
    args += [f"--address={state['gcs_address']}", *extra]
    return spawn(args, root / f"{name}.log", {**cluster._node_env(), **(env or {})})


CPU_CONTROLLERS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))
"""Where a cgroup v1 cpu controller, or a cgroup v2 hierarchy with one, is mounted on Linux."""


def cpu_controller() -> Path | None:
    """The writable cgroup cpu controller's root (v1 `cpu.cfs_quota_us` or v2 `cpu.max`), else None."""
    v1, v2 = CPU_CONTROLLERS
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(v2, os.W_OK):
        return v2
    return None


@contextlib.contextmanager
def cpu_limited(node: dict, percent: int, title: str = ""):
    """The processes of `node` (from start_worker_node) whose name starts with `title` (Ray names a worker
    `ray::<its actor class>`; "" = every one, and the workers its raylet starts later inherit it) held to
    `percent`% of one CPU by a cgroup of its own, as a throttled GPU or a busy host makes a node slow. On exit
    the processes left go back to the root cgroup and the cgroup is removed."""
    import secrets

    import psutil
    from cloudrl.cli.node_processes import node_processes

    root = cpu_controller()
    assert root is not None, "no writable cgroup cpu controller: check cpu_controller() before"
    group = root / f"cloudrl-test-slow-{secrets.token_hex(4)}"
    group.mkdir()
    try:
        period = 100_000
        if root.name == "cpu":
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(period * percent // 100))
        else:
            (group / "cpu.max").write_text(f"{period * percent // 100} {period}")
        for proc in node_processes(node):
            with contextlib.suppress(OSError, psutil.Error):  # a process that has just ended
                if proc.name().startswith(title):
                    (group / "cgroup.procs").write_text(str(proc.pid))
        yield group
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (root / "cgroup.procs").write_text(pid)
        deadline = time.monotonic() + 5  # a process moved out can take a moment to leave the count
        while True:
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def wait_nodes(state: dict, count: int, timeout_s: float = 120) -> None:
    """Until the `local_cluster` at `state` has `count` alive nodes (bounded)."""
    from cloudrl.cli import local_cluster as cluster

    deadline = time.time() + timeout_s
    while cluster._alive_nodes(state["dashboard_url"]) != count:
        assert time.time() < deadline, f"the cluster did not reach {count} alive nodes"
        time.sleep(0.5)


def run_trainer(*args: str, env: dict | None = None, timeout: float = 300):
    """`python -m cloudrl.trainer ARGS` in a subprocess; returns the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # The Ray it starts is a private one: no token auth, even where ~/.ray/auth_token exists (Ray would
    # turn it on and warn on stderr, whichever test ran first).
    full_env.setdefault("RAY_AUTH_MODE", "disabled")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cloudrl.trainer", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO,
    )


def tiny_overrides(run_dir: Path, **extra) -> list[str]:
    """A short, fast run of the local preset."""
    values = {
        "trainer.run_dir": str(run_dir),
        "trainer.total_steps": 2,
        "trainer.val_every": 0,
        "model.sft_warmup_steps": 20,
        "trainer.loggers": "[jsonl]",
        "data.train_batch_size": 8,
        "rollout.n": 2,
        "actor.mini_batch_size": 16,
        "actor.micro_batch_size": 8,
        "critic.mini_batch_size": 16,
        "critic.micro_batch_size": 8,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@contextlib.contextmanager
def serving_retriever(corpus: Path, index_dir: Path, topk: int = 3):
    """trainer/search/retriever_server.py's BM25 index of `corpus`, served on 127.0.0.1 in a thread; yields its
    /retrieve URL and stops the server on exit."""
    import threading

    from cloudrl.trainer.search.retriever_server import RetrieverServer, build_index, load_index

    build_index(corpus, index_dir)
    server = RetrieverServer(("127.0.0.1", 0), load_index(index_dir), topk=topk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def metric_rows(run_dir: Path) -> list[dict]:
    """Every row of run_dir/metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_metrics(run_dir: Path) -> list[dict]:
    """The training steps' rows of run_dir/metrics.jsonl (step 0 and validation-only rows left out)."""
    rows = metric_rows(run_dir)
    return [r for r in rows if r.get("step", 0) > 0 and "rollout/reward_mean" in r]


def first_and_last_means(rewards: list[float], k: int = 5) -> tuple[float, float]:
    """The mean of the first `k` and of the last `k` steps' rewards: what the learning tests compare."""
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def logged_steps(run_dir: Path) -> list[int]:
    """The steps of run_dir/metrics.jsonl's rows, in file order ([] before the first)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def start_trainer(run_dir: Path, log: Path, ray_address: str, **overrides) -> subprocess.Popen:
    """`python -m cloudrl.trainer --preset local` with tiny_overrides in its own session (stop it by
    its process group), output to `log`, on the Ray cluster at `ray_address`."""
    args = [sys.executable, "-m", "cloudrl.trainer", "--preset", "local", *tiny_overrides(run_dir, **overrides)]
    with open(log, "w") as out:
        return subprocess.Popen(
            args,
            cwd=REPO,
            env={**os.environ, "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_until(what: str, ready, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until `ready()` holds, while the trainer `proc` runs (bounded; the error names `what` and ends with its log)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"the run ended before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def stop_trainer(proc: subprocess.Popen) -> None:
    """SIGTERM a trainer started by `start_trainer` (its process group: it checkpoints its step and ends);
    SIGKILL if it has not ended within 120 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int = 1, timeout_s: float = 300) -> int:
    """Wait until `proc` logged `step` (or a later one); returns the last step logged."""
    deadline = time.time() + timeout_s
    while max(logged_steps(run_dir), default=0) < step and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    done = max(logged_steps(run_dir), default=0)
    assert done >= step, f"no step {step} in time; driver log:\n{log.read_text()[-3000:]}"
    return done


# ---- One tiny straight run that several tests share. -----------------------------------------------------
# Kill-and-resume's uninterrupted run (tests/loop/test_trainer.py), policy lag's in-turn run
# (tests/rollout/test_policy_lag.py) and eval-only's trained checkpoint (tests/loop/test_eval_only.py) are
# the same run: 4 steps of tiny_overrides, a checkpoint after each, validation on two named sets (the same
# 3 prompts) with 4 samples each. None of them tests the reward workers, so the driver scores the rewards
# (reward.in_driver: the same scoring code, one actor fewer to start).
TINY_STRAIGHT_STEPS = 4
TINY_STRAIGHT = {
    "trainer.total_steps": TINY_STRAIGHT_STEPS,
    "trainer.save_every": 1,
    "trainer.keep_last": 10,
    "rollout.logprob_correction": "true",
    "trainer.val_n": 4,
    "trainer.val_temperature": 0.7,
    "reward.function": "arithmetic",
    "reward.in_driver": "true",
}


def write_val_set(path: Path) -> Path:
    """A validation file of 3 prompts (a+a= for a in 0..2); returns `path`."""
    path.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(3)))
    return path


def tiny_straight_overrides(run_dir: Path, val: Path, **extra) -> list[str]:
    """The shared tiny straight run's overrides (validation sets read from `val`), `extra` on top."""
    return tiny_overrides(run_dir, **{**TINY_STRAIGHT, "data.val_sets": f"{{small: {val}, again: {val}}}", **extra})


@dataclasses.dataclass(frozen=True)
class TinyStraightRun:
    run_dir: Path
    """The finished run: read it, or copy it (`copy`) before writing into it."""
    val: Path
    """Its validation file, for runs that must have its config."""

    def overrides(self, run_dir: Path, **extra) -> list[str]:
        """This run's overrides with another run_dir (and `extra`): a run that must match it."""
        return tiny_straight_overrides(run_dir, self.val, **extra)

    def copy(self, dest: Path) -> Path:
        """A copy of the run directory at `dest`, for a test that writes into it."""
        shutil.copytree(self.run_dir, dest, symlinks=True)
        return dest


def train_tiny_straight_run(root: Path) -> TinyStraightRun:
    """The tiny straight run above, trained in this process on the Ray instance it has joined, under `root`."""
    from cloudrl.trainer.config import load_config
    from cloudrl.trainer.driver import train

    val = write_val_set(root / "val.jsonl")
    run_dir = root / "run"
    train(load_config("local", tiny_straight_overrides(run_dir, val)))
    return TinyStraightRun(run_dir, val)

"""Bad input found after the start ends in one line: a reward function that raises or returns garbage, a
model that cannot load on a node, a corrupted or mismatched checkpoint, a run_dir holding another run, a
dead Ray address, more local nodes than the machine holds, Ctrl+C during `cloudrl local up`.

Each is one line naming the problem and the fix, exit status 1 (130 for Ctrl+C), no traceback, nothing left
running and nothing overwritten. The pure checks are tested in milliseconds; a few cases run end to end.
A corrupted checkpoint and a run_dir holding another run are refused before the trainer joins Ray: those
commands run with RAY_ADDRESS on a port nothing listens on, so one that reached Ray would say so instead.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import typer.testing
from cli_helpers import CLOUDRL, INTERRUPTIBLE, cli_env, local_state, pids_alive, processes_with_env, send_sigint
from cloudrl.cli import jobs, local_cluster
from cloudrl.cli.app import app
from cloudrl.cli.errors import CloudrlError
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import CheckpointError, ClusterUnreachable, ModelLoadError, RewardError, RunDirError
from cloudrl.trainer.inputs.data import PromptRecord
from cloudrl.trainer.inputs.rewards import score
from cloudrl.trainer.roles.cluster import probe
from cloudrl.trainer.roles.workers import CriticWorker
from cloudrl.trainer.state import checkpoint, resume_checks
from cloudrl.trainer.state.run_dir import resume_point
from cloudrl.trainer.waiting import worker_errors
from runs import REWARD_IN_DRIVER, ROLLOUT_IN_ACTOR, WITHOUT_CRITIC, run_trainer, tiny_overrides

REWARDS = """
def explode(completions, ground_truth, **kwargs):
    return [1.0 / (g != "4") for g in ground_truth]

def nan_at_2(completions, **kwargs):
    return [float("nan") if i == 2 else 0.0 for i in range(len(completions))]
"""


def records(truths: list[str]) -> list[PromptRecord]:
    return [PromptRecord([3], f"q{i}", t, "toy") for i, t in enumerate(truths)]


def dead_ray_address() -> str:
    """host:port where nothing listens: the trainer given it as RAY_ADDRESS fails as soon as it tries to join."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The run's last stderr line, after checking the run failed the expected way."""
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-3000:]
    return last


# ----------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------


def test_a_raising_reward_names_the_function_the_exception_and_the_first_sample():
    def explode(completions, **kwargs):
        return [1.0 / (c != "7") for c in completions]

    with pytest.raises(RewardError) as err:
        score(explode, ["1", "2", "7", "7"], records(["1", "2", "3", "4"]), "rewards/mine.py:explode")
    message = str(err.value)
    assert message.startswith(
        "reward.function=rewards/mine.py:explode raised ZeroDivisionError: float division by "
        "zero at test_bad_input_runtime.py:"
    )
    assert "first on sample index 2 of 4 (completion '7', ground truth '3')" in message
    assert "\n" not in message


def test_a_reward_that_fails_only_on_the_whole_batch_says_so():
    def needs_two(completions, **kwargs):
        assert len(completions) == 1, "expects one completion per call"
        return [0.0]

    with pytest.raises(
        RewardError,
        match="AssertionError: expects one completion per call .* on the batch of 2 "
        r"\(each sample alone passes\)",
    ):
        score(needs_two, ["a", "b"], records(["1", "2"]), "mine:needs_two")


@pytest.mark.parametrize(
    "result, expected",
    [
        ([0.0, float("nan"), 1.0], "returned nan at index 1 (completion 'b', ground truth '2')"),
        ([0.0, 1.0, float("inf")], "returned inf at index 2 (completion 'c', ground truth '3')"),
        ([0.0, "1", 1.0], "returned '1' at index 1"),
        ([1.0], "returned 1 values for 3 completions: it must return a list of 3 numbers"),
        ("1,1,1", "returned '1,1,1' (str)"),
    ],
    ids=["nan", "inf", "string", "length", "not-a-list"],
)
def test_bad_reward_values_name_the_function_and_the_index(result, expected):
    with pytest.raises(RewardError) as err:
        score(lambda completions, **kw: result, ["a", "b", "c"], records(["1", "2", "3"]), "mine:fn")
    assert str(err.value).startswith("reward.function=mine:fn ")
    assert expected in str(err.value)


def test_worker_errors_unwraps_a_workers_trainer_error_and_passes_others():
    from ray.exceptions import RayTaskError

    wrapped = RayTaskError(
        "RewardWorker.score", "Traceback ...", RewardError("reward.function=x raised")
    ).as_instanceof_cause()
    with pytest.raises(RewardError) as err, worker_errors():
        raise wrapped
    assert type(err.value) is RewardError and str(err.value) == "reward.function=x raised"
    other = RayTaskError("f", "Traceback ...", KeyError("k")).as_instanceof_cause()
    with pytest.raises(RayTaskError), worker_errors():
        raise other


def test_a_worker_built_directly_raises_its_start_error_naming_role_and_node(tmp_path):
    """Outside a Ray actor the constructor raises at once; inside one, the worker's first call `where`
    raises it (test_a_critic_that_cannot_load_names_role_path_and_node)."""
    with pytest.raises(ModelLoadError, match=r"^critic rank 1 on node [\d.]+: cannot load the critic model from '"):
        CriticWorker(load_config("local").to_dict(), str(tmp_path), rank=1)


# ----------------------------------------------------------------------------------------------
# Checkpoints: checked before any actor starts
# ----------------------------------------------------------------------------------------------

SHAPES = {"embed.weight": (10, 4), "head.weight": (2, 4)}


def _save(run_dir: Path, algorithm: str = "ppo", parts=("actor", "critic"), shapes=SHAPES) -> Path:
    state = {
        name: {"model": {k: torch.zeros(s) for k, s in shapes.items()}, "optimizer": {}, "scheduler": {}}
        for name in parts
    }
    config = load_config("local", [f"algorithm.name={algorithm}"]).to_yaml()
    return checkpoint.save(str(run_dir), 1, state, {"step": 1}, config, keep_last=2)


def test_a_truncated_checkpoint_names_the_file_and_the_sizes(tmp_path):
    path = _save(tmp_path)
    size = (path / "actor.pt").stat().st_size
    with open(path / "actor.pt", "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(path, ["actor", "critic"])
    assert str(err.value).startswith(
        f"checkpoint file {path}/actor.pt has {size // 2} bytes but was saved with {size} "
        f"(a truncated or incomplete copy): resume from an earlier checkpoint"
    )


def test_a_corrupted_checkpoint_names_the_file(tmp_path):
    path = _save(tmp_path)
    size = (path / "critic.pt").stat().st_size
    (path / "critic.pt").write_bytes(b"\0" * size)  # same size: only reading it finds out
    with pytest.raises(
        CheckpointError,
        match=rf"^cannot read checkpoint file {path}/critic.pt \(\w+: .*\), it is "
        r"corrupted: resume from an earlier checkpoint",
    ):
        checkpoint.load(path, ["actor", "critic"])


def test_a_checkpoint_of_another_algorithm_is_refused(tmp_path):
    ckpt = checkpoint.load(_save(tmp_path, "grpo", parts=("actor",)), ["actor", "critic"])
    with pytest.raises(
        CheckpointError,
        match="saved by an algorithm.name=grpo run and this run sets "
        "algorithm.name=ppo: resume it with algorithm.name=grpo, or pick a new "
        "trainer.run_dir",
    ):
        resume_checks.check_matches(ckpt, load_config("local"), {})


def test_a_critic_less_checkpoint_is_refused_for_ppo(tmp_path):
    path = checkpoint.save(str(tmp_path), 1, {"actor": {"model": {}}}, {"step": 1}, "", keep_last=1)  # no config
    with pytest.raises(CheckpointError, match="has no critic.pt .* but algorithm.name=ppo trains one"):
        resume_checks.check_matches(checkpoint.load(path, ["actor", "critic"]), load_config("local"), {})


def test_a_checkpoint_of_another_model_size_names_the_tensor(tmp_path):
    ckpt = checkpoint.load(_save(tmp_path), ["actor", "critic"])
    cfg = load_config("local")
    resume_checks.check_matches(ckpt, cfg, {"actor": SHAPES, "critic": SHAPES})
    bigger = {**SHAPES, "embed.weight": (10, 8)}
    with pytest.raises(CheckpointError) as err:
        resume_checks.check_matches(ckpt, cfg, {"actor": bigger})
    assert str(err.value) == (
        f"checkpoint {ckpt.path}/actor.pt does not fit the actor model of "
        f"model.path=builtin:tiny: embed.weight is [10, 4] in the checkpoint and [10, 8] in the "
        f"model (another model size?): resume with the model it was trained from, or pick a "
        f"new trainer.run_dir (trainer.resume=never)"
    )


def test_shape_difference_in_words():
    assert resume_checks.shape_difference(SHAPES, SHAPES) is None
    assert (
        resume_checks.shape_difference({"a": (1,)}, {"a": (1,), "b": (2,)})
        == "the checkpoint lacks b (1 missing, 0 unexpected tensors)"
    )
    assert (
        resume_checks.shape_difference({"a": (1,), "c": (3,)}, {"a": (1,)})
        == "the model has no c (0 missing, 1 unexpected tensors)"
    )
    assert (
        resume_checks.shape_difference({"a": (1,), "b": (1,)}, {"a": (2,), "b": (2,)})
        == "a is [1] in the checkpoint and [2] in the model (1 more tensors differ)"
    )


def test_expected_shapes_are_those_of_the_loaded_models():
    """The meta-device models the resume check builds have exactly the loaded models' tensors."""
    from cloudrl.trainer.inputs.demo import materialize_builtin
    from cloudrl.trainer.inputs.models import load_causal_lm, load_value_model

    path = materialize_builtin("tiny")
    for role, load in (("actor", load_causal_lm), ("critic", load_value_model)):
        loaded = {k: tuple(v.shape) for k, v in load(path).state_dict().items()}
        assert resume_checks.expected_shapes(path, role) == loaded, role
    assert resume_checks.expected_shapes("/nonexistent/model", "actor") is None


# ----------------------------------------------------------------------------------------------
# The run directory: never written over
# ----------------------------------------------------------------------------------------------


def test_an_empty_run_dir_is_refused():
    with pytest.raises(RunDirError, match="trainer.run_dir is empty, so the run would write into the current dir"):
        resume_point("", "auto")


@pytest.mark.parametrize(
    "resume, with_checkpoint, fix",
    [
        (
            "auto",
            False,
            "it has no checkpoint to resume from: pick a new trainer.run_dir, or delete {run_dir} to start it over",
        ),
        ("never", True, "pick a new trainer.run_dir, or continue that run with trainer.resume=auto"),
        ("elsewhere", False, "resuming from {other} here would write over them: pick a new trainer.run_dir"),
    ],
)
def test_a_run_dir_with_another_runs_files_is_refused(tmp_path, resume, with_checkpoint, fix):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("theirs: 1\n")
    if with_checkpoint:
        _save(run_dir)
    other = _save(tmp_path / "other")
    with pytest.raises(RunDirError) as err:
        resume_point(str(run_dir), str(other) if resume == "elsewhere" else resume)
    found = "config.yaml, checkpoints" if with_checkpoint else "config.yaml"
    assert str(err.value) == (
        f"trainer.run_dir={run_dir} holds another run's files ({found}); {fix.format(run_dir=run_dir, other=other)}"
    )


def test_a_fresh_or_resumed_run_dir_is_accepted(tmp_path):
    assert resume_point(str(tmp_path / "new"), "auto") is None
    assert resume_point(str(tmp_path), "never") is None  # exists, but empty
    path = _save(tmp_path)
    (tmp_path / "config.yaml").write_text("ours: 1\n")
    assert resume_point(str(tmp_path), "auto") == path
    assert resume_point(str(tmp_path), str(path)) == path


# ----------------------------------------------------------------------------------------------
# Dead addresses
# ----------------------------------------------------------------------------------------------


def test_a_dead_ray_address_fails_in_one_line_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # closed below: nothing listens there
    start = time.monotonic()
    with pytest.raises(ClusterUnreachable) as err:
        probe(f"127.0.0.1:{dead}", "RAY_ADDRESS")
    assert time.monotonic() - start < 1
    assert str(err.value) == (
        f"RAY_ADDRESS=127.0.0.1:{dead}: no Ray cluster answers there (connection refused "
        f"within 3 s): unset RAY_ADDRESS to start a local Ray instance, or start the cluster "
        f"first (`cloudrl local up`, or `ray start --head` on that host)"
    )
    with socket.socket() as s:  # accepting is not enough: a Ray GCS answers as a gRPC server does
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ClusterUnreachable, match="accepts connections but is no Ray GCS"):
            probe(f"127.0.0.1:{s.getsockname()[1]}", "RAY_ADDRESS", timeout_s=0.5)
    probe("auto", "RAY_ADDRESS")


def test_the_trainer_with_a_stale_ray_address_fails_fast(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    start = time.monotonic()
    result = run_trainer(
        "--preset", "local", f"trainer.run_dir={tmp_path}", env={"RAY_ADDRESS": f"127.0.0.1:{dead}"}, timeout=60
    )
    assert time.monotonic() - start < 20
    assert one_line_error(result).startswith(f"error: RAY_ADDRESS=127.0.0.1:{dead}: no Ray cluster answers there")


# ----------------------------------------------------------------------------------------------
# `cloudrl local up` and the job's own error line
# ----------------------------------------------------------------------------------------------


def test_local_up_refuses_more_nodes_than_the_machine_holds(monkeypatch, tmp_path):
    import psutil

    monkeypatch.setattr(local_cluster.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * 2**30))
    monkeypatch.setenv("CLOUDRL_CACHE", str(tmp_path))
    result = typer.testing.CliRunner().invoke(app, ["local", "up", "--nodes", "100"])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "error: --nodes 100 is more than this machine can run: at most 8 (2 CPU cores x 4 allow 8; 64.0 GB of free "
        "memory at ~1.1 GB per node (--object-store-mb 512 + 600 MB of Ray processes) allows 57): "
        "use --nodes 8 or fewer"
    )
    assert local_state(tmp_path) is None  # nothing started, nothing recorded
    local_cluster.check_capacity(8, 512)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=1 * 2**30))
    with pytest.raises(CloudrlError, match="this machine cannot run a Ray node: 1.0 GB of free memory"):
        local_cluster.check_capacity(1, 512)


def test_the_jobs_own_error_line_is_the_reason_shown():
    traceback_only = (
        'step 1/2 | x=1\nTraceback (most recent call last):\n  File "a.py", line 1\n'
        "ray.exceptions.RayTaskError(KeyError): ray::RewardWorker.score()\nKeyError: 'answer'\n"
    )
    assert jobs.last_error_line(traceback_only) == "KeyError: 'answer'"
    own = "error: reward.function=mine:fn returned nan at index 2\n(RewardWorker pid=1) shutting down\n"
    assert jobs.last_error_line(own) == "error: reward.function=mine:fn returned nan at index 2"
    info = SimpleNamespace(message="Job entrypoint command failed with exit code 1, last available logs ...")
    assert jobs.failure_reason(info, "") == "Job entrypoint command failed with exit code 1, last available logs ..."


def test_status_ends_with_the_jobs_own_error():
    from cloudrl.cli.ray_api import Address
    from ray.job_submission import JobStatus

    info = SimpleNamespace(
        submission_id="j1",
        job_id=None,
        status=JobStatus.FAILED,
        start_time=1,
        end_time=2,
        metadata={},
        message="Job entrypoint command failed with exit code 1",
        driver_node_id="node-1",
    )
    logs = "step 1/2 | rollout/reward_mean=0.5 | 1 s/step\nerror: reward.function=mine:fn raised KeyError: 'x'\n"
    calls = {"read job j1": info}
    asked = []

    def get(path):  # the dashboard's log API: the tail of the job's driver log
        asked.append(path)
        return SimpleNamespace(status_code=200, text=logs)

    client = SimpleNamespace(
        address=Address("http://127.0.0.1:8265", "default"), call=lambda fn, what, job_id=None: calls[what], get=get
    )
    text = jobs.status_text(client, "j1")
    assert text.splitlines()[-1] == "error:     reward.function=mine:fn raised KeyError: 'x'"
    assert "latest:    step 1/2" in text
    assert asked and "job-driver-j1.log" in asked[0] and "lines=" in asked[0]  # the tail, not the whole log


# ----------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------


def _reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def _resources_released(timeout: float = 30) -> bool:
    """The shared Ray instance has every CPU back: the run's actors and placement groups are gone."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"):
            return True
        time.sleep(0.5)
    return False


@pytest.mark.ray
def test_a_raising_reward_in_a_reward_worker_ends_the_run_in_one_line(tmp_path):
    """Its own local Ray instance, as a user's run: afterwards no process it started is left."""
    mark = uuid.uuid4().hex
    extra = {"reward.function": f"{_reward_file(tmp_path)}:explode", **WITHOUT_CRITIC, **ROLLOUT_IN_ACTOR}
    overrides = tiny_overrides(tmp_path / "run", **extra)  # the actor and the reward worker
    result = run_trainer("--preset", "local", *overrides, env={"CLOUDRL_TEST_MARK": mark}, timeout=240)
    last = one_line_error(result)
    assert last.startswith(
        f"error: reward.function={tmp_path}/my_rewards.py:explode raised ZeroDivisionError: "
        f"float division by zero at my_rewards.py:3, first on sample index "
    )
    deadline = time.monotonic() + 20
    while processes_with_env("CLOUDRL_TEST_MARK", mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with_env("CLOUDRL_TEST_MARK", mark) == []


@pytest.mark.ray
def test_an_engine_trainer_gap_stops_the_run_at_step_1_before_anything_trains(ray_local, tmp_path):
    """trainer.gap_check=fail on the first step's real samples: the HF engine's log-probs against the actor's
    (float32 on CPU: equal to ~1e-12, so a limit far below that stands in for an engine that samples another
    distribution). The run stops with the line before the update: no step is logged."""
    extra = {"trainer.gap_check": "fail", "trainer.gap_check_max_k3": "1e-300", "model.sft_warmup_steps": "0"}
    extra |= {**WITHOUT_CRITIC, **REWARD_IN_DRIVER}  # the actor and its engine, a rollout worker
    run_dir = tmp_path / "run"
    result = run_trainer("--preset", "local", *tiny_overrides(run_dir, **extra), env={"RAY_ADDRESS": ray_local})
    last = one_line_error(result)
    assert last.startswith("error: the engines' log-probs of step 1's samples are not the trainer's: k3 KL ")
    assert last.endswith("and that they loaded this run's weights; trainer.gap_check=warn trains on regardless")
    logged = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    assert [json.loads(line)["step"] for line in logged] in ([], [0])  # at most the validation before RL


@pytest.mark.ray
def test_a_nan_reward_in_the_driver_ends_the_run_in_one_line(ray_local, tmp_path):
    extra = {"reward.function": f"{_reward_file(tmp_path)}:nan_at_2", **REWARD_IN_DRIVER}
    overrides = tiny_overrides(tmp_path / "run", **extra, **WITHOUT_CRITIC, **ROLLOUT_IN_ACTOR)  # the actor alone
    result = run_trainer("--preset", "local", *overrides, env={"RAY_ADDRESS": ray_local}, timeout=240)
    last = one_line_error(result)
    assert last.startswith(
        f"error: reward.function={tmp_path}/my_rewards.py:nan_at_2 returned nan at index 2 (completion "
    )
    assert last.endswith("each finite")
    assert _resources_released()


@pytest.mark.ray
def test_a_critic_that_cannot_load_names_role_path_and_node(ray_local, tmp_path):
    """Corrupted weights: the tokenizer (read by the driver) loads, the critic's worker cannot."""
    import shutil

    from cloudrl.trainer.inputs.models import resolve_path

    overrides = tiny_overrides(tmp_path / "run", **ROLLOUT_IN_ACTOR, **REWARD_IN_DRIVER)  # the actor and the critic
    good = resolve_path("builtin:tiny", load_config("local", overrides))
    critic = tmp_path / "critic"
    shutil.copytree(good, critic)
    with open(critic / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 64)  # the header's length field: now absurd
    result = run_trainer(
        "--preset", "local", *overrides, f"critic.model_path={critic}", env={"RAY_ADDRESS": ray_local}, timeout=240
    )
    last = one_line_error(result)
    assert last.startswith("error: critic rank 0 on node ")
    assert f": cannot load the critic model from '{critic}' (SafetensorError: " in last
    assert f"check that {critic} holds a complete model" in last
    assert not (tmp_path / "run" / "config.yaml").exists()  # a failed start writes no run files
    assert _resources_released()


@pytest.mark.ray
def test_a_failed_worker_call_ends_the_wait_at_once(ray_local):
    """A worker's error is raised as soon as its call ends, not after the slowest other worker."""
    import ray
    from cloudrl.trainer.waiting import get_all

    @ray.remote(num_cpus=0)
    class Worker:
        def run(self, seconds: float, fail: bool) -> float:
            if fail:
                raise ModelLoadError("critic rank 0 on node 10.0.0.2: cannot load the critic model")
            time.sleep(seconds)
            return seconds

    slow, failing = Worker.remote(), Worker.remote()
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="^critic rank 0 on node 10.0.0.2"), worker_errors():
        get_all([slow.run.remote(60, False), failing.run.remote(0, True)], ["slow", "failing"], 120, "starting")
    assert time.monotonic() - start < 30
    ray.kill(slow)
    ray.kill(failing)


def _snapshot(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def test_a_corrupted_checkpoint_is_refused_before_ray_starts(tmp_path):
    run_dir = tmp_path / "run"
    ckpt = _save(run_dir)
    (run_dir / "config.yaml").write_text("the previous run's config\n")
    with open(ckpt / "actor.pt", "r+b") as f:
        f.truncate(100)
    before = _snapshot(run_dir / "config.yaml")
    dead = dead_ray_address()
    result = run_trainer("--preset", "local", *tiny_overrides(run_dir), env={"RAY_ADDRESS": dead}, timeout=120)
    last = one_line_error(result)
    assert last.startswith(f"error: checkpoint file {ckpt}/actor.pt has 100 bytes but was saved with ")
    assert dead not in result.stdout + result.stderr  # refused before it tried to join Ray
    assert "resolved config" not in result.stdout  # refused before the run began
    assert _snapshot(run_dir / "config.yaml") == before


def test_a_run_dir_holding_another_run_is_refused_and_left_alone(tmp_path):
    (tmp_path / "config.yaml").write_text("another run's config\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    before = [_snapshot(tmp_path / name) for name in ("config.yaml", "metrics.jsonl")]
    dead = dead_ray_address()
    result = run_trainer("--preset", "local", *tiny_overrides(tmp_path), env={"RAY_ADDRESS": dead}, timeout=120)
    assert dead not in result.stdout + result.stderr  # refused before it tried to join Ray
    assert one_line_error(result) == (
        f"error: trainer.run_dir={tmp_path} holds another run's files (config.yaml, "
        f"metrics.jsonl); it has no checkpoint to resume from: pick a new "
        f"trainer.run_dir, or delete {tmp_path} to start it over"
    )
    assert [_snapshot(tmp_path / name) for name in ("config.yaml", "metrics.jsonl")] == before


@pytest.mark.ray
def test_ctrl_c_during_local_up_stops_what_it_started(tmp_path):
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [CLOUDRL, "local", "up", "--nodes", "2"],
        env=cli_env(tmp_path, CLOUDRL_TEST_MARK=mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **INTERRUPTIBLE,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (local_state(tmp_path) or {}).get("nodes") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        pids = [n["pid"] for n in local_state(tmp_path)["nodes"]]
        send_sigint(proc)  # while the head starts: Ctrl+C mid-way
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip() == (
        "interrupted: stopped every Ray node `cloudrl local up` had started; nothing is left running"
    )
    assert pids, "interrupted before any node started"
    assert pids_alive(pids) == [] and processes_with_env("CLOUDRL_TEST_MARK", mark) == []
    assert local_state(tmp_path) is None

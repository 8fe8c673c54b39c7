"""The newcomer's path without a cluster: the preflight names every shortfall and the local fixes, a reward
file's helper modules travel with it, the debugging hints are true, `cloudrl logs` picks the latest job and
narrows --node to one job, `--version`, `--help-config` with a preset's values, the job's short config
line, and the GPU preset using every GPU it is written for.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import zipfile
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest
from cloudrl.cli import app as app_module
from cloudrl.cli import jobs, node_logs
from cloudrl.cli.app import app
from cloudrl.cli.errors import CloudrlError
from cloudrl.cli.ray_api import Address
from cloudrl.cli.shipping import plan_upload, write_zip
from cloudrl.trainer.__main__ import config_changes, preset_alone
from cloudrl.trainer.__main__ import main as trainer_main
from cloudrl.trainer.config import load_config
from cloudrl.trainer.errors import DataError
from cloudrl.trainer.inputs.rewards import resolve_reward_fn
from cloudrl.trainer.roles.placement import ClusterTooSmall, check_fits, plan
from typer.testing import CliRunner

# ----------------------------------------------------------------------------------------------
# The preflight
# ----------------------------------------------------------------------------------------------

TWO_SMALL_NODES = [{"CPU": 2.0}, {"CPU": 2.0}]
TOO_BIG = ["actor.nodes=2", "actor.micro_batch_size=128", "actor.gpus_per_node=1", "actor.cpus_per_worker=2"]


def test_the_preflight_names_every_short_resource_at_once_with_its_own_keys():
    cfg = load_config("local", TOO_BIG)
    with pytest.raises(ClusterTooSmall) as caught:
        check_fits(plan(cfg), TWO_SMALL_NODES)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("the config asks for 2 GPU (2 for actor (actor.nodes=2 x actor.gpus_per_node=1))")
    assert "; and 7 CPU (" in message  # 4 actor + critic + reward + rollout
    assert "4 for actor (actor.nodes=2 x actor.gpus_per_node=1 x actor.cpus_per_worker=2.0)" in message
    assert "1 for rollout (rollout.num_engines=1 x rollout.cpus_per_engine=1)" in message
    assert "gpus_per_engine" not in message
    assert message.endswith("lower those keys or add nodes")  # not the local cluster: no local fixes


def test_on_the_local_cluster_the_preflight_names_the_local_fixes_and_they_fit():
    cfg = load_config("local", TOO_BIG)
    with pytest.raises(ClusterTooSmall) as caught:
        check_fits(plan(cfg), TWO_SMALL_NODES, local=True)
    message = str(caught.value)
    up = re.search(r"`cloudrl local down && cloudrl local up --nodes (\d+) --cpus (\d+) --gpus (\d+)`", message)
    assert up, message
    assert "reward.in_driver=true" in message
    nodes, cpus, gpus = map(int, up.groups())
    check_fits(plan(cfg), [{"CPU": float(cpus), "GPU": float(gpus)}] * nodes)  # the suggested cluster holds it


def test_the_local_fix_for_a_cpu_shortfall_is_exact():
    """The newcomer's case: actor.nodes=2 on `cloudrl local up --nodes 2` (2 CPUs each) needs one CPU more."""
    cfg = load_config("local", ["actor.nodes=2", "actor.micro_batch_size=128"])
    with pytest.raises(ClusterTooSmall, match=r"--nodes 2 --cpus 3`\); or score rule-based rewards in the driver"):
        check_fits(plan(cfg), TWO_SMALL_NODES, local=True)
    check_fits(
        plan(load_config("local", ["actor.nodes=2", "actor.micro_batch_size=128", "reward.in_driver=true"])),
        TWO_SMALL_NODES,
    )


def test_the_cli_preflight_knows_the_local_cluster():
    from cloudrl.cli import submit as sub

    class Client:
        address = Address("http://127.0.0.1:1", "local")

        def check_version(self):
            return "2.60.0"

        def alive_nodes(self):
            return TWO_SMALL_NODES

    with pytest.raises(CloudrlError, match=r"cloudrl local up --nodes 2 --cpus 3.*\(cluster at http://127.0.0.1:1\)"):
        sub.preflight(Client(), load_config("local", ["actor.nodes=2", "actor.micro_batch_size=128"]))


def test_the_gpu_preset_uses_all_16_gpus_of_its_2_x_8_layout():
    requests = plan(load_config("gsm8k-7b"))
    assert sum(r.total("GPU") for r in requests) == 16
    check_fits(requests, [{"CPU": 64.0, "GPU": 8.0}, {"CPU": 64.0, "GPU": 8.0}])


# ----------------------------------------------------------------------------------------------
# A reward file with helpers beside it
# ----------------------------------------------------------------------------------------------


def write_reward(folder: Path, tag: str) -> str:
    """folder/score_<tag>.py importing helper_<tag> (a module beside it) which imports pkg_<tag> (a package
    beside it); the file names carry `tag` so no two tests share a module name in sys.modules."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"score_{tag}.py").write_text(
        f"import os\nfrom helper_{tag} import bonus\n\n\ndef score(completions, **kwargs):\n"
        f"    return [bonus(c) for c in completions]\n"
    )
    (folder / f"helper_{tag}.py").write_text(
        f"from pkg_{tag}.inner import base\n\n\ndef bonus(c):\n    return base + len(c)\n"
    )
    (folder / f"pkg_{tag}").mkdir()
    (folder / f"pkg_{tag}" / "__init__.py").write_text("")
    (folder / f"pkg_{tag}" / "inner.py").write_text("base = 0.5\n")
    (folder / "unrelated.py").write_text("raise SystemExit('never imported')\n")
    return f"score_{tag}.py:score"


def load_shipped(tmp_path: Path, upload, spec: str) -> str:
    """Unzip the upload as Ray would on a node and load the reward there in a fresh Python (no sys.path
    from this one): what the job's driver and reward workers do."""
    unpacked = tmp_path / "node"
    zipped = tmp_path / "job.zip"
    write_zip(upload, zipped)
    zipfile.ZipFile(zipped).extractall(unpacked)
    code = f"from cloudrl.trainer.inputs.rewards import resolve_reward_fn; print(resolve_reward_fn({spec!r})(['ab']))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=unpacked, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip()


def test_a_reward_file_ships_with_the_modules_it_imports_from_beside_it(tmp_path, monkeypatch):
    project = tmp_path / "project"
    spec = "rewards/" + write_reward(project / "rewards", "a")
    cfg = load_config("local", [f"reward.function={spec}"])
    upload = plan_upload(cfg, project)
    assert sorted(upload.files) == [
        "rewards/helper_a.py",
        "rewards/pkg_a/__init__.py",
        "rewards/pkg_a/inner.py",
        "rewards/score_a.py",
    ]
    assert load_shipped(tmp_path, upload, spec) == "[2.5]"


def test_a_reward_file_outside_the_directory_keeps_its_helpers_beside_it(tmp_path):
    outside = tmp_path / "elsewhere"
    name = write_reward(outside, "b")
    cfg = load_config("local", [f"reward.function={outside / name}"])
    (tmp_path / "project").mkdir()
    upload = plan_upload(cfg, tmp_path / "project")
    spec = upload.rewrites["reward.function"]
    folder = spec.rpartition("/")[0]
    assert folder.startswith("_external/") and f"{folder}/helper_b.py" in upload.files
    assert f"{folder}/pkg_b/inner.py" in upload.files and f"{folder}/unrelated.py" not in upload.files
    assert load_shipped(tmp_path, upload, spec) == "[2.5]"


def test_the_trainer_loads_a_reward_file_that_imports_a_helper_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = "rewards/" + write_reward(tmp_path / "rewards", "c")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder the load adds stays in this test
    assert resolve_reward_fn(spec)(["abc"]) == [3.5]


def test_a_module_found_nowhere_names_the_fix_not_a_temp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lonely_d.py").write_text("from not_shipped_helper_d import x\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(DataError) as caught:
        resolve_reward_fn("lonely_d.py:score")
    message = str(caught.value)
    assert message.startswith("reward file lonely_d.py imports 'not_shipped_helper_d'")
    assert "--workdir ." in message and str(tmp_path) not in message


# ----------------------------------------------------------------------------------------------
# Debugging hints, `cloudrl logs`
# ----------------------------------------------------------------------------------------------

REWARD_LINE = (
    "error: reward.function=bad.py:score raised KeyError: 'answer' at bad.py:2, first on sample index 0 of 64 "
    "(completion '5', ground truth '15'): fix the function (CLOUDRL_DEBUG=1 shows the traceback)"
)


class FakeJobs:
    """Ray's JobSubmissionClient, as far as follow, status and logs use it."""

    def __init__(self, infos: list, logs: dict[str, str]):
        self.infos = {i.submission_id: i for i in infos}
        self.logs = logs

    def get_job_info(self, job_id):
        return self.infos[job_id]

    def get_job_logs(self, job_id):
        return self.logs[job_id]

    def list_jobs(self):
        return list(self.infos.values())

    async def tail_job_logs(self, job_id):
        yield self.logs[job_id]


class Status(str):
    def is_terminal(self) -> bool:
        return self in ("SUCCEEDED", "FAILED", "STOPPED")


def job(name: str, start: int, status: str = "FAILED", ray_job: str = "02000000"):
    return SimpleNamespace(
        submission_id=name,
        job_id=ray_job,
        status=Status(status),
        start_time=start,
        end_time=start + 1,
        message="",
        metadata={},
        driver_node_id=None,
    )


class FakeClient:
    def __init__(self, infos, logs, files=None):
        self.address = Address("http://127.0.0.1:1", "local")
        self.jobs = FakeJobs(infos, logs)
        self.files = files or {}

    def call(self, fn, what="", job_id=None):
        return fn()

    def get_json(self, path, read_timeout=None):
        if path.startswith("/api/v0/nodes"):
            return {
                "data": {
                    "result": {
                        "result": [
                            {"state": "ALIVE", "is_head_node": True, "node_ip": "127.0.0.1", "node_id": "ab" * 28}
                        ]
                    }
                }
            }
        return {"result": True, "data": {"result": {"worker_out": list(self.files)}}}

    def get(self, path, read_timeout=None):
        name = re.search(r"filename=([^&]+)", path)[1]
        return SimpleNamespace(status_code=200, text=self.files[name])


class BrokenStreamJobs(FakeJobs):
    """A log stream that closes abnormally (Ray's `RuntimeError: WebSocket connection closed unexpectedly with
    close code 1006`) `after_s` into the job, which has ended; `get_job_info` takes `info_s`."""

    def __init__(self, infos, logs, after_s: float, info_s: float = 0.0):
        super().__init__(infos, logs)
        self.after_s, self.info_s = after_s, info_s

    def get_job_info(self, job_id):
        time.sleep(self.info_s)
        return super().get_job_info(job_id)

    async def tail_job_logs(self, job_id):
        import asyncio

        yield self.logs[job_id]
        await asyncio.sleep(self.after_s)
        raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")


@pytest.mark.parametrize("after_s, info_s", [(0.0, 0.0), (0.1, 0.3)], ids=["while-waiting", "at-the-last-check"])
def test_a_log_stream_that_breaks_after_the_job_ended_is_no_error(monkeypatch, capsys, caplog, after_s, info_s):
    """The job succeeded; its log stream then closed abnormally, either while the follower waited on it (once an
    error "the log stream ... broke") or while it asked for the job's status one last time (once an unretrieved
    task exception, printed with its traceback after the job's SUCCEEDED line)."""
    import gc

    monkeypatch.setattr(jobs, "STATUS_POLL_S", 0.05)
    monkeypatch.setattr(jobs, "END_GRACE_S", 0.0)
    client = FakeClient([job("j1", 1, "SUCCEEDED")], {"j1": "step 1/1 | x\n"})
    client.jobs = BrokenStreamJobs(client.jobs.infos.values(), client.jobs.logs, after_s, info_s)
    with caplog.at_level("ERROR", logger="asyncio"):
        info = jobs.follow(client, "j1")
        gc.collect()
    assert info.status == "SUCCEEDED"
    assert capsys.readouterr().out == "step 1/1 | x\n"
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def test_a_failed_job_says_how_to_get_the_jobs_traceback(capsys):
    client = FakeClient([job("j1", 1)], {"j1": "step 1/2 | x\n" + REWARD_LINE + "\n"})
    with pytest.raises(CloudrlError) as caught:
        jobs.follow(client, "j1")
    message = str(caught.value)
    assert "CLOUDRL_DEBUG=1 shows the traceback" not in message  # untrue for a job: it never sees this shell
    assert "`CLOUDRL_DEBUG=1 cloudrl submit --env CLOUDRL_DEBUG ...`" in message
    assert "full logs: cloudrl logs j1 --local" in message


def test_logs_defaults_to_the_latest_job(monkeypatch):
    client = FakeClient([job("old", 1), job("new", 5, "SUCCEEDED")], {"old": "old log\n", "new": "new log\n"})
    monkeypatch.setattr(app_module, "_client", lambda *args: client)
    result = CliRunner().invoke(app, ["logs", "--local"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "new log\n"
    assert "logs of new, the latest job" in result.stderr


def test_node_logs_narrow_to_one_job(monkeypatch):
    files = {
        "worker-aa11-02000000-101.out": "reward of j1\n",
        "worker-bb22-03000000-102.out": "someone else's job\n",
        "worker-cc33-ffffffff-103.out": "idle worker\n",
    }
    client = FakeClient([job("j1", 1, "RUNNING", "02000000")], {}, files)
    text = node_logs.node_logs_text(client, "0", 5, "worker-*", job="j1")
    assert "reward of j1" in text and "someone else's job" not in text and "idle worker" not in text
    assert "1 file(s) of job j1 (Ray job 02000000)" in text
    monkeypatch.setattr(app_module, "_client", lambda *args: client)
    result = CliRunner().invoke(app, ["logs", "j1", "--node", "0", "--local"])
    assert result.exit_code == 0 and "reward of j1" in result.stdout and "idle worker" not in result.stdout
    every = node_logs.node_logs_text(client, "0", 5)
    assert "someone else's job" in every  # without a job id: every worker file of the node


# ----------------------------------------------------------------------------------------------
# Small ones
# ----------------------------------------------------------------------------------------------


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"cloudrl {version('cloudrl')}\n"


def test_help_config_shows_the_presets_values(capsys):
    assert trainer_main(["--preset", "local", "--help-config", "trainer.seed=7"]) == 0
    lines = {line.split(" = ")[0].strip(): line for line in capsys.readouterr().out.splitlines() if " = " in line}
    preset_steps = load_config("local").trainer.total_steps
    assert preset_steps != 20  # the code's default, which --help-config used to show
    assert lines["trainer.total_steps"].startswith(f"  trainer.total_steps = {preset_steps}  (default 20)  # ")
    assert lines["trainer.seed"].startswith("  trainer.seed = 7  (default ")
    assert "(default" not in lines["rollout.top_p"]  # unchanged keys stay as they were


def test_the_job_prints_only_what_differs_from_its_preset():
    cfg = load_config("local", ["actor.lr=2e-5", "trainer.loggers=[console,jsonl]", "trainer.total_steps=300"])
    lines = config_changes("local", cfg, preset_alone("local")).splitlines()
    assert lines[1:] == ["  actor.lr=2e-05", "  trainer.loggers=[console,jsonl]"]  # what the command line changed
    # total_steps=300 is the preset's own value, and sft_warmup_steps differs from the code's default only
    assert not any(line.startswith(("  trainer.total_steps", "  model.sft_warmup_steps")) for line in lines)
    assert "preset local" in lines[0] and "--preset local --help-config" in lines[0]
    assert f"{cfg.trainer.run_dir}/config.yaml" in lines[0]
    assert config_changes("local", load_config("local"), preset_alone("local")).startswith(
        "cloudrl trainer: 0 config key(s) differ from the preset local "
    )


def test_the_trainer_prints_the_changes_once_before_the_job(monkeypatch, capsys):
    from cloudrl.trainer import driver

    monkeypatch.setattr(driver, "train", lambda cfg: None)
    assert trainer_main(["--preset", "local", "actor.lr=2e-5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [out[0], "  actor.lr=2e-05"] and out[0].startswith("cloudrl trainer: 1 config key(s) differ")

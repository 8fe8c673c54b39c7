"""W&B and MLflow across resumes and restarts: one tracker run per timeline of the run_dir.

In process, no Ray: `MetricsLogger` as the driver makes it, with the timeline checkpoint.py would decide
(a resume that continues the timeline reads run_dir/timeline.json; a fresh start mints a new one). W&B
runs offline (its run files are read back), MLflow on a local file store (read back with its client).
"""

from __future__ import annotations

import glob
import json
import socket
import struct
import time
import uuid
from pathlib import Path

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.metrics import TRACKERS, MetricsLogger
from cloudrl.trainer.state import timeline


@pytest.fixture
def run_dir(tmp_path: Path):
    run_dir = str(tmp_path / "run")
    Path(run_dir).mkdir()
    yield run_dir
    timeline.forget(run_dir)


def config(run_dir: str, loggers: str, **keys):
    cfg = load_config("local", [f"trainer.run_dir={run_dir}", f"trainer.loggers=[{loggers}]", "trainer.total_steps=4"])
    for key, value in keys.items():
        setattr(cfg.trainer, key, value)
    return cfg


def fresh_timeline(run_dir: str) -> str:
    """A new run in run_dir (a first start, or one after trainer.resume=never): a new timeline, recorded."""
    timeline.forget(run_dir)
    begun = timeline.begin_timeline(run_dir, None, continuing=False)
    timeline.write_timeline(run_dir)
    return begun.run_id


def continue_timeline(run_dir: str) -> None:
    """A new process that continues run_dir's timeline (resume=auto, a resubmit): timeline.json rules."""
    timeline.forget(run_dir)


_LAST_START = [0]


def log_steps(cfg, resumed_step: int, values: dict[int, float]) -> None:
    # W&B names an offline run's directory by its start second and run id: a resume of the same run id
    # within the second of the previous start would share (and overwrite) that directory.
    while int(time.time()) == _LAST_START[0]:
        time.sleep(0.05)
    _LAST_START[0] = int(time.time())
    logger = MetricsLogger(cfg, cfg.trainer.run_dir, resumed_step)
    for step, value in values.items():
        logger.log(step, {"rollout/reward_mean": value, "val/set@1/reward_mean": value})
    logger.close()


# ----------------------------------------------------------------------------------------------
# W&B (offline)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    key = f"dummy-{uuid.uuid4().hex}"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_API_KEY", key)
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    yield tmp_path / "wandb-dir", key
    wandb.teardown()  # wandb reads its environment once per process: the next test's is another


def wandb_records(path: str):
    """The protobuf records of an offline run's .wandb file (a LevelDB-style log: 32 KiB blocks of
    records, each with a 7-byte header: CRC, length, kind; a record may span blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block = 32768
    pos = 7
    pending = b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(wandb_dir: Path, expected: int, timeout_s: float = 30.0) -> list[tuple[str, dict[int, float]]]:
    """Each offline run started, in order: its W&B run id and the steps it logged with their rewards. W&B's
    service process writes a run's file on its own time, also after `finish` returned: this waits (up to
    `timeout_s`) until `expected` runs are there, each with its run record and a logged step."""
    deadline = time.monotonic() + timeout_s
    while True:
        runs = _read_wandb_runs(wandb_dir)
        if (len(runs) >= expected and all(run_id and steps for run_id, steps in runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def _read_wandb_runs(wandb_dir: Path) -> list[tuple[str, dict[int, float]]]:
    runs = []
    for path in glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")):
        run_id = None
        started = 0
        steps = {}
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                run_id = record.run.run_id
                started = record.run.start_time.seconds * 10**9 + record.run.start_time.nanos
            elif record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                steps[items["_step"]] = items["rollout/reward_mean"]
        runs.append((started, run_id, steps))
    return [(run_id, steps) for _, run_id, steps in sorted(runs, key=lambda run: run[0])]


def test_wandb_resume_continues_the_same_run_and_a_fresh_timeline_gets_a_new_one(run_dir, wandb_offline, capsys):
    wandb_dir, key = wandb_offline
    cfg = config(run_dir, "wandb")
    first = fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1, 2: 0.2, 3: 0.3})
    continue_timeline(run_dir)
    log_steps(cfg, 2, {3: 0.33, 4: 0.4})  # resumed from a checkpoint at step 2: step 3 runs again
    assert "steps 3..3 run again keep their first values there" in capsys.readouterr().out
    second = fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.5})

    runs = wandb_runs(wandb_dir, expected=3)
    assert [run_id for run_id, _ in runs] == [first, first, second]
    assert first != second
    # Steps continue past the resume; W&B holds step 3 once (its first value), as it takes no step twice.
    assert runs[0][1] == {1: 0.1, 2: 0.2, 3: 0.3}
    assert runs[1][1] == {4: 0.4}
    assert runs[2][1] == {1: 0.5}
    record = json.loads((Path(run_dir) / TRACKERS).read_text())
    assert record["wandb"]["run"] == second and record["wandb"]["step"] == 1
    leaked = [p for p in Path(wandb_dir).parent.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert not leaked, f"WANDB_API_KEY's value written to {leaked}"


def test_wandb_gets_no_secret_from_the_environment(run_dir, wandb_offline, monkeypatch):
    wandb_dir, _ = wandb_offline
    token = f"tok-{uuid.uuid4().hex}"
    monkeypatch.setenv("CLOUDRL_TEST_TOKEN", token)  # typed into config keys by mistake
    cfg = config(run_dir, "wandb", wandb_group=f"g-{token}", ray_address=f"ray://admin:{token}@10.0.0.1:10001")
    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1})
    deadline = time.monotonic() + 30  # W&B's service writes the file on its own time, also after finish
    config_items = {}
    while "trainer" not in config_items and time.monotonic() < deadline:
        time.sleep(0.2)
        for path in glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")):
            for record in wandb_records(path):
                kind = record.WhichOneof("record_type")
                # The config comes in the run record, or after it in config records, as W&B's timing has it.
                updates = (
                    record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
                )
                config_items.update({item.key: json.loads(item.value_json) for item in updates})
    assert config_items["trainer"]["wandb_group"] == "g-***"
    assert config_items["trainer"]["ray_address"] == "ray://***@10.0.0.1:10001"
    assert config_items["timeline"]["run_id"]
    leaked = [p for p in wandb_dir.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert not leaked, f"a secret's value written to {leaked}"


# ----------------------------------------------------------------------------------------------
# MLflow (local file store)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny)")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a database store otherwise
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return (tmp_path / "mlruns").as_uri()


def mlflow_history(uri: str, run_id: str, key: str = "rollout/reward_mean") -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(uri).get_metric_history(run_id, key)}


def test_mlflow_resume_continues_the_same_run_and_a_fresh_timeline_gets_a_new_one(run_dir, mlflow_store):
    from mlflow.tracking import MlflowClient

    cfg = config(run_dir, "mlflow", mlflow_tracking_uri=mlflow_store, mlflow_experiment="loggers")
    first_timeline = fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1, 2: 0.2, 3: 0.3})
    first = json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"]
    assert MlflowClient(mlflow_store).get_run(first).info.status == "KILLED"  # stopped before total_steps
    continue_timeline(run_dir)
    cfg.trainer.total_steps = 5  # changed on resume: the run keeps the param it started with
    log_steps(cfg, 2, {3: 0.33, 4: 0.4})
    assert json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"] == first
    assert mlflow_history(mlflow_store, first) == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    assert mlflow_history(mlflow_store, first, "val/set_1/reward_mean")[4] == 0.4
    run = MlflowClient(mlflow_store).get_run(first)
    assert run.data.params["trainer.total_steps"] == "4"
    assert run.data.params["trainer.loggers"] == '["mlflow"]'
    assert run.data.tags["cloudrl.timeline"] == first_timeline

    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.5})
    second = json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"]
    assert second != first
    assert mlflow_history(mlflow_store, second) == {1: 0.5}


def test_mlflow_finds_the_timeline_run_by_its_tag_when_the_record_is_lost(run_dir, mlflow_store):
    cfg = config(run_dir, "mlflow", mlflow_tracking_uri=mlflow_store)
    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1, 2: 0.2, 3: 0.3})
    first = json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"]
    (Path(run_dir) / TRACKERS).unlink()  # a resume on a new disk, its checkpoints fetched from checkpoint_uri
    continue_timeline(run_dir)
    log_steps(cfg, 2, {3: 0.33, 4: 0.4})
    assert json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"] == first
    assert mlflow_history(mlflow_store, first) == {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}


def test_mlflow_params_carry_no_secret_from_the_environment(run_dir, mlflow_store, monkeypatch):
    from mlflow.tracking import MlflowClient

    token = f"tok-{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", token)
    cfg = config(run_dir, "mlflow", mlflow_tracking_uri=mlflow_store, wandb_group=f"g-{token}")
    cfg.trainer.ray_address = f"ray://admin:{token}@10.0.0.1:10001"
    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1})
    run_id = json.loads((Path(run_dir) / TRACKERS).read_text())["mlflow"]["run"]
    params = MlflowClient(mlflow_store).get_run(run_id).data.params
    assert params["trainer.wandb_group"] == "g-***"
    assert params["trainer.ray_address"] == "ray://***@10.0.0.1:10001"
    assert not [k for k, v in params.items() if token in v]


def test_unreachable_mlflow_server_is_one_warning_and_the_other_loggers_go_on(run_dir, mlflow_store, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    password = uuid.uuid4().hex
    cfg = config(run_dir, "jsonl,mlflow", mlflow_tracking_uri=f"http://user:{password}@127.0.0.1:{port}")
    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1, 2: 0.2})
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert f"cannot reach the MLflow server at http://***@127.0.0.1:{port}" in warnings[0]
    assert password not in err
    assert [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (Path(run_dir) / TRACKERS).exists()


def test_mlflow_without_a_tracking_uri_is_one_warning(run_dir, mlflow_store, capsys):
    cfg = config(run_dir, "mlflow")
    fresh_timeline(run_dir)
    log_steps(cfg, 0, {1: 0.1})
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert "set trainer.mlflow_tracking_uri, or pass MLFLOW_TRACKING_URI" in err

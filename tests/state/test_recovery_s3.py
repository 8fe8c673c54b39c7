"""Checkpoints off the instance, against a real S3-compatible server started here (moto in server mode on
127.0.0.1, stopped by PID): every checkpoint is uploaded with its completion marker last, and a run whose
local run_dir was deleted resumes from the newest complete copy in the bucket."""

from __future__ import annotations

import shutil

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.driver import train
from cloudrl.trainer.state import timeline
from runs import REWARD_IN_DRIVER, ROLLOUT_IN_ACTOR, tiny_overrides
from servers import s3_server as moto_server

pytestmark = pytest.mark.ray
pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_server():
    with moto_server() as url:
        yield url


def test_resume_from_the_bucket_after_the_run_dir_is_deleted(ray_local, s3_server, tmp_path, monkeypatch):
    import s3fs

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_server,
    }.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("cloudrl-ckpt")
    uri = "s3://cloudrl-ckpt/runs/a"
    run_dir = tmp_path / "run"
    common = {
        "trainer.save_every": 1,
        "trainer.keep_last": 2,
        "trainer.checkpoint_uri": uri,
        "trainer.export_hf": "false",
        **ROLLOUT_IN_ACTOR,  # the two trained roles, which the checkpoint holds
        **REWARD_IN_DRIVER,
    }
    train(load_config("local", tiny_overrides(run_dir, **common, **{"trainer.total_steps": 3})))
    fs.invalidate_cache()
    copies = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("cloudrl-ckpt/runs/a"))
    assert copies == ["step_000002", "step_000003"]  # keep_last applies to the bucket too
    assert fs.exists("cloudrl-ckpt/runs/a/step_000003/COMPLETE")
    assert fs.exists("cloudrl-ckpt/runs/a/step_000003/actor/.metadata")
    # An upload cut short (no marker) is never resumed from.
    fs.pipe("cloudrl-ckpt/runs/a/step_000009/trainer.json", b"{}")

    shutil.rmtree(run_dir)  # the instance and its disk are gone
    summary = train(load_config("local", tiny_overrides(run_dir, **common, **{"trainer.total_steps": 4})))
    assert summary["resumed_from"] == 3 and summary["steps"] == 4
    assert timeline.latest(str(run_dir)).name == "step_000004"
    fs.invalidate_cache()
    assert fs.exists("cloudrl-ckpt/runs/a/step_000004/COMPLETE")
    log_text = (run_dir / "metrics.jsonl").read_text() + (run_dir / "config.yaml").read_text()
    assert "testing-secret" not in log_text  # credentials are never stored

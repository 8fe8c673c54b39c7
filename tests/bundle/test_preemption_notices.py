"""The node's preemption-notice watcher (tasks/ray_bringup.py `notices`) against stand-ins for the three clouds'
metadata services (tests/helpers/servers.py `MetadataService`, on 127.0.0.1 where a cloud's is link-local) and
Slurm's `squeue` (a stand-in script printing the job's end): which one answers, no notice until the cloud
announces one or the time limit is near, then the notice with the time the instance goes.
No Ray here: draining the node and the trainer leaving it are tests/loop/test_preemption.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from servers import MetadataService, free_port
from test_bundle_bootstrap import REPO, load_bringup


@pytest.fixture
def bringup():
    return load_bringup()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_the_answering_cloud_is_watched_and_its_notice_read_with_its_deadline(bringup, cloud, monkeypatch):
    service = MetadataService(cloud, lead_s=90)
    try:
        monkeypatch.setattr(bringup, "METADATA_URL", service.url)
        assert bringup.notice_source("auto") == cloud
        poll = bringup.NOTICE_POLLS[cloud]
        assert poll() is None  # the service answers: no notice yet
        service.announce()
        notice = poll()
        assert isinstance(notice, bringup.Notice), notice
        lead = 30 if cloud == "gcp" else 90  # GCP gives no time: its fixed 30 s
        assert abs(notice.deadline - (time.time() + lead)) < 3, (notice.text, notice.deadline - time.time())
        assert {"aws": "AWS spot terminate at", "gcp": "GCP preemption", "azure": "Azure Preempt not before"}[
            cloud
        ] in notice.text
    finally:
        service.close()


def test_a_cloud_named_by_hand_that_does_not_answer_is_not_watched(bringup, monkeypatch):
    service = MetadataService("gcp")
    try:
        monkeypatch.setattr(bringup, "METADATA_URL", service.url)
        assert bringup.notice_source("aws") is None  # a GCP instance asked as AWS: not its service
        assert bringup.notice_source("gcp") == "gcp"
    finally:
        service.close()


def test_no_metadata_service_ends_the_watcher_with_one_line():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: on premises
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tasks" / "ray_bringup.py"),
            "notices",
            "--gcs",
            "127.0.0.1:1",
            "--node-ip",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **{k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"},
            "CLOUDRL_METADATA_URL": url,
            "DSTACK_NODE_RANK": "1",
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"[cloudrl rank 1] preemption notices: no Slurm job and no cloud metadata service answers at {url}: not "
        "watched on this node"
    )


def _squeue(tmp_path, monkeypatch, prints: str | None) -> None:
    """A stand-in for Slurm's `squeue` on PATH that prints `prints` (None: no squeue at all), for job 4242."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if prints is not None:
        script = bin_dir / "squeue"
        script.write_text(f'#!/bin/sh\n[ "$*" = "-h -j 4242 -o %e" ] || exit 1\necho "{prints}"\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin/nonexistent")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")


def _local(seconds_from_now: float) -> str:
    """A time as squeue prints it: local time, to the second, no zone."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + seconds_from_now))


def test_a_slurm_job_is_noticed_its_lead_before_its_time_limit(bringup, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOUDRL_SLURM_NOTICE_S", "300")
    _squeue(tmp_path, monkeypatch, _local(3600))
    assert bringup.notice_source("auto") == "slurm"  # Slurm is asked first
    assert bringup.slurm_notice() is None  # an hour left
    _squeue(tmp_path, monkeypatch, "N/A")
    assert bringup.slurm_notice() is None  # no time limit
    end = _local(200)
    _squeue(tmp_path, monkeypatch, end)
    notice = bringup.slurm_notice()
    assert isinstance(notice, bringup.Notice) and notice.text == f"Slurm job 4242 reaches its time limit at {end}"
    assert abs(notice.deadline - (time.time() + 200)) < 3


def test_without_squeue_slurm_is_not_what_is_watched(bringup, tmp_path, monkeypatch):
    _squeue(tmp_path, monkeypatch, None)  # inside a container without Slurm's client tools
    assert bringup.slurm_notice() == bringup.NO_ANSWER
    monkeypatch.delenv("SLURM_JOB_ID")
    assert bringup.slurm_notice() == bringup.NO_ANSWER

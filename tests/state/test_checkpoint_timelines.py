"""A run never continues another run, and checkpoints of one timeline are never deleted by another: run
ids in the manifests, pruning by run id, a resume from an older step that keeps the newer ones, an
ambiguous resume=auto that refuses, and resume=auto refusing another preset's or a finished run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cloudrl.trainer.config import PRESET_DIR, available_presets, load_config
from cloudrl.trainer.errors import CheckpointError
from cloudrl.trainer.state import checkpoint, layout, resume_checks, timeline
from cloudrl.trainer.state.run_dir import resume_point
from runs import REPO


def _save(run_dir: Path, step: int, keep_last: int = 2, tag: str = "", config: str = "") -> Path:
    return checkpoint.save(
        str(run_dir),
        step,
        {"actor": {"w": torch.full((2,), float(step))}},
        {"step": step, "tag": tag},
        config,
        keep_last,
    )


def _names(run_dir: Path) -> list[str]:
    return [p.name for p in layout.list_checkpoints(str(run_dir))]


def _new_process(run_dir: Path) -> None:
    """What a resubmitted job sees: no timeline in memory, only what run_dir holds."""
    timeline.forget(str(run_dir))


def test_resuming_from_an_older_step_keeps_the_newer_ones_and_follows_the_new_timeline(tmp_path):
    run_dir = tmp_path / "run"
    for step in (10, 20, 30):
        _save(run_dir, step, keep_last=3, tag="old")
    first_run = layout.read_manifest(run_dir / "checkpoints" / "step_000010")["run_id"]

    _new_process(run_dir)  # the user goes back to step 10: trainer.resume=<run_dir>/checkpoints/step_000010
    older = resume_point(str(run_dir), str(run_dir / "checkpoints" / "step_000010"))
    branch = timeline.begin_timeline(str(run_dir), older, continuing=False)
    assert branch.run_id != first_run and branch.parent == {"run_id": first_run, "step": 10}
    assert timeline.latest(str(run_dir)) == older  # a restart before the first save goes back to step 10

    saved = _save(run_dir, 15, keep_last=2, tag="new")
    assert saved.exists()  # not pruned the moment it was written
    assert _names(run_dir) == ["step_000010", "step_000015", "step_000020", "step_000030"]
    _save(run_dir, 20, keep_last=2, tag="new")  # the old timeline's step 20 is in the way: kept aside
    aside = run_dir / "checkpoints" / f"timeline-{first_run}" / "step_000020"
    assert checkpoint.load(aside, ["actor"]).state["tag"] == "old"
    _save(run_dir, 25, keep_last=2, tag="new")
    assert _names(run_dir) == ["step_000010", "step_000020", "step_000025", "step_000030"]  # only 15 pruned
    assert checkpoint.load(run_dir / "checkpoints" / "step_000030", ["actor"]).state["tag"] == "old"

    for forget_record in (False, True):  # restarts and resume=auto follow the new timeline, not step 30
        _new_process(run_dir)
        if forget_record:
            (run_dir / "timeline.json").unlink()  # even without it: the branch saved last is the live one
        assert timeline.latest(str(run_dir)) == run_dir / "checkpoints" / "step_000025"


def test_resume_auto_continues_its_run_id_and_prunes_only_its_own(tmp_path):
    run_dir = tmp_path / "run"
    _save(run_dir, 1)
    run_id = json.loads((run_dir / "timeline.json").read_text())["run_id"]
    _new_process(run_dir)
    found = resume_point(str(run_dir), "auto")
    assert timeline.begin_timeline(str(run_dir), found, continuing=True).run_id == run_id
    for step in (2, 3):
        _save(run_dir, step)
    assert _names(run_dir) == ["step_000002", "step_000003"]


def test_two_unrelated_runs_in_one_run_dir_make_resume_auto_refuse_and_name_the_choice(tmp_path):
    run_dir = tmp_path / "run"
    _save(run_dir, 5)
    other = tmp_path / "other"
    _save(other, 7)
    (run_dir / "checkpoints" / "step_000007").mkdir()
    for f in (other / "checkpoints" / "step_000007").iterdir():
        (run_dir / "checkpoints" / "step_000007" / f.name).write_bytes(f.read_bytes())
    (run_dir / "timeline.json").unlink()
    _new_process(run_dir)
    with pytest.raises(CheckpointError) as err:
        resume_point(str(run_dir), "auto")
    message = str(err.value)
    assert "holds checkpoints of 2 different runs" in message and "\n" not in message
    assert (
        f"trainer.resume={run_dir}/checkpoints/step_000005 or trainer.resume={run_dir}/checkpoints/step_000007"
        in message
    )
    # A run_dir that knows its run (timeline.json) is not ambiguous, and never prunes the stranger.
    _new_process(run_dir)
    timeline.begin_timeline(str(run_dir), run_dir / "checkpoints" / "step_000005", continuing=True)
    for step in (6, 8, 9):
        _save(run_dir, step, keep_last=1)
    assert _names(run_dir) == ["step_000007", "step_000009"]


def test_resume_auto_refuses_a_checkpoint_of_another_preset(tmp_path):
    local = load_config("local", [f"trainer.run_dir={tmp_path}"])
    path = _save(tmp_path, 3, config=local.to_yaml())
    mine = load_config(str(REPO / "examples" / "my-job" / "my-job.yaml"), [f"trainer.run_dir={tmp_path}"])
    with pytest.raises(CheckpointError) as err:
        resume_checks.check_same_run(checkpoint.load(path, ["actor"]), mine)
    assert str(err.value) == (
        f"trainer.resume=auto found {path}, saved by a run with data.train_files='builtin:arithmetic', but this run "
        f"sets data.train_files='train.jsonl': resume=auto continues only the same run: give this run a "
        f"trainer.run_dir (and trainer.checkpoint_uri) of its own, or continue that checkpoint on purpose with "
        f"trainer.resume={path}"
    )
    resume_checks.check_same_run(checkpoint.load(path, ["actor"]), load_config("local", ["actor.lr=1e-5"]))


def test_a_finished_run_is_not_resumed_into_nothing(tmp_path):
    """The resume point is refused before record_start rewrites the run's config.yaml."""
    from cloudrl.trainer.state.resume import decide_resume

    overrides = [f"trainer.run_dir={tmp_path}", "algorithm.name=grpo", "model.sft_warmup_steps=0"]
    cfg = load_config("local", [*overrides, "trainer.total_steps=4"])
    path = checkpoint.save(str(tmp_path), 4, {}, {"step": 4}, cfg.to_yaml(), keep_last=2)
    (tmp_path / "config.yaml").write_text("the finished run's config\n")
    with pytest.raises(CheckpointError) as err:
        decide_resume(cfg)
    assert str(err.value) == (
        f"checkpoint {path} is at step 4 and trainer.total_steps=4: that run is finished: raise "
        f"trainer.total_steps to train it further, or pick a new trainer.run_dir for a new run"
    )
    assert (tmp_path / "config.yaml").read_text() == "the finished run's config\n"


def test_every_preset_and_the_example_job_have_their_own_run_dir():
    run_dirs = {name: load_config(name).trainer.run_dir for name in available_presets()}
    run_dirs["examples/my-job"] = load_config(str(REPO / "examples" / "my-job" / "my-job.yaml")).trainer.run_dir
    assert len(set(run_dirs.values())) == len(run_dirs), run_dirs
    for name in available_presets():
        assert Path(run_dirs[name]).name == name, (name, run_dirs[name], PRESET_DIR)

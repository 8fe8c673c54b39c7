"""Where a run starts, decided from run_dir and the checkpoint's own files: no cluster, no model weights.

    place_run_dir(cfg)              # before the cluster: run_dir placed and checked, the checkpoint key set
    ckpt = decide_resume(cfg)       # the checkpoint to continue (None: a fresh start), read and checked
    begin_run(cfg, ckpt, model_path, critic_path)   # once the inputs are loaded: shapes, timeline, checkpoints/

The job decides the resume point before it joins Ray, except with trainer.checkpoint_uri (resume=auto) or a
resume URL: the checkpoint is then downloaded once the cluster is known to fit (storage.py
`fetch_checkpoint`) and the resume point decided after that download. A restart after a lost node continues
from the latest checkpoint through `open_resume`.
"""

from __future__ import annotations

from pathlib import Path

from . import checkpoint, layout, resume_checks, timeline
from .run_dir import check_run_dir, resume_point, under_runs_dir


def place_run_dir(cfg) -> None:
    """trainer.run_dir placed under $CLOUDRL_RUNS_DIR when relative; for a training run, not empty and
    checkpoints can be written there (nothing is created); trainer.checkpoint_key_env set and long enough,
    when named. Each refusal is one line."""
    cfg.trainer.run_dir = under_runs_dir(cfg.trainer.run_dir)
    if not cfg.trainer.eval_only:  # scoring a model writes only run_dir/eval.json
        check_run_dir(cfg.trainer.run_dir)
    checkpoint.signing_key(cfg.trainer.checkpoint_key_env)


def decide_resume(cfg) -> checkpoint.Checkpoint | None:
    """The checkpoint trainer.resume picks (auto: run_dir's latest; never: none), read as data and
    refused in one line when run_dir holds another run's files, when a file of it does not match its
    manifest, when another run (resume=auto) or another algorithm saved it, when it lacks the critic this
    run trains, or when a training run would have no step left to train. trainer.eval_only reads run_dir
    as it is and welcomes a finished run's checkpoint."""
    run_dir, resume = cfg.trainer.run_dir, cfg.trainer.resume
    timeline.forget(run_dir)  # this run's timeline is decided from run_dir alone
    found = timeline.resolve_resume(run_dir, resume) if cfg.trainer.eval_only else resume_point(run_dir, resume)
    ckpt = open_checkpoint(cfg, found) if found else None
    if ckpt is not None and not cfg.trainer.eval_only:
        resume_checks.check_unfinished(ckpt, cfg.trainer.total_steps)
    return ckpt


def begin_run(cfg, ckpt: checkpoint.Checkpoint | None, model_path: str, critic_path: str) -> None:
    """Once the models are known: the checkpoint's parameter shapes checked against them; for a training
    run, the timeline it saves under decided and run_dir/checkpoints created, the last thing before the
    roles start (the run's other files are written once they have: run_dir.record_start)."""
    if ckpt is not None:
        check_model_shapes(cfg, ckpt, model_path, critic_path)
    if cfg.trainer.eval_only:  # run_dir's timeline is left as it is when scoring a model
        return
    resume_from = ckpt.path if ckpt is not None else None
    timeline.begin_timeline(cfg.trainer.run_dir, resume_from, continuing=cfg.trainer.resume == "auto")
    layout.make_root(cfg.trainer.run_dir)


def open_checkpoint(cfg, path: Path) -> checkpoint.Checkpoint:
    """Read the checkpoint at `path` (checked against its manifest, read as data) and refuse it, in one
    line, when its files tell that it does not fit this run: resume=auto refuses one saved by another run
    (other models, data, reward or algorithm); any resume one of another algorithm or without the critic
    this run trains."""
    roles = ["actor", *(["critic"] if cfg.uses_critic else [])]
    ckpt = checkpoint.load(path, roles, checkpoint.signing_key(cfg.trainer.checkpoint_key_env))
    if cfg.trainer.resume == "auto":
        resume_checks.check_same_run(ckpt, cfg)
    resume_checks.check_algorithm(ckpt, cfg)
    return ckpt


def check_model_shapes(cfg, ckpt: checkpoint.Checkpoint, model_path: str, critic_path: str) -> None:
    """Refuse a checkpoint whose parameter shapes are not those of the models this run loads (built on
    the meta device from their configs: no weights read)."""
    roles = {"actor": model_path, **({"critic": critic_path} if cfg.uses_critic else {})}
    shapes = {role: resume_checks.expected_shapes(p, role, cfg.model.trust_remote_code) for role, p in roles.items()}
    resume_checks.check_shapes(ckpt, cfg, {role: s for role, s in shapes.items() if s is not None})


def open_resume(cfg, path: Path, model_path: str, critic_path: str) -> checkpoint.Checkpoint:
    """The checkpoint at `path`, read and checked as `open_checkpoint` and `check_model_shapes` do (a
    restart after a lost node continues from the latest one this way)."""
    ckpt = open_checkpoint(cfg, path)
    check_model_shapes(cfg, ckpt, model_path, critic_path)
    return ckpt

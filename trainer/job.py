"""The training job around the loop: check the inputs, plan the roles, join the cluster, load the inputs,
start the roles, run the loop, and always shut the roles down.

    summary = run_job(cfg, Trainer)   # driver.train(cfg) does this

First the checks that need no cluster and load nothing big (`check_inputs`: the reward function, the
model directories or a hub that answers, the prompt files), so a typo fails in well under a second,
before any Ray process exists. Then it plans what each role asks of the cluster (roles/placement.py),
joins the Ray cluster (or starts a local one) and checks that it can hold them, loads the inputs
(inputs/prepare.py: run directory, checkpoint, model, data, reward function), starts the roles and runs
`Trainer(cfg, roles, inputs, restarts, stop).fit()`; a lost worker or node restarts the roles from the
latest checkpoint (recovery.py), and a worker's expected failure ends the run with its own one line.
"""

from __future__ import annotations

import sys

from .config import Config
from .config_checks import gpu_dtype_warning
from .inputs.data import check_prompt_files
from .inputs.models import check_model_path
from .inputs.prepare import prepare
from .inputs.rewards import resolve_reward_fn
from .recovery import StopRequest, run_with_restarts, stop_grace_s
from .roles.cluster import connect, preflight
from .state.run_dir import record_start
from .state.storage import fetch_checkpoint
from .waiting import worker_errors


def run_job(cfg: Config, trainer_class) -> dict:
    """Run the whole training job with `trainer_class` (driver.Trainer) and return its summary."""
    from .roles.launch import launch_roles
    from .roles.placement import plan

    if cfg.rollout.engine == "vllm":  # needs no cluster: fails before one starts
        from .rollout.vllm_engine import check_vllm_available

        check_vllm_available()
    requests = plan(cfg)  # what each role asks of the cluster, decided here once
    warning = gpu_dtype_warning(cfg)  # a float32 run on GPUs: one line, the run goes on
    if warning:
        print(warning, file=sys.stderr, flush=True)
    check_inputs(cfg)  # no cluster yet: a missing file fails in well under a second
    started_ray = connect(cfg, requests)
    try:
        preflight(requests)  # a cluster too small fails in seconds, before anything heavy
        fetch_checkpoint(cfg)  # trainer.checkpoint_uri: its newest copy when newer than run_dir's (storage.py)
        inputs = prepare(cfg)
        # A worker's expected failure ends the run with its own line; SIGTERM/SIGINT stop it after a step.
        with worker_errors(), StopRequest(stop_grace_s(cfg)) as stop:

            def start_roles():
                return launch_roles(cfg, requests, inputs.model_path, inputs.critic_path)

            def run(roles, restarts: int) -> dict:
                trainer = trainer_class(cfg, roles, inputs, restarts, stop)
                if cfg.trainer.eval_only:  # scores a model: run_dir's config and timeline stay as they are
                    return trainer.evaluate()
                record_start(cfg, roles)
                return trainer.fit()

            return run_with_restarts(cfg, requests, inputs, start_roles, run)
    finally:
        if started_ray:
            import ray

            ray.shutdown()


def check_inputs(cfg: Config) -> None:
    """The input checks that need no cluster and load nothing big, each one line naming the key and the
    fix: the reward function (its file imported), every model setting (a directory that exists, or a hub
    id the hub can serve), every prompt file and local dataset (and the hub for hub datasets)."""
    resolve_reward_fn(cfg.reward.function)
    if cfg.rollout.environment:
        from .rollout.environment import load_environment

        load_environment(cfg.rollout.environment)
    check_model_path("model.path", cfg.model.path)
    for key, path in (("critic.model_path", cfg.critic.model_path), ("reward.model_path", cfg.reward.model_path)):
        if path:
            check_model_path(key, path)
    if not cfg.trainer.eval_only:  # scoring a model reads no training prompts
        check_prompt_files(cfg.data.train_files, "data.train_files")
    check_prompt_files(cfg.data.val_files, "data.val_files")
    for name, files in cfg.data.val_sets.items():
        check_prompt_files(files, f"data.val_sets.{name}")

"""The training job around the loop, in one straight sequence: check the inputs, decide the resume point,
join the cluster, load the inputs, start the roles, run the loop, and always shut the roles down.

    summary = run_job(cfg, Trainer)   # driver.train(cfg) does this

First what needs no cluster and loads nothing big, so a typo fails in well under a second, before any Ray
process exists: what each role asks of the cluster (roles/placement.py), the inputs (inputs/checks.py:
the reward function and the environment, their files imported; the model directories or a hub that
answers; the prompt files and their prompt column), then run_dir and the resume point (state/resume.py:
a run_dir that is not empty and takes checkpoints, another run's files in it, the checkpoint to continue
checked against its manifest, its run and algorithm). Then it joins the Ray cluster (or starts a local
one) and checks that it can hold the roles, loads the inputs (inputs/prepare.py: the model's tokenizer,
the prompts, the reward function), checks the checkpoint's shapes against the model and decides the
timeline the run saves under, starts the roles and runs `Trainer(cfg, roles, inputs, restarts, stop).fit()`;
a lost worker or node restarts the roles from the latest checkpoint (recovery.py), and a worker's
expected failure ends the run with its own one line. With trainer.checkpoint_uri (resume=auto) or a
resume URL, the checkpoint is downloaded once the cluster is known to fit, and the resume point is
decided after that download.
"""

from __future__ import annotations

import sys

from .config import Config
from .config_checks import start_warnings
from .hangs import WATCH
from .inputs.checks import check_inputs
from .inputs.prepare import prepare
from .recovery import StopRequest, run_with_restarts, stop_grace_s
from .roles.cluster import connect, preflight
from .roles.launch import launch_roles
from .roles.placement import plan
from .rollout.vllm_engine import check_vllm_available
from .state.resume import begin_run, decide_resume, place_run_dir
from .state.run_dir import record_start
from .state.storage import downloads_checkpoint, fetch_checkpoint
from .waiting import worker_errors


def run_job(cfg: Config, trainer_class) -> dict:
    """Run the whole training job with `trainer_class` (driver.Trainer) and return its summary."""
    if cfg.rollout.engine == "vllm":  # needs no cluster: fails before one starts
        check_vllm_available()
    requests = plan(cfg)  # what each role asks of the cluster, decided here once
    check_inputs(cfg)  # no cluster yet: a missing file fails in well under a second
    place_run_dir(cfg)  # a bad run_dir too
    downloading = downloads_checkpoint(cfg)  # the resume point is then decided after the download
    resume = None if downloading else decide_resume(cfg)  # run_dir's own checkpoint, checked
    for warning in start_warnings(cfg):  # e.g. float32 on GPUs: one line each, the run goes on
        print(warning, file=sys.stderr, flush=True)
    started_ray = connect(cfg, requests)
    try:
        preflight(requests)  # a cluster too small fails in seconds, before anything heavy
        inputs = prepare(cfg)  # the model's tokenizer, the prompts, the reward function
        fetch_checkpoint(cfg)  # trainer.checkpoint_uri: its newest copy when newer than run_dir's (storage.py)
        if downloading:
            resume = decide_resume(cfg)
        begin_run(cfg, resume, inputs.model_path, inputs.critic_path)  # its shapes, the timeline, checkpoints/
        inputs.resume = resume
        # A worker's expected failure ends the run with its own line; SIGTERM/SIGINT stop it after a step.
        with worker_errors(), StopRequest(stop_grace_s(cfg)) as stop:

            def start_roles():
                return launch_roles(cfg, requests, inputs.model_path, inputs.critic_path, inputs.reward_model_path)

            def run(roles, restarts: int) -> dict:
                # Each attempt bounds the loop's waits on the workers and names where a stuck one is (hangs.py).
                with WATCH.watching(cfg.trainer.run_dir, cfg.trainer.hang_timeout_s):
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

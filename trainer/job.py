"""The training job around the loop: plan the roles, join the cluster, check and load the inputs, start
the roles, run the loop, and always shut the roles down.

    summary = run_job(cfg, Trainer)   # driver.train(cfg) does this

It plans what each role asks of the cluster (roles/placement.py), joins the Ray cluster (or starts a
local one) and checks that it can hold them, then runs the checks and loads that need no cluster
(inputs/prepare.py: run directory, checkpoint, model, data, reward function), starts the roles and runs
`Trainer(cfg, roles, inputs, restarts, stop).fit()`; a lost worker or node restarts the roles from the
latest checkpoint (recovery.py), and a worker's expected failure ends the run with its own one line.
"""

from __future__ import annotations

from .config import Config
from .inputs.prepare import prepare
from .recovery import StopRequest, run_with_restarts
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
    started_ray = connect(cfg, requests)
    try:
        preflight(requests)  # a cluster too small fails in seconds, before anything heavy
        fetch_checkpoint(cfg)  # trainer.checkpoint_uri: its newest copy when newer than run_dir's (storage.py)
        inputs = prepare(cfg)
        print("cloudrl trainer, resolved config:\n" + cfg.to_yaml(), flush=True)
        with worker_errors(), StopRequest() as stop:  # a worker's expected failure ends the run with its own line

            def start_roles():
                return launch_roles(cfg, requests, inputs.model_path, inputs.critic_path)

            def run(roles, restarts: int) -> dict:
                record_start(cfg, roles)
                return trainer_class(cfg, roles, inputs, restarts, stop).fit()

            return run_with_restarts(cfg, requests, inputs, start_roles, run)
    finally:
        if started_ray:
            import ray

            ray.shutdown()

"""`cloudrl plan`: the memory plan of a run per GPU of each role and engine, before any GPU is rented.

The config is loaded as `cloudrl submit` loads it (the same preset and overrides, the same checks); the
model's shape comes from its config.json alone (trainer/memory_plan.py holds every formula). Prints
the table, then refuses a layout that cannot fit `--gpu-memory-gib` in one line naming the keys that would.
With `--offers FILE`, lists the dstack offers the config fits on instead (offers.py).
"""

from __future__ import annotations

from collections.abc import Callable


def uses_gpus(cfg) -> bool:
    """Some role or engine of the run computes on GPUs (the memory plan applies)."""
    roles = [cfg.actor, cfg.critic, cfg.reference, cfg.reward]
    return any(r.gpus_per_node > 0 for r in roles) or cfg.rollout.gpus_per_engine > 0


def planner(cfg, gpu_memory_gib: float) -> Callable:
    """`plan_of(config)`: the memory plan of a config with the shapes of cfg's models (policy, critic.model_path,
    reward.model_path), read once from their config.json files (ModelLoadError where one cannot be read)."""
    from cloudrl.trainer.memory_plan import plan_memory, read_shape

    trust = cfg.model.trust_remote_code
    shape = read_shape(cfg.model.path, "model.path", trust)
    critic = read_shape(cfg.critic.model_path, "critic.model_path", trust) if cfg.critic.model_path else None
    reward = read_shape(cfg.reward.model_path, "reward.model_path", trust) if cfg.reward.model_path else None

    def plan_of(c):
        return plan_memory(c, shape, gpu_memory_gib, critic, reward)

    return plan_of


def check_memory(cfg, gpu_memory_gib: float) -> str | None:
    """`cloudrl submit`'s memory check, before any node is contacted: for a run on GPUs, the plan of every
    role's GPU against `gpu_memory_gib`; DoesNotFit (one line naming the role, its need and the keys that
    would make it fit) where one cannot hold it. A note instead when the model's config.json cannot be read
    here (no local copy, no HF cache, no hub): the cluster, which can, then decides. None otherwise."""
    from cloudrl.trainer.errors import ModelLoadError
    from cloudrl.trainer.memory_plan import check_fits

    if not uses_gpus(cfg):
        return None
    try:
        plan_of = planner(cfg, gpu_memory_gib)
    except ModelLoadError as exc:
        return f"note: memory plan skipped: {exc}"
    check_fits(cfg, plan_of, gpu_memory_gib)
    return None


def show_plan(preset: str, overrides: list[str], gpu_memory_gib: float, echo: Callable[[str], None]) -> None:
    """Print the plan with `echo`; raise DoesNotFit (one line, exit 1) when a role's GPUs cannot hold it."""
    from cloudrl.trainer.memory_plan import check_fits, plan_text

    from .errors import CloudrlError
    from .submit import load_config

    if gpu_memory_gib <= 0:
        raise CloudrlError(f"--gpu-memory-gib {gpu_memory_gib:g}: give the memory of one GPU in GiB, e.g. 80")
    cfg = load_config(preset, overrides)
    plan_of = planner(cfg, gpu_memory_gib)
    echo(plan_text(plan_of(cfg), gpu_memory_gib).rstrip("\n"))
    check_fits(cfg, plan_of, gpu_memory_gib)

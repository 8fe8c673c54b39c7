"""The checks every loaded config passes, in one place; each message names the key and the fix.

`config.load_config` and `config.config_from_dict` call `validate`; it imports nothing heavy.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import Config, RoleConfig

ALGORITHMS = ("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP_ALGORITHMS = ("grpo", "rloo", "reinforce_pp_baseline")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}{hint}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0; got {value}")


def validate(cfg: Config) -> None:
    a, r = cfg.algorithm, cfg.rollout
    _choice("algorithm.name", a.name, ALGORITHMS)
    _choice("algorithm.kl_mode", a.kl_mode, ("reward", "loss"))
    _choice("algorithm.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    _choice("rollout.engine", r.engine, ("hf", "vllm"))
    _choice("model.dtype", cfg.model.dtype, ("float32", "bfloat16", "float16"))
    _choice("placement.strategy", cfg.placement.strategy, ("pack", "spread"))
    for name in cfg.trainer.loggers:
        _choice("trainer.loggers", name, ("console", "jsonl", "tensorboard", "wandb"))
    for key in ("data.train_batch_size", "rollout.n", "rollout.max_new_tokens", "rollout.num_engines",
                "rollout.tensor_parallel_size", "actor.mini_batch_size", "actor.micro_batch_size",
                "actor.ppo_epochs", "trainer.total_steps", "trainer.keep_last", "data.max_prompt_length"):
        section, name = key.split(".")
        _positive(key, getattr(getattr(cfg, section), name))
    if a.name in GROUP_ALGORITHMS and r.n < 2:
        raise ConfigError(f"algorithm.name={a.name} compares samples of one prompt: set rollout.n>=2 (now {r.n})")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1]; got {r.gpu_memory_utilization}")
    if a.kl_target < 0 or a.kl_coef < 0:
        raise ConfigError("algorithm.kl_coef and algorithm.kl_target must be >= 0")
    if cfg.actor.dual_clip and cfg.actor.dual_clip <= 1:
        raise ConfigError(f"actor.dual_clip must be > 1 (or 0 to turn it off); got {cfg.actor.dual_clip}")
    _check_batches(cfg)
    for role in ("actor", "critic", "reference", "reward"):
        rc: RoleConfig = getattr(cfg, role)
        if rc.nodes < 1 or rc.gpus_per_node < 0 or rc.workers_per_node < 1 or rc.cpus_per_worker < 0:
            raise ConfigError(f"{role}.nodes and {role}.workers_per_node must be >= 1, "
                              f"{role}.gpus_per_node and {role}.cpus_per_worker >= 0")
    if r.engine == "hf" and r.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
    if cfg.placement.rollout_in_actor:
        _check_rollout_in_actor(cfg)
    if cfg.reward.in_driver and cfg.reward.model_path:
        raise ConfigError("reward.in_driver=true scores rule-based rewards only, but reward.model_path is set: "
                          "drop one of them (a reward model runs in reward workers)")


def _check_rollout_in_actor(cfg: Config) -> None:
    r, a = cfg.rollout, cfg.actor
    if r.engine != "hf":
        raise ConfigError(f"placement.rollout_in_actor=true needs rollout.engine=hf (got {r.engine}): vLLM engines "
                          f"run in their own workers; to share the actor's GPUs use placement.colocate_all=true")
    if r.num_engines != 1 or r.gpus_per_engine:
        raise ConfigError("rollout.num_engines and rollout.gpus_per_engine do not apply with "
                          "placement.rollout_in_actor=true (every actor worker generates): remove them and size "
                          "the actor instead (actor.nodes, actor.gpus_per_node, actor.workers_per_node)")
    if r.sleep_between_rollouts:
        raise ConfigError("rollout.sleep_between_rollouts is for vLLM engines: remove it with "
                          "placement.rollout_in_actor=true (the policy's weights serve both)")
    if a.fsdp and (a.world_size > 1 or a.gpus_per_node > 0):
        raise ConfigError("placement.rollout_in_actor=true cannot generate with FSDP-sharded actor workers "
                          "(ranks would have to sample in lockstep): set actor.fsdp=false, or drop "
                          "placement.rollout_in_actor to use rollout workers")


def _check_batches(cfg: Config) -> None:
    rollout = cfg.rollout_batch_size
    for role in ("actor", "critic"):
        if role == "critic" and not cfg.uses_critic:
            continue
        rc = getattr(cfg, role)
        world = rc.world_size
        mini, micro = rc.mini_batch_size, rc.micro_batch_size
        if rollout % mini:
            raise ConfigError(
                f"{role}.mini_batch_size={mini} does not divide the {rollout} sequences of a step "
                f"(data.train_batch_size={cfg.data.train_batch_size} x rollout.n={cfg.rollout.n}): "
                f"set {role}.mini_batch_size to a divisor of {rollout}"
            )
        if mini % world:
            raise ConfigError(
                f"{role}.mini_batch_size={mini} does not split over {world} {role} workers: "
                f"use a multiple of {world}"
            )
        if (mini // world) % micro:
            raise ConfigError(
                f"{role}.micro_batch_size={micro} does not divide the {mini // world} sequences each "
                f"{role} worker gets per mini-batch ({role}.mini_batch_size={mini} / {world} workers): "
                f"set {role}.micro_batch_size to a divisor of {mini // world}"
            )
    if cfg.data.train_batch_size % cfg.rollout.num_engines:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} does not split over "
            f"rollout.num_engines={cfg.rollout.num_engines}: use a multiple of it"
        )

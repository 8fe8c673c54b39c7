"""The checks every config passes, in one place; each message names the key and the fix.

`coerce` checks one key as it is set (its type, and for a `Literal` key its allowed values);
`validate` checks the loaded config as a whole. `config.py` calls both; this module imports nothing
from it (the config arrives as an argument) and nothing heavy.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Literal

from .errors import ConfigError


def choice_error(key: str, value: Any, choices: tuple[str, ...]) -> ConfigError:
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}{hint}")


def unknown_key_error(key: str, valid: list[str], source: str) -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # a bare field name without its section
        close = [k for k in valid if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:1]
    hint = f"did you mean {close[0]}?" if close else "see `python -m cloudrl.trainer --help-config`"
    return ConfigError(f"unknown config key {key!r} ({source}): {hint}")


def choices(want: Any) -> tuple[str, ...]:
    """The values a `Literal` key (or a list of them) allows; () for any other type."""
    if typing.get_origin(want) is list:
        (want,) = typing.get_args(want)
    return typing.get_args(want) if typing.get_origin(want) is Literal else ()


def coerce(key: str, value: Any, want: Any) -> Any:
    """`value` (from YAML) as the type annotated on `key`, or a ConfigError naming the key."""
    origin = typing.get_origin(want)
    if origin is Literal:
        if value not in typing.get_args(want):
            raise choice_error(key, value, typing.get_args(want))
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, e.g. {key}=[a,b]; got {value!r}")
        (item_type,) = typing.get_args(want)
        return [coerce(key, v, item_type) for v in value]
    if origin is dict:
        if value in (None, ""):
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, e.g. {key}={{name: 1}}; got {value!r}")
        _, val_type = typing.get_args(want)
        return {str(k): coerce(f"{key}.{k}", v, val_type) for k, v in value.items()}
    if want is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false; got {value!r}")
    if want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer; got {value!r}")
        return value
    if want is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number; got {value!r}")
        return float(value)
    if want is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string; got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type for {key}: {want}")


def _positive(key: str, value: float) -> None:
    if not value > 0:  # NaN too
        raise ConfigError(f"{key} must be > 0; got {value}")


def validate(cfg: Any) -> None:
    """Rules across keys of a `config.Config` whose keys each passed `coerce`."""
    a, r = cfg.algorithm, cfg.rollout
    for key in ("data.train_batch_size", "rollout.n", "rollout.max_new_tokens", "rollout.num_engines",
                "rollout.tensor_parallel_size", "actor.mini_batch_size", "actor.micro_batch_size",
                "actor.ppo_epochs", "trainer.total_steps", "trainer.keep_last", "data.max_prompt_length",
                "trainer.worker_timeout_s", "placement.timeout_s"):
        section, name = key.split(".")
        _positive(key, getattr(getattr(cfg, section), name))
    if cfg.uses_groups and r.n < 2:
        raise ConfigError(f"algorithm.name={a.name} compares samples of one prompt: set rollout.n>=2 (now {r.n})")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1]; got {r.gpu_memory_utilization}")
    if a.kl_target < 0 or a.kl_coef < 0:
        raise ConfigError("algorithm.kl_coef and algorithm.kl_target must be >= 0")
    if cfg.actor.dual_clip and cfg.actor.dual_clip <= 1:
        raise ConfigError(f"actor.dual_clip must be > 1 (or 0 to turn it off); got {cfg.actor.dual_clip}")
    for role in ("actor", "critic", "reference", "reward"):
        rc = getattr(cfg, role)
        if rc.nodes < 1 or rc.gpus_per_node < 0 or rc.workers_per_node < 1 or rc.cpus_per_worker < 0:
            raise ConfigError(f"{role}.nodes and {role}.workers_per_node must be >= 1, "
                              f"{role}.gpus_per_node and {role}.cpus_per_worker >= 0")
    _check_batches(cfg)  # after the role counts: it divides by each role's world size
    if r.engine == "hf" and r.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
    if cfg.placement.rollout_in_actor:
        _check_rollout_in_actor(cfg)
    if cfg.reward.in_driver and cfg.reward.model_path:
        raise ConfigError("reward.in_driver=true scores rule-based rewards only, but reward.model_path is set: "
                          "drop one of them (a reward model runs in reward workers)")


def _check_rollout_in_actor(cfg: Any) -> None:
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


def _check_batches(cfg: Any) -> None:
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
            per_node = "gpus_per_node" if rc.gpus_per_node > 0 else "workers_per_node"
            raise ConfigError(
                f"{role}.mini_batch_size={mini} does not split over the {world} {role} workers "
                f"({role}.nodes={rc.nodes} x {role}.{per_node}={getattr(rc, per_node)}): "
                f"set {role}.mini_batch_size to a multiple of {world}"
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

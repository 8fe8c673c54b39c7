"""The checks every config passes, in one place; each message names the key and the fix.

`coerce` checks one key as it is set (its type, and for a `Literal` key its allowed values);
`validate` checks the loaded config as a whole: first every numeric key against its range in `RANGES`
(one entry per numeric key; a test fails when a key has none), then the rules across keys. `config.py`
calls both; this module imports nothing from it (the config arrives as an argument) and nothing heavy.
"""

from __future__ import annotations

import difflib
import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError
from .urls import token_problem


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
        try:
            return float(value)
        except OverflowError:  # an integer of hundreds of digits
            raise ConfigError(f"{key} must be a finite number; got an integer too large for a float") from None
    if want is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string; got {value!r}")
        return str(value)
    raise TypeError(f"unsupported config type for {key}: {want}")


# ----------------------------------------------------------------------------------------------
# Ranges of the numeric keys
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: finite, between `low` and `high` (open or closed ends), or `off`."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    """A value outside the range that turns the feature off (e.g. top_k=-1)."""
    hint: str = ""
    """The fix, where "set it in the range" is not the whole story."""

    def allows(self, value: float) -> bool:
        if value == self.off:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def describe(self) -> str:
        """E.g. `> 0`, `in (0, 1]`, `>= 1 (or -1 to turn it off)`; empty for any finite number."""
        if self.low > -math.inf and self.high < math.inf:
            text = (
                f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                f"{_number(self.high)}{')' if self.high_open else ']'}"
            )
        elif self.low > -math.inf:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        elif self.high < math.inf:
            text = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        else:
            text = ""
        return text + (f" (or {_number(self.off)} to turn it off)" if self.off is not None else "")

    def check(self, key: str, value: float) -> None:
        if self.allows(value):
            return
        want = self.describe() if math.isfinite(value) else f"a finite number {self.describe()}".strip()
        raise ConfigError(f"{key} must be {want}; got {value}" + (f": {self.hint}" if self.hint else ""))


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


COUNT = Range(1)  # sizes and counts (an integer key)
NON_NEGATIVE = Range(0)  # 0 = none or off
POSITIVE = Range(0, low_open=True)
FRACTION = Range(0, 1, low_open=True)
UNIT = Range(0, 1)

ROLES = ("actor", "critic", "reference", "reward")
TRAINED_ROLES = ("actor", "critic")
_ROLE_RANGES = {
    "nodes": COUNT,
    "gpus_per_node": NON_NEGATIVE,
    "workers_per_node": COUNT,
    "cpus_per_worker": NON_NEGATIVE,
    "resources": NON_NEGATIVE,
}
_TRAINED_RANGES = {
    "lr": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "warmup_steps": NON_NEGATIVE,
    "grad_clip": NON_NEGATIVE,
    "ppo_epochs": COUNT,
    "mini_batch_size": COUNT,
    "micro_batch_size": COUNT,
}

# Every numeric key of config.Config (a mapping of numbers, like `resources`, checks each value).
RANGES: dict[str, Range] = {
    "model.sft_warmup_steps": NON_NEGATIVE,
    "model.sft_warmup_lr": POSITIVE,
    "model.lora_rank": Range(0, hint="0 trains the full model, a rank such as 8 or 16 trains LoRA adapters"),
    "model.lora_alpha": POSITIVE,
    "data.max_prompt_length": COUNT,
    "data.train_batch_size": COUNT,
    "data.val_batch_size": COUNT,
    "data.arithmetic_max_operand": NON_NEGATIVE,
    "data.arithmetic_size": COUNT,
    "rollout.n": COUNT,
    "rollout.max_new_tokens": COUNT,
    "rollout.temperature": Range(
        0,
        low_open=True,
        hint="for near-greedy sampling use a small value such as 0.01 (validation already decodes greedily)",
    ),
    "rollout.top_p": FRACTION,
    "rollout.top_k": Range(1, off=-1),
    "rollout.num_engines": COUNT,
    "rollout.tensor_parallel_size": COUNT,
    "rollout.pipeline_parallel_size": COUNT,
    "rollout.nodes_per_engine": COUNT,
    "rollout.gpus_per_engine": NON_NEGATIVE,
    "rollout.cpus_per_engine": NON_NEGATIVE,
    "rollout.gpu_memory_utilization": FRACTION,
    "rollout.max_engines": Range(0, hint="with rollout.elastic, the most engines at once; 0 without it"),
    "rollout.max_staleness": Range(
        0, 4, hint="0 generates in turn with training, k keeps k batches in flight; samples k updates old weigh little"
    ),
    "rollout.partial_segment_tokens": Range(0, hint="0 is a quarter of rollout.max_new_tokens"),
    "trainer.gap_check_max_k3": Range(0, low_open=True, hint="0 would refuse even identical log-probs"),
    "rollout.logprob_correction_cap": Range(
        1, hint="it caps importance weights; below 1 it would shrink even on-policy tokens"
    ),
    "rollout.resources": NON_NEGATIVE,
    "rollout.max_turns": COUNT,
    "rollout.max_episode_tokens": COUNT,
    "rollout.max_obs_tokens": COUNT,
    "rollout.episode_timeout_s": POSITIVE,
    "rollout.weight_push_bucket_mb": POSITIVE,
    "search.topk": Range(1, 100),
    "search.timeout_s": POSITIVE,
    "search.retries": NON_NEGATIVE,
    "algorithm.gamma": UNIT,
    "algorithm.lam": UNIT,
    "algorithm.kl_coef": NON_NEGATIVE,
    "algorithm.kl_target": NON_NEGATIVE,
    "algorithm.kl_horizon": COUNT,
    "algorithm.overlong_buffer": Range(0, hint="0 turns the overlong penalty off"),
    "algorithm.overlong_penalty": NON_NEGATIVE,
    "algorithm.max_sampling_rounds": COUNT,
    **{f"{role}.{name}": rule for role in ROLES for name, rule in _ROLE_RANGES.items()},
    **{f"{role}.{name}": rule for role in TRAINED_ROLES for name, rule in _TRAINED_RANGES.items()},
    "actor.clip_low": Range(
        0,
        1,
        low_open=True,
        hint="the ratio is clipped to [1 - clip_low, 1 + clip_high]; 1 bounds it from above only (CISPO's choice)",
    ),
    "actor.clip_high": POSITIVE,
    "actor.dual_clip": Range(1, low_open=True, off=0),
    "actor.entropy_coef": NON_NEGATIVE,
    "critic.clip_value": NON_NEGATIVE,
    "reference.micro_batch_size": COUNT,
    "actor.max_tokens_per_micro_batch": NON_NEGATIVE,
    "critic.max_tokens_per_micro_batch": NON_NEGATIVE,
    "reference.max_tokens_per_micro_batch": NON_NEGATIVE,
    "reward.model_weight": Range(),
    "reward.micro_batch_size": COUNT,
    "reward.timeout_s": NON_NEGATIVE,
    "reward.url_weight": Range(),
    "reward.url_timeout_s": POSITIVE,
    "reward.url_retries": NON_NEGATIVE,
    "reward.url_max_concurrency": COUNT,
    "reward.url_batch_size": COUNT,
    "placement.timeout_s": POSITIVE,
    "trainer.total_steps": COUNT,
    "trainer.seed": Range(0, 2**32 - 1),  # vLLM seeds numpy with it, which takes 0..2**32-1
    "trainer.save_every": NON_NEGATIVE,
    "trainer.keep_last": COUNT,
    "trainer.val_every": NON_NEGATIVE,
    "trainer.sample_every": NON_NEGATIVE,
    "trainer.val_n": COUNT,
    "trainer.val_temperature": POSITIVE,
    "trainer.worker_timeout_s": POSITIVE,
    "trainer.hang_timeout_s": NON_NEGATIVE,  # 0 = no watchdog
    "trainer.max_restarts": NON_NEGATIVE,
    "trainer.restart_wait_s": NON_NEGATIVE,
    "trainer.peak_tflops": NON_NEGATIVE,  # 0 = from the GPU's name
}


def check_ranges(cfg: Any) -> None:
    for key, rule in RANGES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        for item_key, item in value.items() if isinstance(value, dict) else [(None, value)]:
            rule.check(key if item_key is None else f"{key}.{item_key}", item)


# ----------------------------------------------------------------------------------------------
# Rules across keys
# ----------------------------------------------------------------------------------------------


KEYS_SET = "_keys_set"
"""The attribute of a loaded config holding the keys its preset or an override set (presets.set_key
records them; not a field, so never saved or compared)."""


def explicitly_set(cfg: Any, key: str) -> bool:
    """`key` was set by the preset or an override, not left to its default or a dependent default."""
    return key in vars(cfg).get(KEYS_SET, ())


def validate(cfg: Any) -> None:
    """Every numeric key in its range, then the rules across keys of a `config.Config` whose keys each
    passed `coerce`."""
    check_ranges(cfg)  # first: the rules below divide by counts and batch sizes
    a, r = cfg.algorithm, cfg.rollout
    if cfg.uses_groups and r.n < 2:
        raise ConfigError(f"algorithm.name={a.name} compares samples of one prompt: set rollout.n>=2 (now {r.n})")
    if a.kl_target > 0 and a.kl_coef == 0:
        raise ConfigError(
            f"algorithm.kl_target={a.kl_target} adapts algorithm.kl_coef, which is 0 (and stays 0: "
            f"the controller multiplies it): set algorithm.kl_coef > 0 as its start value, "
            f"or algorithm.kl_target=0"
        )
    _check_batches(cfg)
    if r.engine == "hf" and r.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size > 1 needs rollout.engine=vllm")
    _check_engine_layout(cfg)
    if cfg.placement.rollout_in_actor:
        _check_rollout_in_actor(cfg)
    if r.max_staleness:
        _check_max_staleness(cfg)
    if r.partial:
        _check_partial(cfg)
    if r.elastic or r.max_engines:
        _check_elastic(cfg)
    if (
        cfg.placement.colocate_all
        and r.engine in ("vllm", "sglang")
        and not r.sleep_between_rollouts
        and explicitly_set(cfg, "rollout.sleep_between_rollouts")
    ):
        raise ConfigError(
            "rollout.sleep_between_rollouts=false cannot hold with placement.colocate_all=true: the engines share "
            "the trainers' GPUs and free their memory while the policy trains; drop the key (colocate_all turns "
            "it on) or set placement.colocate_all=false"
        )
    if a.dynamic_sampling:
        _check_dynamic_sampling(cfg)
    if cfg.search.enabled and cfg.placement.rollout_in_actor:
        raise ConfigError("search.enabled=true runs its turns in rollout workers: set placement.rollout_in_actor=false")
    if r.environment and cfg.search.enabled:
        raise ConfigError("rollout.environment and search.enabled are two multi-turn protocols: set one of them")
    if cfg.search.enabled and r.max_obs_tokens < SEARCH_OBS_TOKENS:
        raise ConfigError(
            f"rollout.max_obs_tokens={r.max_obs_tokens} leaves a search observation no room for its tags and "
            f"passages: set rollout.max_obs_tokens >= {SEARCH_OBS_TOKENS}"
        )
    if r.environment and cfg.placement.rollout_in_actor:
        raise ConfigError(
            "rollout.environment runs its episodes in rollout workers: set placement.rollout_in_actor=false"
        )
    if cfg.reward.in_driver and cfg.reward.model_path:
        raise ConfigError(
            "reward.in_driver=true scores rule-based rewards only, but reward.model_path is set: "
            "drop one of them (a reward model runs in reward workers)"
        )
    _check_objective(cfg)
    _check_attention(cfg)
    if cfg.reward.url:
        _check_reward_url(cfg)
    if cfg.model.lora_rank:
        _check_lora(cfg)
    if cfg.trainer.checkpoint_key_env and not cfg.trainer.checkpoint_key_env.isidentifier():
        raise ConfigError(
            "trainer.checkpoint_key_env must be the NAME of an environment variable holding the key (e.g. "
            "CKPT_KEY), not the key itself: export the key under a name and give the name"
        )


def _check_reward_url(cfg: Any) -> None:
    """The reward.url keys: an http(s) address, a variable's name (never a token, never an infrastructure
    secret's), a token only over https:// or to loopback (unless url_insecure_http), time left to retry
    (the numeric ranges are in RANGES)."""
    rw = cfg.reward
    if not rw.url.startswith(("http://", "https://")):
        raise ConfigError(
            f"reward.url={rw.url!r} is not an http:// or https:// address: e.g. http://127.0.0.1:8900/score"
        )
    if rw.url_token_env and not rw.url_token_env.isidentifier():
        raise ConfigError(
            "reward.url_token_env must be the NAME of an environment variable holding the token (e.g. RM_TOKEN), "
            "not the token itself: export the token under a name and give the name"
        )
    problem = token_problem(rw.url, rw.url_token_env, rw.url_insecure_http)
    if problem:
        raise ConfigError(problem)
    if 0 < rw.timeout_s <= rw.url_timeout_s:
        raise ConfigError(
            f"reward.url_timeout_s={rw.url_timeout_s:g} leaves no time to retry within reward.timeout_s="
            f"{rw.timeout_s:g}: lower reward.url_timeout_s or raise reward.timeout_s"
        )


def _check_engine_layout(cfg: Any) -> None:
    """Pipeline stages and engines that span nodes: vLLM and SGLang only, GPUs split evenly over the nodes,
    and never under placement.colocate_all (its CUDA IPC weight sync reaches only GPUs of one node)."""
    r = cfg.rollout
    if r.engine == "hf" and (r.pipeline_parallel_size != 1 or r.nodes_per_engine != 1):
        raise ConfigError(
            "rollout.pipeline_parallel_size and rollout.nodes_per_engine > 1 need rollout.engine=vllm or sglang: "
            "set them to 1 with rollout.engine=hf"
        )
    engine_on_gpus = r.ranks_per_engine > 1 or r.gpus_per_engine > 0 or cfg.actor.gpus_per_node > 0
    if r.engine == "sglang" and not engine_on_gpus:
        raise ConfigError(
            "rollout.engine=sglang runs on GPUs only, but the engines get none (rollout.tensor_parallel_size=1, "
            "rollout.gpus_per_engine=0, actor.gpus_per_node=0): give the roles GPUs, or use rollout.engine=vllm or hf"
        )
    if r.nodes_per_engine == 1:
        return
    if r.engine == "sglang":
        raise ConfigError(
            f"rollout.engine=sglang with rollout.nodes_per_engine={r.nodes_per_engine}: SGLang engines spanning "
            f"nodes are not supported yet (docs/engines.md): set rollout.nodes_per_engine=1, or use rollout.engine=vllm"
        )
    gpus = r.tensor_parallel_size * r.pipeline_parallel_size
    if gpus % r.nodes_per_engine:
        raise ConfigError(
            f"rollout.nodes_per_engine={r.nodes_per_engine} must divide the engine's rollout.tensor_parallel_size "
            f"x rollout.pipeline_parallel_size = {gpus} GPUs into equal shares per node: use a divisor of {gpus}"
        )
    if cfg.placement.colocate_all:
        raise ConfigError(
            f"rollout.nodes_per_engine={r.nodes_per_engine} spans nodes, but placement.colocate_all=true shares the "
            f"actor's GPUs with the engines and syncs weights by CUDA IPC, which reaches only GPUs of one node: "
            f"set rollout.nodes_per_engine=1 or placement.colocate_all=false"
        )


def _check_attention(cfg: Any) -> None:
    """model.attn_implementation against the hardware the roles get and the dtype they compute in. Whether the
    workers' flash-attn can run is checked on the workers (roles/packing.py); a worker without CUDA (logical GPUs,
    a rehearsal on CPU) runs sdpa instead."""
    m = cfg.model
    if not m.attn_implementation.startswith("flash_attention"):
        return
    p = cfg.placement
    roles = ["actor"]  # with placement.colocate_all the others share the actor's GPUs
    roles += ["critic"] if cfg.uses_critic and not p.colocate_all else []
    roles += ["reference"] if cfg.uses_reference and not (p.colocate_all or p.colocate_actor_ref) else []
    on_cpu = [role for role in roles if getattr(cfg, role).gpus_per_node == 0]
    if on_cpu:
        raise ConfigError(
            f"model.attn_implementation={m.attn_implementation} runs on GPUs only, but {on_cpu[0]}.gpus_per_node=0: "
            f"give the roles GPUs, or set model.attn_implementation=sdpa"
        )
    if m.dtype == "float32":
        raise ConfigError(
            f"model.attn_implementation={m.attn_implementation} computes in bfloat16 or float16: set "
            f"model.dtype=bfloat16, or model.attn_implementation=sdpa"
        )


def _check_lora(cfg: Any) -> None:
    """The LoRA keys' list; which layers they name is checked where the model is (inputs/lora.py)."""
    targets = cfg.model.lora_target_modules
    if not targets:
        raise ConfigError(
            "model.lora_target_modules is empty with model.lora_rank > 0: name the linear layers that get "
            "adapters, e.g. model.lora_target_modules=[q_proj,v_proj], or all-linear"
        )
    if "all-linear" in targets and len(targets) > 1:
        raise ConfigError(
            f"model.lora_target_modules={targets}: all-linear already names every linear layer; give it alone "
            f"or list layer names without it"
        )


def _check_objective(cfg: Any) -> None:
    """Combinations of the loss and advantage keys that cannot work as written."""
    a, actor = cfg.algorithm, cfg.actor
    if a.name == "grpo" and a.kl_mode == "reward" and a.grpo_norm_by_std and a.kl_coef > 0:
        raise ConfigError(
            "algorithm.kl_mode=reward with algorithm.name=grpo divides the KL penalty by each group's score std, "
            "so it becomes full-size noise where a group's answers all score alike: set algorithm.kl_mode=loss "
            "(GRPO's own), algorithm.grpo_norm_by_std=false or algorithm.kl_coef=0"
        )
    if actor.policy_loss != "ppo" and actor.dual_clip:
        raise ConfigError(
            f"actor.dual_clip is PPO's and does nothing with actor.policy_loss={actor.policy_loss}: "
            f"set actor.dual_clip=0, or actor.policy_loss=ppo"
        )
    if a.overlong_buffer > cfg.response_limit:
        raise ConfigError(
            f"algorithm.overlong_buffer={a.overlong_buffer} is longer than the response limit "
            f"{cfg.response_limit_key}={cfg.response_limit}: set it to at most that (0 = no overlong penalty)"
        )
    if a.overlong_buffer and not a.overlong_penalty:
        raise ConfigError(
            f"algorithm.overlong_buffer={a.overlong_buffer} with algorithm.overlong_penalty=0 penalises nothing: "
            f"set algorithm.overlong_penalty > 0 (e.g. 1), or algorithm.overlong_buffer=0"
        )


def _check_max_staleness(cfg: Any) -> None:
    """Rollouts generated while the policy trains need engines of their own that stay awake; batches
    generated more than one step ahead need their prompts known that early."""
    p = cfg.placement
    lag = f"rollout.max_staleness={cfg.rollout.max_staleness}"
    if p.rollout_in_actor or p.colocate_all:
        key = "placement.rollout_in_actor" if p.rollout_in_actor else "placement.colocate_all"
        raise ConfigError(
            f"{lag} generates while the actor trains, but {key}=true puts generation "
            f"on the actor's own {'workers' if p.rollout_in_actor else 'GPUs'}: set {key}=false, or "
            f"rollout.max_staleness=0"
        )
    if cfg.rollout.sleep_between_rollouts:
        raise ConfigError(
            f"{lag} keeps the engines generating while the actor trains: set "
            "rollout.sleep_between_rollouts=false, or rollout.max_staleness=0"
        )
    if cfg.rollout.max_staleness > 1 and cfg.algorithm.dynamic_sampling:
        raise ConfigError(
            f"{lag} starts batches {cfg.rollout.max_staleness} steps ahead, but algorithm.dynamic_sampling=true "
            "draws a step's extra prompts only once its scores are in: set rollout.max_staleness=1 (one batch "
            "ahead, started after the refill), or algorithm.dynamic_sampling=false"
        )


def _check_partial(cfg: Any) -> None:
    """Partial rollouts take weights pushed while a batch generates: there must be batches in flight, and a
    generation that can be cut into segments (one turn)."""
    r = cfg.rollout
    if not r.max_staleness:
        raise ConfigError(
            "rollout.partial=true takes new weights in the middle of batches generated ahead, but "
            "rollout.max_staleness=0 generates each batch after the weights it needs: set rollout.max_staleness >= 1, "
            "or rollout.partial=false"
        )
    if r.environment or cfg.search.enabled:
        what = "rollout.environment" if r.environment else "search.enabled=true"
        raise ConfigError(
            f"rollout.partial=true cuts single-turn generations into segments, but {what} generates "
            f"episodes of several turns: set rollout.partial=false"
        )


def _check_elastic(cfg: Any) -> None:
    """Engines added mid-run are whole engines on one node that load the weights from the object store, and
    stay awake beside trainers on GPUs of their own."""
    r, p = cfg.rollout, cfg.placement
    if not r.elastic:
        raise ConfigError(
            f"rollout.max_engines={r.max_engines} bounds the engines rollout.elastic adds, which is off: set "
            "rollout.elastic=true, or drop rollout.max_engines"
        )
    if r.max_engines <= r.num_engines:
        raise ConfigError(
            f"rollout.elastic=true adds engines up to rollout.max_engines={r.max_engines}, not above "
            f"rollout.num_engines={r.num_engines}: set rollout.max_engines to more than {r.num_engines}"
        )
    for key, on, fix in (
        ("placement.rollout_in_actor", p.rollout_in_actor, "the actor's own workers generate"),
        ("placement.colocate_all", p.colocate_all, "the engines share the trainers' GPUs"),
        ("rollout.sleep_between_rollouts", r.sleep_between_rollouts, "engines that sleep share the trainers' GPUs"),
    ):
        if on:
            raise ConfigError(f"rollout.elastic=true adds engines of their own, but {key}=true: {fix}; set one false")
    if r.nodes_per_engine > 1:
        raise ConfigError(
            f"rollout.elastic=true adds engines on one node each, but rollout.nodes_per_engine={r.nodes_per_engine}: "
            "set rollout.nodes_per_engine=1, or rollout.elastic=false"
        )


def _check_dynamic_sampling(cfg: Any) -> None:
    """Dropping groups whose samples all score the same needs groups: an estimator that compares them."""
    if not cfg.uses_groups:
        raise ConfigError(
            f"algorithm.dynamic_sampling=true keeps prompts whose samples score differently, which only "
            f"group algorithms learn from: set algorithm.name to one of grpo, rloo, reinforce_pp_baseline "
            f"(now {cfg.algorithm.name}), or algorithm.dynamic_sampling=false"
        )


def _check_rollout_in_actor(cfg: Any) -> None:
    r, a = cfg.rollout, cfg.actor
    if r.engine != "hf":
        raise ConfigError(
            f"placement.rollout_in_actor=true needs rollout.engine=hf (got {r.engine}): vLLM engines "
            f"run in their own workers; to share the actor's GPUs use placement.colocate_all=true"
        )
    if r.num_engines != 1 or r.gpus_per_engine:
        raise ConfigError(
            "rollout.num_engines and rollout.gpus_per_engine do not apply with "
            "placement.rollout_in_actor=true (every actor worker generates): remove them and size "
            "the actor instead (actor.nodes, actor.gpus_per_node, actor.workers_per_node)"
        )
    if r.sleep_between_rollouts:
        raise ConfigError(
            "rollout.sleep_between_rollouts is for vLLM engines: remove it with "
            "placement.rollout_in_actor=true (the policy's weights serve both)"
        )
    if a.fsdp and (a.world_size > 1 or a.gpus_per_node > 0):
        raise ConfigError(
            "placement.rollout_in_actor=true cannot generate with FSDP-sharded actor workers "
            "(ranks would have to sample in lockstep): set actor.fsdp=false, or drop "
            "placement.rollout_in_actor to use rollout workers"
        )


def gpu_dtype_warning(cfg: Any) -> str:
    """A line for the start of a run whose roles compute on GPUs in float32 (the default, right for CPU),
    else "". The master weights and the optimizer stay float32 with model.dtype=bfloat16; only the forward
    and backward passes and the engines' weights change, at half the memory traffic and on the tensor cores."""
    roles = [cfg.actor, cfg.reference, cfg.reward] + ([cfg.critic] if cfg.uses_critic else [])
    on_gpus = any(r.gpus_per_node > 0 for r in roles) or cfg.rollout.gpus_per_engine > 0
    if cfg.model.dtype != "float32" or not on_gpus:
        return ""
    return (
        "warning: model.dtype=float32 computes in full precision on GPUs (about half the speed and twice the "
        "activation memory): set model.dtype=bfloat16 (the master weights and optimizer stay float32)"
    )


def dense_packing_warning(cfg: Any) -> str:
    """A line for the start of a run that packs on GPUs under an attention kernel with a dense mask (sdpa,
    eager), else "". Measured on an H200 (bench/mfu.py: a 1.1B model, 64 sequences of up to 1.3k tokens),
    the update took 2.29 s packed in 4k-token micro-batches, 3.94 s in 16k ones, and 1.41 s padded in
    micro-batches of 8 sequences cut to their own width (roles/packing.micro_batches): the mask's
    (tokens)^2 attention costs more than the padding packing saves."""
    m = cfg.model
    if not m.pack_sequences or m.attn_implementation == "flash_attention_2":
        return ""
    roles = ["actor"] + (["critic"] if cfg.uses_critic else [])
    on_gpus = [name for name in roles if getattr(cfg, name).gpus_per_node > 0]
    if not on_gpus:
        return ""
    return (
        f"warning: model.pack_sequences=true under model.attn_implementation={m.attn_implementation} attends "
        f"through a dense (tokens)^2 mask ({', '.join(on_gpus)} on GPUs): measured 1.6x slower than padded "
        f"micro-batches at 4k tokens per micro-batch on an H200 (bench/mfu.py): set model.pack_sequences=false, "
        f"or install flash-attn on the GPU nodes and set model.attn_implementation=flash_attention_2"
    )


TINY_MODEL_LR = 1e-4
"""Below this actor.lr the built-in tiny models (0.5M parameters; the local preset trains at 2e-3) barely move
in a run of hundreds of steps."""


def tiny_model_lr_warning(cfg: Any) -> str:
    """A line for the start of a run that trains a built-in tiny model at a learning rate meant for billions of
    parameters (the code's default 1e-6: a preset file of one's own that starts from the defaults), else ""."""
    if not str(cfg.model.path).startswith("builtin:") or cfg.actor.lr >= TINY_MODEL_LR:
        return ""
    return (
        f"warning: actor.lr={cfg.actor.lr:g} barely moves the built-in model {cfg.model.path} (the local preset "
        f"trains it at 2e-3 after a format warm-up): start your preset file with `base: local`, or set actor.lr"
    )


SEARCH_OBS_TOKENS = 32
"""The fewest tokens of a search observation: its <information> tags and some text."""

GSPO_CLIP = 0.01
"""Above this clip range GSPO's sequence ratio (a geometric mean of token ratios) is almost never clipped."""


def gspo_clip_warning(cfg: Any) -> str:
    """A line for a GSPO run whose clip range was set wide (token-level PPO's 0.2 carried over), else ""."""
    a = cfg.actor
    if a.policy_loss != "gspo" or max(a.clip_low, a.clip_high) <= GSPO_CLIP:
        return ""
    return (
        f"warning: actor.policy_loss=gspo clips a sequence ratio, which rarely leaves 1 +- {GSPO_CLIP:g}; "
        f"actor.clip_low={a.clip_low:g} and actor.clip_high={a.clip_high:g} clip almost nothing: the paper uses "
        f"3e-4 and 4e-4 (the defaults with gspo when neither is set)"
    )


def start_warnings(cfg: Any) -> list[str]:
    """The lines a run prints before it starts and then goes on: settings that are valid but almost surely not
    what was meant."""
    lines = (gpu_dtype_warning(cfg), tiny_model_lr_warning(cfg), gspo_clip_warning(cfg), dense_packing_warning(cfg))
    return [line for line in lines if line]


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

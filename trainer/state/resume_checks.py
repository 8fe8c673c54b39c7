"""Whether a checkpoint fits this run, told from its files before any actor starts: the same run
(resume=auto), the same algorithm and the critic it trains, the models' parameter shapes, steps left to
train. Each refusal is one line naming the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import CheckpointError
from .layout import FRESH_START

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

# Settings that make a run another run: trainer.resume=auto refuses a checkpoint saved with other values.
SAME_RUN_KEYS = ("algorithm.name", "model.path", "critic.model_path", "data.train_files", "reward.function")


def check_same_run(ckpt: Checkpoint, cfg) -> None:
    """resume=auto continues only the same run: refuse a checkpoint saved with other models, data, reward
    or algorithm (another preset writing into the same run_dir or bucket)."""
    for key in SAME_RUN_KEYS:
        section, name = key.split(".")
        saved = ckpt.saved_config.get(section, {})
        if not isinstance(saved, dict) or name not in saved:
            continue
        now = getattr(getattr(cfg, section), name)
        if saved[name] != now:
            raise CheckpointError(
                f"trainer.resume=auto found {ckpt.path}, saved by a run with {key}={saved[name]!r}, but this run "
                f"sets {key}={now!r}: resume=auto continues only the same run: give this run a trainer.run_dir "
                f"(and trainer.checkpoint_uri) of its own, or continue that checkpoint on purpose with "
                f"trainer.resume={ckpt.path}"
            )


def check_matches(ckpt: Checkpoint, cfg, shapes: dict[str, dict[str, tuple]]) -> None:
    """Refuse a checkpoint of another algorithm or other models. `shapes[role]` is the parameter shapes
    of the model this run loads for that role (`expected_shapes`)."""
    check_algorithm(ckpt, cfg)
    check_shapes(ckpt, cfg, shapes)


def check_algorithm(ckpt: Checkpoint, cfg) -> None:
    """Refuse a checkpoint saved by another algorithm, or without the critic this run trains: told from
    its files alone, so the job checks it before it joins the cluster."""
    saved = ckpt.saved_config.get("algorithm")
    saved_alg = saved.get("name") if isinstance(saved, dict) else None
    alg = cfg.algorithm.name
    if saved_alg and saved_alg != alg:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was saved by an algorithm.name={saved_alg} run and this "
            f"run sets algorithm.name={alg}: resume it with algorithm.name={saved_alg}, or "
            f"{FRESH_START} (trainer.resume=never)"
        )
    if cfg.uses_critic and not ckpt.has("critic"):
        raise CheckpointError(
            f"checkpoint {ckpt.path} has no critic.pt (it was saved without a critic) but "
            f"algorithm.name={alg} trains one: resume it with a critic-less algorithm, or "
            f"{FRESH_START} (trainer.resume=never)"
        )


def check_shapes(ckpt: Checkpoint, cfg, shapes: dict[str, dict[str, tuple]]) -> None:
    """Refuse a checkpoint of other models: `shapes[role]` is the parameter shapes of the model this run
    loads for that role (`expected_shapes`, which needs the model's config)."""
    for role, expected in shapes.items():
        if role in ckpt.shapes:
            diff = shape_difference(ckpt.shapes[role], expected)
            if diff:
                source = (
                    f"critic.model_path={cfg.critic.model_path}"
                    if role == "critic" and cfg.critic.model_path
                    else f"model.path={cfg.model.path}"
                )
                where = ckpt.sharded.get(role, ckpt.path / f"{role}.pt")
                raise CheckpointError(
                    f"checkpoint {where} does not fit the {role} model of "
                    f"{source}: {diff} (another model size?): resume with the model it was "
                    f"trained from, or {FRESH_START} (trainer.resume=never)"
                )


def check_unfinished(ckpt: Checkpoint, total_steps: int) -> None:
    """A checkpoint at or past trainer.total_steps has nothing left to train: resuming it would only
    rewrite the run's config.yaml and summary."""
    step = ckpt.state.get("step", 0)
    if isinstance(step, int) and step >= total_steps:
        raise CheckpointError(
            f"checkpoint {ckpt.path} is at step {step} and trainer.total_steps={total_steps}: that run is "
            f"finished: raise trainer.total_steps to train it further, or {FRESH_START} for a new run"
        )


def shape_difference(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    """The first difference between two {parameter name: shape} maps, in words; None when they agree."""
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    differ = [k for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    if differ:
        k = differ[0]
        more = f" ({len(differ) - 1} more tensors differ)" if len(differ) > 1 else ""
        return f"{k} is {list(saved[k])} in the checkpoint and {list(expected[k])} in the model{more}"
    if missing or extra:
        first = f"the checkpoint lacks {missing[0]}" if missing else f"the model has no {extra[0]}"
        return f"{first} ({len(missing)} missing, {len(extra)} unexpected tensors)"
    return None


def expected_shapes(model_path: str, role: str, trust_remote_code: bool = False) -> dict[str, tuple] | None:
    """Parameter shapes of the model a role loads, built on the meta device (no weights read); None
    when its config cannot be read: the role's workers then report that, naming their node."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM
    extra = {"num_labels": 1} if role == "critic" else {}
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code, **extra)
        with torch.device("meta"):
            model = cls.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}

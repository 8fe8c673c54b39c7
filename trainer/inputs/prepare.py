"""Everything checked and loaded before the trainer joins Ray: the checks that need no cluster, each
failing in seconds with one line (the run directory, the checkpoint to resume, the reward function,
the model's tokenizer, the prompts). With trainer.eval_only, what scoring a model needs instead
(`eval_inputs`): its checkpoint or model.path, the tokenizer, the validation prompts, the reward.

    inputs = prepare(cfg)   # then launch the roles and Trainer(cfg, roles, inputs).fit() (job.py)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..errors import DataError
from ..state import checkpoint
from ..state.run_dir import resume_point, under_runs_dir
from .data import PromptRecord, load_prompts
from .models import load_tokenizer, quiet_transformers, resolve_path
from .rewards import resolve_reward, score_responses


@dataclass
class Inputs:
    """Everything checked and loaded before any Ray actor starts."""

    model_path: str
    critic_path: str
    tokenizer: object
    train: list[PromptRecord]
    val: list[PromptRecord]
    resume: checkpoint.Checkpoint | None
    """The checkpoint this run continues from, checked against the config (None: a fresh start)."""
    reward_fn: Callable
    """`reward.function`, resolved (the driver scores with it under `reward.in_driver`)."""
    val_sets: dict[str, list[PromptRecord]] = field(default_factory=dict)
    """data.val_sets' prompts, by name."""

    def score_here(self, reward) -> Callable[[list, list], list[float]]:
        """reward.in_driver's scoring: (responses' token ids, each one's prompt) -> rewards, decoded and
        scored in the driver's process with `reward` (the config's reward section)."""

        def score(responses: list[list[int]], records: list[PromptRecord]) -> list[float]:
            tokenizer = self.tokenizer
            return score_responses(self.reward_fn, tokenizer, responses, records, reward.function, reward.timeout_s)[1]

        return score


def prepare(cfg: Config) -> Inputs:
    """The checks that need no cluster; nothing is written to run_dir here (the run's files are
    written once its roles have started). A relative run_dir is placed under $CLOUDRL_RUNS_DIR."""
    inputs = eval_inputs(cfg) if cfg.trainer.eval_only else train_inputs(cfg)
    inputs.val_sets = {
        name: load_prompts(files, inputs.tokenizer, split="val", **_prompt_options(cfg))
        for name, files in cfg.data.val_sets.items()
    }
    return inputs


def _prompt_options(cfg: Config) -> dict:
    d = cfg.data
    return dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, data_cfg=d, seed=cfg.trainer.seed)


def _val_files(cfg: Config) -> str:
    """data.val_files, or the built-in task's held-out prompts when it trains on the built-in task."""
    d = cfg.data
    return d.val_files or ("builtin:arithmetic" if d.train_files == "builtin:arithmetic" else "")


def train_inputs(cfg: Config) -> Inputs:
    """A training run's inputs: the timeline it starts or continues, the model, the prompts."""
    quiet_transformers()
    cfg.trainer.run_dir = under_runs_dir(cfg.trainer.run_dir)
    checkpoint.forget(cfg.trainer.run_dir)  # this run's timeline is decided below, from run_dir alone
    resume_from = resume_point(cfg.trainer.run_dir, cfg.trainer.resume)
    checkpoint.check_writable(cfg.trainer.run_dir)
    reward_fn = resolve_reward(cfg.reward)
    model_path = resolve_path(cfg.model.path, cfg)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    critic_path = resolve_path(cfg.critic.model_path, cfg) if cfg.critic.model_path else model_path
    resume = open_resume(cfg, resume_from, model_path, critic_path) if resume_from else None
    if resume is not None:
        checkpoint.check_unfinished(resume, cfg.trainer.total_steps)
    checkpoint.begin_timeline(cfg.trainer.run_dir, resume_from, continuing=cfg.trainer.resume == "auto")
    train_records = load_prompts(cfg.data.train_files, tokenizer, split="train", **_prompt_options(cfg))
    val_files = _val_files(cfg)
    val_records = load_prompts(val_files, tokenizer, split="val", **_prompt_options(cfg)) if val_files else []
    return Inputs(model_path, critic_path, tokenizer, train_records, val_records, resume, reward_fn)


def eval_inputs(cfg: Config) -> Inputs:
    """trainer.eval_only: the model to score, its tokenizer, the validation prompts and the reward. The
    checkpoint is the one trainer.resume picks (auto: run_dir's latest; never: none), checked like a
    resumed one but finished runs welcome; without one, model.path as it is. No training prompts, and
    run_dir's timeline is left as it is."""
    quiet_transformers()
    cfg.trainer.run_dir = under_runs_dir(cfg.trainer.run_dir)
    reward_fn = resolve_reward(cfg.reward)
    model_path = resolve_path(cfg.model.path, cfg)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    critic_path = resolve_path(cfg.critic.model_path, cfg) if cfg.critic.model_path else model_path
    found = checkpoint.resolve_resume(cfg.trainer.run_dir, cfg.trainer.resume)
    resume = open_resume(cfg, found, model_path, critic_path) if found else None
    val_files = _val_files(cfg)
    val = load_prompts(val_files, tokenizer, split="val", **_prompt_options(cfg)) if val_files else []
    if not val and not cfg.data.val_sets:
        raise DataError(
            "trainer.eval_only=true has no validation prompts to score: set data.val_files or data.val_sets"
        )
    return Inputs(model_path, critic_path, tokenizer, [], val, resume, reward_fn)


def open_resume(cfg: Config, path: Path, model_path: str, critic_path: str) -> checkpoint.Checkpoint:
    """Read the checkpoint to resume (checked against its manifest, read as data) and refuse it, in one
    line, unless it fits this run's config; resume=auto also refuses one saved by another run (other
    models, data, reward or algorithm)."""
    roles = {"actor": model_path, **({"critic": critic_path} if cfg.uses_critic else {})}
    ckpt = checkpoint.load(path, list(roles))
    if cfg.trainer.resume == "auto":
        checkpoint.check_same_run(ckpt, cfg)
    shapes = {role: checkpoint.expected_shapes(p, role, cfg.model.trust_remote_code) for role, p in roles.items()}
    checkpoint.check_matches(ckpt, cfg, {role: s for role, s in shapes.items() if s is not None})
    return ckpt

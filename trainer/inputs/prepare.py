"""Everything the job loads before it starts the roles, in one sequence: the model, the prompts, the
reward function.

    inputs = prepare(cfg)   # after the checks (checks.py) and the resume point (state/resume.py)

The model settings are resolved (`builtin:tiny` materialised) and the tokenizer loaded; the training and
validation prompts read and tokenized; the reward function resolved (and, when the driver scores, run
once). With trainer.eval_only, what scoring a model needs instead: the tokenizer, the validation prompts,
the reward. Nothing is written to run_dir here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Config
from ..errors import DataError
from .data import PromptRecord, load_prompts
from .models import builtin_model_line, load_tokenizer, quiet_transformers, resolve_path
from .rewards import check_reward_runs, resolve_reward, score_responses

if TYPE_CHECKING:
    from ..state.checkpoint import Checkpoint


@dataclass
class Inputs:
    """Everything checked and loaded before any Ray actor starts."""

    model_path: str
    critic_path: str
    reward_model_path: str
    """reward.model_path resolved ("": no reward model)."""
    tokenizer: object
    train: list[PromptRecord]
    val: list[PromptRecord]
    reward_fn: Callable
    """`reward.function`, resolved (the driver scores with it under `reward.in_driver`)."""
    val_sets: dict[str, list[PromptRecord]] = field(default_factory=dict)
    """data.val_sets' prompts, by name."""
    resume: Checkpoint | None = None
    """The checkpoint this run continues from, checked against the config and the models (None: a fresh
    start): the job sets it from state/resume.py once the models are known, a restart from the latest."""

    def score_here(self, reward) -> Callable[[list, list], list[float]]:
        """reward.in_driver's scoring: (responses' token ids, each one's prompt) -> rewards, decoded and
        scored in the driver's process with `reward` (the config's reward section)."""

        def score(responses: list[list[int]], records: list[PromptRecord]) -> list[float]:
            tokenizer = self.tokenizer
            return score_responses(self.reward_fn, tokenizer, responses, records, reward.function, reward.timeout_s)[1]

        return score


def prepare(cfg: Config) -> Inputs:
    """The model settings resolved (`builtin:tiny` materialised, its start-up line printed) and the
    tokenizer loaded, the prompts read, the reward function resolved. With trainer.eval_only, no
    training prompts, and the validation prompts are required."""
    eval_only = cfg.trainer.eval_only
    quiet_transformers()
    model_path = resolve_path(cfg.model.path, cfg)
    if line := builtin_model_line(cfg):  # whether the built-in model learned a format before RL
        print(line, flush=True)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    critic_path = resolve_path(cfg.critic.model_path, cfg) if cfg.critic.model_path else model_path
    reward_model_path = resolve_path(cfg.reward.model_path, cfg) if cfg.reward.model_path else ""
    options = _prompt_options(cfg)
    train = [] if eval_only else load_prompts(cfg.data.train_files, tokenizer, split="train", **options)
    val_files = _val_files(cfg)
    val = load_prompts(val_files, tokenizer, split="val", **options) if val_files else []
    if eval_only and not val and not cfg.data.val_sets:
        raise DataError(
            "trainer.eval_only=true has no validation prompts to score: set data.val_files or data.val_sets"
        )
    val_sets = {
        name: load_prompts(files, tokenizer, split="val", **options) for name, files in cfg.data.val_sets.items()
    }
    reward_fn = resolve_reward(cfg.reward)
    if cfg.reward.in_driver:  # the driver scores: code_tests needs the sandbox here
        check_reward_runs(reward_fn)
    return Inputs(model_path, critic_path, reward_model_path, tokenizer, train, val, reward_fn, val_sets)


def _prompt_options(cfg: Config) -> dict:
    d = cfg.data
    return dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, data_cfg=d, seed=cfg.trainer.seed)


def _val_files(cfg: Config) -> str:
    """data.val_files, or the built-in task's held-out prompts when it trains on the built-in task."""
    d = cfg.data
    return d.val_files or ("builtin:arithmetic" if d.train_files == "builtin:arithmetic" else "")

"""The checks the job runs before anything else, with no cluster and nothing big loaded, so that a typo fails
in well under a second: the user's code the config names (imported as the job imports it), the model
directories or a hub that serves them, the prompt files and their prompt column. run_dir and the resume
point come next (state/resume.py). `cloudrl submit` runs `check_user_code` on the files it ships; torch is
not imported here."""

from __future__ import annotations

from ..config import Config
from .data import check_prompt_files
from .rewards import resolve_reward_fn
from .user_files import load_environment


def check_inputs(cfg: Config) -> None:
    """The input checks that need no cluster and load nothing big, each one line naming the key and the
    fix: the reward function and the environment (`check_user_code`), every model setting (a directory
    that exists, or a hub id the hub can serve), every prompt file and local dataset (and the hub for hub
    datasets; a file's prompt column)."""
    from .models import check_model_path  # models.py imports torch; `cloudrl submit` imports this module

    check_user_code(cfg)
    check_model_path("model.path", cfg.model.path)
    for key, path in (("critic.model_path", cfg.critic.model_path), ("reward.model_path", cfg.reward.model_path)):
        if path:
            check_model_path(key, path)
    if not cfg.trainer.eval_only:  # scoring a model reads no training prompts
        check_prompt_files(cfg.data.train_files, "data.train_files", cfg.data)
    check_prompt_files(cfg.data.val_files, "data.val_files", cfg.data)
    for name, files in cfg.data.val_sets.items():
        check_prompt_files(files, f"data.val_sets.{name}", cfg.data)


def check_user_code(cfg: Config) -> None:
    """The user's code the config names, imported as the job imports it: `reward.function` and
    `rollout.environment` (`cloudrl submit` runs this too, on the files it ships)."""
    resolve_reward_fn(cfg.reward.function)
    if cfg.rollout.environment:
        load_environment(cfg.rollout.environment)

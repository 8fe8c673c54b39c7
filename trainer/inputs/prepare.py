"""Everything the job reads before it starts the roles, in one sequence: the resume point, the model,
the prompts, the reward function.

    start = decide_resume(cfg)     # no cluster, no model: run_dir and the checkpoint to continue, checked
    inputs = prepare(cfg, start)   # then launch the roles and Trainer(cfg, roles, inputs).fit() (job.py)

`decide_resume` is the last of the checks the job runs before it joins Ray (checks.py has the
others): the checkpoint trainer.resume picks is read as data and checked against its manifest, the run
that saved it and the algorithm. `prepare` then loads the tokenizer (and checks the checkpoint's
parameter shapes against the model), the prompts and the reward. With trainer.eval_only, what scoring a
model needs instead: its checkpoint or model.path, the tokenizer, the validation prompts, the reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..errors import DataError
from ..state import checkpoint, layout, resume_checks, timeline
from ..state.run_dir import resume_point, under_runs_dir
from .data import PromptRecord, load_prompts
from .models import load_tokenizer, quiet_transformers, resolve_path
from .rewards import check_reward_runs, resolve_reward, score_responses


@dataclass(frozen=True)
class ResumePoint:
    """Where a run starts: the checkpoint it continues, read and checked against the config but for its
    parameter shapes (None: a fresh start; with trainer.eval_only, model.path as it is)."""

    checkpoint: checkpoint.Checkpoint | None


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


def decide_resume(cfg: Config) -> ResumePoint:
    """The resume point, with no cluster and no model: run_dir (a relative one placed under
    $CLOUDRL_RUNS_DIR) and the checkpoint trainer.resume picks (auto: run_dir's latest; never: none),
    refused in one line when run_dir holds another run's files, when a file of it does not match its
    manifest, when another run (resume=auto) or another algorithm saved it, when it lacks the critic this
    run trains, or when a training run would have no step left to train. trainer.eval_only reads run_dir
    as it is and welcomes a finished run's checkpoint."""
    cfg.trainer.run_dir = under_runs_dir(cfg.trainer.run_dir)
    run_dir, resume = cfg.trainer.run_dir, cfg.trainer.resume
    timeline.forget(run_dir)  # this run's timeline is decided from run_dir alone
    found = timeline.resolve_resume(run_dir, resume) if cfg.trainer.eval_only else resume_point(run_dir, resume)
    ckpt = open_checkpoint(cfg, found) if found else None
    if ckpt is not None and not cfg.trainer.eval_only:
        resume_checks.check_unfinished(ckpt, cfg.trainer.total_steps)
    return ResumePoint(ckpt)


def prepare(cfg: Config, start: ResumePoint | None = None) -> Inputs:
    """The resume point (`start`, which the job decides before it joins the cluster; None: decided here,
    as after a download from trainer.checkpoint_uri), the model's tokenizer (the checkpoint's shapes
    checked against the model), the prompts, the reward function. A training run's run_dir/checkpoints
    is created last, once all of that has passed; nothing else is written to run_dir here (the run's
    files are written once its roles have started), and eval_only writes nothing."""
    start = start or decide_resume(cfg)
    eval_only = cfg.trainer.eval_only
    quiet_transformers()
    model_path = resolve_path(cfg.model.path, cfg)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    critic_path = resolve_path(cfg.critic.model_path, cfg) if cfg.critic.model_path else model_path
    resume = start.checkpoint
    if resume is not None:
        check_model_shapes(cfg, resume, model_path, critic_path)
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
    if not eval_only:  # run_dir's timeline is left as it is when scoring a model
        resume_from = resume.path if resume is not None else None
        timeline.begin_timeline(cfg.trainer.run_dir, resume_from, continuing=cfg.trainer.resume == "auto")
        layout.make_root(cfg.trainer.run_dir)
    return Inputs(model_path, critic_path, tokenizer, train, val, resume, reward_fn, val_sets)


def _prompt_options(cfg: Config) -> dict:
    d = cfg.data
    return dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length, data_cfg=d, seed=cfg.trainer.seed)


def _val_files(cfg: Config) -> str:
    """data.val_files, or the built-in task's held-out prompts when it trains on the built-in task."""
    d = cfg.data
    return d.val_files or ("builtin:arithmetic" if d.train_files == "builtin:arithmetic" else "")


def open_checkpoint(cfg: Config, path: Path) -> checkpoint.Checkpoint:
    """Read the checkpoint at `path` (checked against its manifest, read as data) and refuse it, in one
    line, when its files tell that it does not fit this run: resume=auto refuses one saved by another run
    (other models, data, reward or algorithm); any resume one of another algorithm or without the critic
    this run trains."""
    roles = ["actor", *(["critic"] if cfg.uses_critic else [])]
    ckpt = checkpoint.load(path, roles, checkpoint.signing_key(cfg.trainer.checkpoint_key_env))
    if cfg.trainer.resume == "auto":
        resume_checks.check_same_run(ckpt, cfg)
    resume_checks.check_algorithm(ckpt, cfg)
    return ckpt


def check_model_shapes(cfg: Config, ckpt: checkpoint.Checkpoint, model_path: str, critic_path: str) -> None:
    """Refuse a checkpoint whose parameter shapes are not those of the models this run loads (built on
    the meta device from their configs: no weights read)."""
    roles = {"actor": model_path, **({"critic": critic_path} if cfg.uses_critic else {})}
    shapes = {role: resume_checks.expected_shapes(p, role, cfg.model.trust_remote_code) for role, p in roles.items()}
    resume_checks.check_shapes(ckpt, cfg, {role: s for role, s in shapes.items() if s is not None})


def open_resume(cfg: Config, path: Path, model_path: str, critic_path: str) -> checkpoint.Checkpoint:
    """The checkpoint at `path`, read and checked as `open_checkpoint` and `check_model_shapes` do (a
    restart after a lost node continues from the latest one this way)."""
    ckpt = open_checkpoint(cfg, path)
    check_model_shapes(cfg, ckpt, model_path, critic_path)
    return ckpt

"""A step's advantages from its samples, rewards, log-probs and values: the driver's part of the
math (pure torch, through ppo_math), kept apart from the loop that calls it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import ppo_math as pm
from .batch import Batch

if TYPE_CHECKING:  # algo/ imports torch and itself only; the config is read, never built, here
    from ..config import Config


def kl_controller(cfg: Config) -> pm.FixedKLController | pm.AdaptiveKLController:
    """The KL coefficient the step's advantages (kl_mode=reward) or loss (kl_mode=loss) use: adaptive
    toward algorithm.kl_target when one is set, else fixed at algorithm.kl_coef."""
    alg = cfg.algorithm
    if alg.kl_target > 0:
        return pm.AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon)
    return pm.FixedKLController(alg.kl_coef)


def compute_advantages(cfg: Config, batch: Batch, scores: torch.Tensor, kl_coef: float) -> dict:
    """Fill `batch` with the advantages (and returns, importance weights) of one step's samples;
    returns their metrics. With algorithm.overlong_buffer the scores the advantages see carry DAPO's
    overlong penalty (the logged rewards do not); with algorithm.mask_truncated the responses cut off
    at the length limit leave `loss_mask`, so neither the actor's losses nor the critic's count them."""
    alg = cfg.algorithm
    mask = batch["response_mask"]
    n = cfg.rollout.n
    gen = batch.get("loss_mask", mask)  # generated tokens (multi-turn: GAE spans observations, KL does not)
    metrics: dict[str, float] = {}
    if alg.overlong_buffer:
        penalty = pm.overlong_penalty(mask.sum(-1), cfg.response_limit, alg.overlong_buffer, alg.overlong_penalty)
        scores = scores + penalty.to(scores.dtype)
        metrics["rollout/overlong_penalty_mean"] = float(penalty.mean())
    kl = None
    if "ref_logprobs" in batch and "old_logprobs" in batch:
        kl = pm.kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], alg.kl_estimator) * gen
        metrics["actor/kl"] = float(pm.masked_mean(kl, gen))
        metrics["actor/kl_seq"] = float(kl.sum(-1).mean())
    in_reward = kl is not None and alg.kl_mode == "reward"
    if "old_logprobs" in batch:
        for name, value in pm.logprob_gap(batch["old_logprobs"], batch["engine_logprobs"], gen).items():
            metrics[f"rollout/{name}"] = float(value)
        if cfg.corrects_logprobs:  # the current policy over the sampling one (rollout.logprob_correction_mode)
            r = cfg.rollout
            weights, stats = pm.rollout_correction(
                batch["old_logprobs"],
                batch["engine_logprobs"],
                gen,
                r.logprob_correction_mode,
                r.logprob_correction_cap,
            )
            batch["is_weights"] = weights
            metrics["rollout/is_weight_mean"] = float(stats["is_weight_mean"])
            metrics["rollout/is_weight_capped"] = float(stats["is_weight_capped"])
    rewards = pm.token_level_rewards(scores, mask, kl if in_reward else None, kl_coef if in_reward else 0.0)
    seq_scores = scores - kl_coef * kl.sum(-1) if in_reward else scores
    if alg.name == "ppo":
        advantages, returns = pm.gae_advantages(rewards, batch["values"], mask, alg.gamma, alg.lam)
        metrics["critic/explained_var"] = pm.explained_variance(batch["values"], returns, mask)
        metrics["critic/values_mean"] = float(pm.masked_mean(batch["values"], mask))
        batch["returns"] = returns
        if alg.whiten_advantages and mask.sum() >= 2:
            advantages = pm.masked_whiten(advantages, mask)
    elif alg.name == "grpo":
        advantages = pm.broadcast_to_tokens(pm.grpo_advantages(seq_scores, n, alg.grpo_norm_by_std), mask)
    elif alg.name == "rloo":
        advantages = pm.broadcast_to_tokens(pm.rloo_advantages(seq_scores, n), mask)
    elif alg.name == "reinforce_pp":
        advantages = pm.reinforce_pp_advantages(rewards, mask, alg.gamma)
    elif alg.name == "reinforce_pp_baseline":
        advantages = pm.reinforce_pp_baseline_advantages(seq_scores, mask, n)
    else:  # the config's Literal type admits no other name
        raise ValueError(f"no advantage estimator for algorithm.name={alg.name!r}")
    batch["advantages"] = advantages * mask
    metrics["actor/advantages_mean"] = float(pm.masked_mean(advantages, mask))
    if alg.mask_truncated and "truncated" in batch:
        batch["loss_mask"] = pm.truncation_mask(gen, batch["truncated"])
        metrics["actor/truncated_masked"] = float(batch["truncated"].float().mean())
    return metrics


def gap_problem(cfg: Config, batch: Batch, trainer_logprobs: torch.Tensor, step: int) -> str | None:
    """trainer.gap_check's verdict on a step's samples (the trainer's log-probs of them against the batch's
    `engine_logprobs`): None when the gap is within trainer.gap_check_max_k3, else the one line saying so."""
    gap = pm.logprob_gap(trainer_logprobs, batch["engine_logprobs"], batch.get("loss_mask", batch["response_mask"]))
    k3 = float(gap["logprob_gap_k3"])
    limit = cfg.trainer.gap_check_max_k3
    if k3 <= limit:
        return None
    return (
        f"the engines' log-probs of step {step}'s samples are not the trainer's: k3 KL {k3:.3g} > "
        f"trainer.gap_check_max_k3={limit:g} (mean |difference| {float(gap['logprob_diff']):.3g}, largest "
        f"{float(gap['logprob_diff_max']):.3g}), so the engines sample another distribution than the one "
        f"trained: check that they run model.dtype={cfg.model.dtype}, this run's tokenizer and chat template, "
        f"and that they loaded this run's weights"
    )

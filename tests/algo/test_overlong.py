"""What a step's advantages apply (compute_advantages): the batch's truncation flag from the engines' finish
reasons, DAPO's soft penalty on the scores the advantages see, truncated responses left out of the loss mask,
and the importance weights of the configured rollout correction with the engine-trainer gap metrics."""

import math

import pytest
import torch
from cloudrl.trainer.algo import ppo_math as pm
from cloudrl.trainer.algo.advantages import compute_advantages, gap_problem
from cloudrl.trainer.algo.batch import build_batch
from cloudrl.trainer.config import load_config

# Four samples of one prompt (rollout.n=4); rollout.max_new_tokens=4 in the local preset.
RESPONSES = [[5, 6], [5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]]
REASONS = ["stop", "stop", "stop", "length"]


def _batch():
    return build_batch([[1, 2]] * 4, RESPONSES, pad_id=0, finish_reasons=REASONS)


def _cfg(*overrides):
    return load_config(
        "local",
        ["algorithm.name=grpo", "rollout.n=4", "data.train_batch_size=1", "algorithm.kl_coef=0"]
        + ["actor.mini_batch_size=4", "actor.micro_batch_size=4", *overrides],
    )


def test_build_batch_flags_the_responses_cut_at_the_limit():
    batch = _batch()
    assert batch["truncated"].tolist() == [False, False, False, True]
    assert "truncated" not in build_batch([[1]], [[2]], pad_id=0)


def test_overlong_penalty_shapes_the_advantages_not_the_logged_scores():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    plain = _batch()
    compute_advantages(_cfg(), plain, scores.clone(), 0.0)
    batch = _batch()
    metrics = compute_advantages(
        _cfg("algorithm.overlong_buffer=2", "algorithm.overlong_penalty=0.5"), batch, scores, 0.0
    )
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0]  # the caller's scores (logged as the reward) are untouched
    shaped = scores + torch.tensor([0.0, -0.25, -0.5, -0.5])  # lengths 2, 3, 4, 4 over a buffer of 2 before 4
    want = pm.broadcast_to_tokens(pm.grpo_advantages(shaped, 4), batch["response_mask"])
    torch.testing.assert_close(batch["advantages"], want)
    assert not torch.allclose(batch["advantages"], plain["advantages"])
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(-1.25 / 4)


def test_mask_truncated_leaves_cut_responses_out_of_the_loss():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    kept = _batch()
    compute_advantages(_cfg(), kept, scores, 0.0)
    assert "loss_mask" not in kept  # off by default
    batch = _batch()
    metrics = compute_advantages(_cfg("algorithm.mask_truncated=true"), batch, scores, 0.0)
    mask = batch["response_mask"]
    assert batch["loss_mask"].tolist() == [mask[0].tolist(), mask[1].tolist(), mask[2].tolist(), [0.0] * 4]
    torch.testing.assert_close(batch["advantages"], kept["advantages"])  # the group statistics keep every sample
    assert metrics["actor/truncated_masked"] == 0.25


@pytest.mark.parametrize("mode", ["token_tis", "seq_mis"])
def test_a_steps_importance_weights_follow_the_configured_correction(mode):
    """The driver's part of a lagging step: the configured correction's weights and the gap metrics."""
    batch = _batch()
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(0)
    batch["engine_logprobs"] = torch.where(mask.bool(), -torch.rand(mask.shape, generator=g), 0)
    batch["old_logprobs"] = torch.where(mask.bool(), -torch.rand(mask.shape, generator=g), 0)
    cfg = _cfg("rollout.logprob_correction=true", f"rollout.logprob_correction_mode={mode}")
    metrics = compute_advantages(cfg, batch, torch.tensor([1.0, 0.0, 1.0, 0.0]), 0.0)
    want, _ = pm.rollout_correction(batch["old_logprobs"], batch["engine_logprobs"], mask, mode, 2.0)
    torch.testing.assert_close(batch["is_weights"], want)
    diff = (batch["old_logprobs"] - batch["engine_logprobs"]).abs()[mask.bool()]
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(float(diff.max()))
    assert metrics["rollout/logprob_gap_k3"] > 0
    with pytest.raises(Exception, match="logprob_correction_mode"):
        _cfg("rollout.logprob_correction_mode=sequence")


def test_the_gap_check_passes_matching_log_probs_and_names_a_gap():
    batch = _batch()
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(1)
    batch["engine_logprobs"] = torch.where(mask.bool(), -torch.rand(mask.shape, generator=g), 0)
    close = batch["engine_logprobs"] + torch.where(mask.bool(), 1e-4, 0)  # the kernels' rounding
    cfg = _cfg()
    assert gap_problem(cfg, batch, close, 1) is None
    far = batch["engine_logprobs"] - torch.where(mask.bool(), 0.7, 0)  # another distribution
    problem = gap_problem(cfg, batch, far, 1)
    k3 = math.exp(-0.7) + 0.7 - 1
    assert problem == (
        f"the engines' log-probs of step 1's samples are not the trainer's: k3 KL {k3:.3g} > "
        "trainer.gap_check_max_k3=0.01 (mean |difference| 0.7, largest 0.7), so the engines sample another "
        "distribution than the one trained: check that they run model.dtype=float32, this run's tokenizer and "
        "chat template, and that they loaded this run's weights"
    )
    assert gap_problem(_cfg("trainer.gap_check_max_k3=0.5"), batch, far, 1) is None

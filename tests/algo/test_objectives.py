"""The reasoning-RL objectives of ppo_math against plain Python loops over b and t: loss aggregation modes,
GSPO, CISPO, DAPO's overlong penalty and truncation mask; and GSPO, CISPO and the aggregation modes against
an independent re-statement of verl's formulas (verl/trainer/ppo/core_algos.py: agg_loss,
compute_policy_loss_gspo, compute_policy_loss_cispo; verl/trainer/ppo/rollout_corr_helper.py:
compute_rollout_correction_weights, compute_rollout_rejection_mask, as of verl's rollout correction of
November 2025).

Batches hold an empty and a full-length response and garbage in their padding, as in test_ppo_math.py.
"""

import math

import pytest
import torch
from cloudrl.trainer.algo import ppo_math as pm
from cloudrl.trainer.algo.batch import Batch, update_shards
from masked_data import GARBAGE, SEEDS, make_batch, rand


def assert_close(actual, expected, tol=1e-9):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


MODES = pm.LOSS_AGG_MODES


def naive_aggregate(x, lengths, mode, max_len):
    """A per-token loss [B, T] aggregated by `mode`, one token at a time."""
    seq_sums = [sum(float(x[b, t]) for t in range(n)) for b, n in enumerate(lengths)]
    tokens = sum(lengths)
    seqs = sum(1 for n in lengths if n)
    if mode == "token-mean":
        return sum(seq_sums) / tokens
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(seq_sums, lengths) if n) / seqs
    if mode == "seq-mean-token-sum":
        return sum(seq_sums) / seqs
    return sum(seq_sums) / (seqs * max_len)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_loss_modes(seed, mode):
    lengths, mask, g = make_batch(seed, B=10)
    x = rand(g, mask)
    assert_close(pm.aggregate_loss(x, mask, agg_mode=mode, max_len=12), naive_aggregate(x, lengths, mode, 12))
    count = sum(lengths) if mode == "token-mean" else sum(1 for n in lengths if n)
    assert pm.loss_normalizer(mask, mode) == count


def test_aggregation_modes_differ_and_default_is_token_mean():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, GARBAGE, GARBAGE, GARBAGE]], dtype=torch.float64)
    got = {mode: pm.aggregate_loss(x, mask, agg_mode=mode, max_len=8).item() for mode in MODES}
    assert got == {
        "token-mean": 7 / 5,
        "seq-mean-token-mean": (1 + 3) / 2,
        "seq-mean-token-sum": (4 + 3) / 2,
        "seq-mean-token-sum-norm": (4 + 3) / (2 * 8),
    }
    assert pm.aggregate_loss(x, mask).item() == got["token-mean"]
    assert pm.aggregate_loss(x, mask, agg_mode="seq-mean-token-sum-norm").item() == 7 / (2 * 4)  # max_len = T
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        pm.aggregate_loss(x, mask, agg_mode="mean")


def _objective(name):
    """The three policy losses with a common signature (normalizer, agg_mode, max_len as keywords)."""
    if name == "ppo":
        return lambda lp, old, adv, m, **kw: pm.policy_loss(lp, old, adv, m, 0.2, 0.28, 3.0, **kw)
    if name == "gspo":
        return lambda lp, old, adv, m, **kw: pm.gspo_policy_loss(lp, old, adv, m, 0.05, 0.08, **kw)
    return lambda lp, old, adv, m, **kw: pm.cispo_policy_loss(lp, old, adv, m, 0.2, 0.28, **kw)


class _Actor:
    ppo_epochs = 1
    mini_batch_size = 12  # the whole batch: one mini-batch, split over ranks and micro-batches

    def __init__(self, mode):
        self.loss_agg_mode = mode


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_gives_one_gradient_whatever_the_split(objective, mode):
    """One big batch against update_shards' split over 2 ranks x micro-batches of 2 and 4, each part divided
    by the global normaliser: the summed gradients are the big batch's (a rank's DDP average is undone by
    the count / W the module docstring describes; here the ranks' gradients are simply added)."""
    lengths, mask, g = make_batch(0, B=12, T=7)
    mask = mask.float()
    logp = rand(g, mask, 0.3).float().requires_grad_()
    old, adv = rand(g, mask, 0.3).float(), rand(g, mask).float()
    loss_fn = _objective(objective)
    full, _ = loss_fn(logp, old, adv, mask, agg_mode=mode, max_len=9)
    (full_grad,) = torch.autograd.grad(full, logp)
    assert full_grad.abs().sum() > 0

    batch = Batch(idx=torch.arange(12), response_mask=mask)
    shards, norms = update_shards(batch, world=2, role_cfg=_Actor(mode), seed=0)
    assert norms == [pm.loss_normalizer(mask, mode)]
    split = 0
    for shard in shards:
        start = 0
        for size in (2, 4):  # unequal micro-batches: a mean of micro-batch means would differ
            rows = shard["idx"][start : start + size]
            start += size
            part, _ = loss_fn(
                logp[rows], old[rows], adv[rows], mask[rows], normalizer=norms[0], agg_mode=mode, max_len=9
            )
            split = split + part
    (split_grad,) = torch.autograd.grad(split, logp)
    assert_close(split, full, tol=1e-6)
    assert_close(split_grad, full_grad, tol=1e-6)


# ---------------------------------------------------------------------------------------------
# GSPO and CISPO against loops
# ---------------------------------------------------------------------------------------------


def naive_gspo(logp, old, adv, lengths, clip_low, clip_high):
    """Loss (seq-mean-token-mean) and d loss / d logp from the paper's formulas, one token at a time."""
    seqs = sum(1 for n in lengths if n)
    loss, grad, clipped, tokens = 0.0, [[0.0] * logp.shape[1] for _ in lengths], 0, 0
    for b, n in enumerate(lengths):
        if not n:
            continue
        s = math.exp(sum(float(logp[b, t]) - float(old[b, t]) for t in range(n)) / n)
        for t in range(n):
            a = float(adv[b, t])
            unclipped, clip_branch = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
            loss += max(unclipped, clip_branch) / n / seqs
            is_clipped = clip_branch > unclipped
            # d(s_bt)/d(logp_bt) = s_b (the sequence ratio is detached); the clipped branch is constant
            grad[b][t] = 0.0 if is_clipped else -a * s / n / seqs
            clipped += is_clipped
            tokens += 1
    return loss, grad, clipped / tokens


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_loss_and_gradient(seed):
    lengths, mask, g = make_batch(seed, B=16, T=9)
    logp = rand(g, mask, 0.1).requires_grad_()
    old = rand(g, mask, 0.1)
    adv = rand(g, mask)
    loss, stats = pm.gspo_policy_loss(logp, old, adv, mask, clip_low=0.02, clip_high=0.03)
    exp_loss, exp_grad, exp_clip = naive_gspo(logp.detach(), old, adv, lengths, 0.02, 0.03)
    loss.backward()
    assert_close(loss, exp_loss)
    assert_close(logp.grad, exp_grad)
    assert 0 < stats["clipfrac"] < 1
    assert stats["clipfrac"] == pytest.approx(exp_clip)
    lp = logp.detach()
    ratios = [math.exp(sum(float(lp[b, t] - old[b, t]) for t in range(n)) / n) for b, n in enumerate(lengths) if n]
    assert stats["seq_ratio"] == pytest.approx(sum(ratios) / len(ratios))


def test_gspo_clips_whole_sequences():
    """A sequence whose geometric-mean ratio leaves the clip range loses its gradient on every token,
    even on tokens whose own ratio is 1; one inside it keeps all of them."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.tensor([[0.3, 0.0, 0.0], [0.3, -0.3, 0.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    loss, stats = pm.gspo_policy_loss(logp, old, adv, mask, clip_low=0.05, clip_high=0.05)
    loss.backward()
    assert (logp.grad[0] == 0).all()  # s = e^0.1 > 1.05: clipped, A > 0
    assert_close(logp.grad[1], torch.full((3,), -1.0 / 3 / 2, dtype=torch.float64))  # s = 1
    assert stats["clipfrac"] == 0.5


def naive_cispo(logp, old, adv, lengths, clip_low, clip_high):
    """Token-mean loss and d loss / d logp: the weight is a constant, so the gradient is -w * A / N."""
    tokens = sum(lengths)
    loss, grad, clipped = 0.0, [[0.0] * logp.shape[1] for _ in lengths], 0
    for b, n in enumerate(lengths):
        for t in range(n):
            ratio = math.exp(float(logp[b, t]) - float(old[b, t]))
            w = min(max(ratio, 1 - clip_low), 1 + clip_high)
            a = float(adv[b, t])
            loss += -w * a * float(logp[b, t]) / tokens
            grad[b][t] = -w * a / tokens
            clipped += w != ratio
    return loss, grad, clipped / tokens


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_loss_and_gradient(seed):
    lengths, mask, g = make_batch(seed, B=16, T=9)
    logp = rand(g, mask, 0.3).requires_grad_()
    old, adv = rand(g, mask, 0.3), rand(g, mask)
    loss, stats = pm.cispo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    exp_loss, exp_grad, exp_clip = naive_cispo(logp.detach(), old, adv, lengths, 0.2, 0.28)
    loss.backward()
    assert_close(loss, exp_loss)
    assert_close(logp.grad, exp_grad)
    assert 0 < stats["clipfrac"] < 1
    assert stats["clipfrac"] == pytest.approx(exp_clip)
    assert (logp.grad[~mask.bool()] == 0).all()


def test_cispo_keeps_the_gradient_ppo_clips_away():
    logp = torch.tensor([[1.0]], requires_grad=True)  # ratio e ~ 2.7, far above 1 + 0.2
    args = (torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    ppo, _ = pm.policy_loss(logp, *args)
    (ppo_grad,) = torch.autograd.grad(ppo, logp)
    cispo, _ = pm.cispo_policy_loss(logp, *args)
    (cispo_grad,) = torch.autograd.grad(cispo, logp)
    assert ppo_grad.item() == 0.0
    assert cispo_grad.item() == pytest.approx(-1.2)  # -clip(ratio) * A


# ---------------------------------------------------------------------------------------------
# Against verl's formulas, re-stated (same inputs, 1e-6)
# ---------------------------------------------------------------------------------------------


def verl_agg_loss(loss_mat, loss_mask, mode, loss_scale_factor=None):
    """verl's agg_loss for one data-parallel rank holding the whole batch (dp_size=1, no global counts)."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_tokens = loss_mask.sum(-1)
    seq_mask = (seq_tokens > 0).float()
    if mode == "seq-mean-token-sum":
        return ((loss_mat * loss_mask).sum(-1) * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        return ((loss_mat * loss_mask).sum(-1) / (seq_tokens + 1e-8) * seq_mask).sum() / seq_mask.sum()
    factor = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return (loss_mat * loss_mask).sum() / factor


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    neg_kl = log_prob - old_log_prob
    seq_neg_kl = (neg_kl * response_mask).sum(-1) / response_mask.sum(-1).clamp(min=1)
    log_ratio = (log_prob - log_prob.detach() + seq_neg_kl.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = torch.exp(log_ratio)
    losses = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_low, 1 + clip_high))
    return verl_agg_loss(losses, response_mask, "seq-mean-token-mean")


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, mode):
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    losses = -ratio.clamp(1 - clip_low, 1 + clip_high).detach() * advantages * log_prob
    return verl_agg_loss(losses, response_mask, mode)


def _clean_inputs(seed):
    """verl multiplies by the mask rather than selecting, so its padding must be finite: zeros there."""
    lengths, mask, g = make_batch(seed, B=16, T=9)
    lengths[0] = 3  # verl's token-mean has no guard for an all-empty batch; keep one empty row out of it
    mask[0, :3] = 1
    logp = torch.where(mask.bool(), rand(g, mask, 0.1), 0).requires_grad_()
    old = torch.where(mask.bool(), rand(g, mask, 0.1), 0)
    adv = torch.where(mask.bool(), rand(g, mask), 0)
    return mask, logp, old, adv


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_matches_verl(seed, mode):
    mask, x, _, _ = _clean_inputs(seed)
    assert_close(pm.aggregate_loss(x, mask, agg_mode=mode), verl_agg_loss(x, mask, mode), tol=1e-6)


def test_dr_grpo_norm_differs_from_verl_by_the_sequence_count():
    """Named in aggregate_loss's docstring: verl divides the token sum by the constant only."""
    mask, x, _, _ = _clean_inputs(0)
    ours = pm.aggregate_loss(x, mask, agg_mode="seq-mean-token-sum-norm", max_len=16)
    verl = verl_agg_loss(x, mask, "seq-mean-token-sum-norm", loss_scale_factor=16)
    assert_close(ours * pm.loss_normalizer(mask, "seq-mean-token-sum-norm"), verl, tol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_verl(seed):
    mask, logp, old, adv = _clean_inputs(seed)
    ours, _ = pm.gspo_policy_loss(logp, old, adv, mask, clip_low=0.02, clip_high=0.03)
    theirs = verl_gspo(old, logp, adv, mask, 0.02, 0.03)
    assert_close(ours, theirs, tol=1e-6)
    assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0], tol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_matches_verl(seed, mode):
    mask, logp, old, adv = _clean_inputs(seed)
    ours, _ = pm.cispo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg_mode=mode)
    theirs = verl_cispo(old, logp, adv, mask, 0.2, 0.28, mode)
    assert_close(ours, theirs, tol=1e-6)
    assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0], tol=1e-6)


def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis) / (mask.sum(axis) + 1e-8)


def verl_is_weights(log_ratio, response_mask, level, threshold):
    """verl's truncated IS weights ("token" or "sequence"), without batch normalisation."""
    if level == "token":
        weights = torch.exp(log_ratio.clamp(-20.0, 20.0))
    else:
        total = (log_ratio * response_mask).sum(-1, keepdim=True)
        weights = torch.exp(total.clamp(-20.0, 20.0)).expand_as(log_ratio)
    return (weights * response_mask).clamp(max=threshold)


def verl_rejection_mask(log_ratio, response_mask, level, threshold):
    """verl's rejection sampling ("token", "sequence" or "geometric"), the lower bound 1/threshold: the
    response mask with the rejected tokens at 0."""
    if level == "token":
        weights = torch.exp(log_ratio.clamp(-20.0, 20.0))
    elif level == "sequence":
        total = (log_ratio * response_mask).sum(-1, keepdim=True)
        weights = torch.exp(total.clamp(-20.0, 20.0)).expand_as(log_ratio)
    else:
        mean = verl_masked_mean(log_ratio, response_mask, -1).unsqueeze(-1)
        weights = torch.exp(mean.clamp(-20.0, 20.0)).expand_as(log_ratio)
    keep = ((weights >= 1.0 / threshold) & (weights <= threshold)).float()
    return response_mask * keep


VERL_CORRECTIONS = {
    "token_tis": ("is", "token"),
    "seq_tis": ("is", "sequence"),
    "token_mis": ("rs", "token"),
    "seq_mis": ("rs", "sequence"),
    "geo_mis": ("rs", "geometric"),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", pm.ROLLOUT_CORRECTIONS)
def test_rollout_correction_matches_verl(seed, mode):
    """Each mode's weights equal verl's IS weights (truncated modes) or its rejection mask (masked modes),
    where verl drops rejected tokens from the response mask and cloudrl gives them weight 0."""
    mask, trainer, engine, _ = _clean_inputs(seed)
    trainer = trainer.detach() * 3  # spread the ratios so that each mode keeps and drops some
    cap = 1.02 if mode == "geo_mis" else 1.5
    ours, stats = pm.rollout_correction(trainer, engine, mask, mode, cap)
    kind, level = VERL_CORRECTIONS[mode]
    log_ratio = trainer - engine
    if kind == "is":
        theirs = verl_is_weights(log_ratio, mask, level, cap)
    else:
        theirs = verl_rejection_mask(log_ratio, mask, level, cap)
    assert_close(ours, theirs, tol=1e-6)
    assert 0 < float(stats["is_weight_capped"]) < 1


# ---------------------------------------------------------------------------------------------
# Overlong handling
# ---------------------------------------------------------------------------------------------


def naive_overlong(length, max_len, buffer, penalty):
    if buffer == 0 or length <= max_len - buffer:
        return 0.0
    if length > max_len:
        return -penalty
    return -penalty * (length - (max_len - buffer)) / buffer


@pytest.mark.parametrize("max_len, buffer, penalty", [(16, 4, 1.0), (16, 16, 0.5), (10, 3, 2.0), (16, 0, 1.0)])
def test_overlong_penalty(max_len, buffer, penalty):
    lengths = list(range(0, max_len + 3))
    got = pm.overlong_penalty(torch.tensor(lengths), max_len, buffer, penalty)
    assert_close(got, [naive_overlong(n, max_len, buffer, penalty) for n in lengths], tol=1e-6)
    if buffer:
        assert got[max_len].item() == pytest.approx(-penalty)
        assert got[max_len - buffer].item() == 0.0
    with pytest.raises(ValueError, match="longer than the length limit"):
        pm.overlong_penalty(torch.tensor([1]), 4, 5, 1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_truncation_mask(seed):
    lengths, mask, g = make_batch(seed)
    truncated = torch.rand(len(lengths), generator=g) < 0.5
    truncated[1] = True  # the full-length response
    expected = [[float(t < n and not truncated[b]) for t in range(mask.shape[1])] for b, n in enumerate(lengths)]
    got = pm.truncation_mask(mask, truncated)
    assert got.dtype == mask.dtype
    assert_close(got, expected)

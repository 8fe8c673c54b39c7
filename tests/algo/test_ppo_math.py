"""ppo_math against plain Python loops over b and t, on random right-padded batches.

Every batch holds at least one empty and one full-length response, and its padded positions
hold large garbage values: the loops never read them, so any leak of padding shows up.
"""

import math
import statistics

import pytest
import torch
from cloudrl.trainer.algo import ppo_math as pm
from masked_data import GARBAGE, SEEDS, make_batch, rand


def valid_values(x, lengths):
    return [float(x[b, t]) for b, n in enumerate(lengths) for t in range(n)]


def assert_close(actual, expected, tol=1e-9):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def naive_whiten(x, lengths, shift_mean=True, eps=1e-8):
    vals = valid_values(x, lengths)
    mean, var = statistics.fmean(vals), statistics.variance(vals)
    out = [[0.0] * x.shape[1] for _ in lengths]
    for b, n in enumerate(lengths):
        for t in range(n):
            out[b][t] = (float(x[b, t]) - mean) / math.sqrt(var + eps) + (0.0 if shift_mean else mean)
    return out


def naive_returns(r, lengths, gamma):
    out = [[0.0] * r.shape[1] for _ in lengths]
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            running = float(r[b, t]) + gamma * running
            out[b][t] = running
    return out


# ---------------------------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_stats(seed):
    lengths, mask, g = make_batch(seed)
    x = rand(g, mask)
    vals = valid_values(x, lengths)
    assert_close(pm.masked_sum(x, mask), sum(vals))
    assert_close(pm.masked_mean(x, mask), statistics.fmean(vals))
    assert_close(pm.masked_var(x, mask), statistics.variance(vals))
    assert_close(pm.masked_var(x, mask, unbiased=False), statistics.pvariance(vals))
    row_sums = [sum(float(x[b, t]) for t in range(n)) for b, n in enumerate(lengths)]
    row_means = [s / n if n else 0.0 for s, n in zip(row_sums, lengths)]  # empty row -> 0
    assert_close(pm.masked_sum(x, mask, dim=1), row_sums)
    assert_close(pm.masked_mean(x, mask, dim=-1), row_means)
    assert_close(pm.masked_whiten(x, mask), naive_whiten(x, lengths))
    assert_close(pm.masked_whiten(x, mask, shift_mean=False), naive_whiten(x, lengths, shift_mean=False))
    assert_close(pm.masked_mean(x, mask.bool()), statistics.fmean(vals))  # bool masks too


def test_masked_stats_ignore_nan_and_inf_on_padding():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("inf"), -float("inf")]])
    assert pm.masked_mean(x, mask).item() == 2.0
    assert torch.isfinite(pm.masked_whiten(x, mask)).all()


def test_masked_var_refuses_too_few_tokens():
    x, mask = torch.ones(2, 3), torch.zeros(2, 3)
    mask[0, 0] = 1
    with pytest.raises(ValueError, match="at least 2 valid entries, got 1"):
        pm.masked_var(x, mask)
    assert pm.masked_var(x, mask, unbiased=False).item() == 0.0
    with pytest.raises(ValueError, match="at least 1 valid entries, got 0"):
        pm.masked_var(x, torch.zeros(2, 3), unbiased=False)


@pytest.mark.parametrize("seed", SEEDS)
def test_broadcast_to_tokens(seed):
    lengths, mask, g = make_batch(seed)
    v = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    expected = [[float(v[b]) if t < n else 0.0 for t in range(mask.shape[1])] for b, n in enumerate(lengths)]
    assert_close(pm.broadcast_to_tokens(v, mask), expected)


# ---------------------------------------------------------------------------------------------
# Log-probs, entropy, KL
# ---------------------------------------------------------------------------------------------


def naive_log_softmax(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return [z - lse for z in row]


@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_and_entropy_from_logits(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 3, 4, 11
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    exp_lp = [[0.0] * T for _ in range(B)]
    exp_h = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            logp = naive_log_softmax(logits[b, t].tolist())
            exp_lp[b][t] = logp[int(tokens[b, t])]
            exp_h[b][t] = -sum(math.exp(lp) * lp for lp in logp)
    assert_close(pm.logprobs_from_logits(logits, tokens), exp_lp)
    assert_close(pm.entropy_from_logits(logits), exp_h)


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("seed", SEEDS)
def test_token_stats_from_logits_match_a_loop_in_chunks(seed, chunk):
    """Chunked log-probs and entropy at a temperature equal the per-position loop, whatever the chunk."""
    g = torch.Generator().manual_seed(seed)
    B, T, V, temp = 3, 5, 11, 0.7
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    exp_lp = [[0.0] * T for _ in range(B)]
    exp_h = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            logp = naive_log_softmax([z / temp for z in logits[b, t].tolist()])
            exp_lp[b][t] = logp[int(tokens[b, t])]
            exp_h[b][t] = -sum(math.exp(lp) * lp for lp in logp)
    # float32 inside (the chunks are converted), so float32's tolerance
    lp, h = pm.token_stats_from_logits(logits, tokens, temp, entropy=True, chunk_tokens=chunk)
    assert lp.dtype == h.dtype == torch.float32
    assert_close(lp, exp_lp, tol=1e-5)
    assert_close(h, exp_h, tol=1e-5)
    assert_close(pm.token_stats_from_logits(logits, tokens, temp, chunk_tokens=chunk), exp_lp, tol=1e-5)


@pytest.mark.parametrize("outputs", ["logprobs", "entropy", "both"])
@pytest.mark.parametrize("seed", SEEDS)
def test_token_stats_gradients_are_those_of_the_plain_formulas(seed, outputs):
    """The hand-written backward (softmax recomputed per chunk) gives autograd's gradient of the plain
    formulas on logits.float() / temperature, for either output and both together."""
    g = torch.Generator().manual_seed(seed)
    B, T, V, temp = 2, 7, 13, 1.3
    base = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    up_lp = torch.randn(B, T, generator=g)
    up_h = torch.randn(B, T, generator=g)

    def loss(lp, h):
        total = 0
        if outputs in ("logprobs", "both"):
            total = total + (lp * up_lp).sum()
        if outputs in ("entropy", "both"):
            total = total + (h * up_h).sum()
        return total

    plain = base.clone().requires_grad_()
    z = plain.float() / temp
    loss(pm.logprobs_from_logits(z, tokens), pm.entropy_from_logits(z)).backward()
    chunked = base.clone().requires_grad_()
    lp, h = pm.token_stats_from_logits(chunked, tokens, temp, entropy=True, chunk_tokens=3)
    loss(lp, h).backward()
    torch.testing.assert_close(chunked.grad, plain.grad, rtol=1e-5, atol=1e-6)


def test_token_stats_keep_the_logits_dtype_and_no_float32_copy():
    """bf16 logits: the gradient comes back in bf16, and what autograd keeps for the backward is the bf16
    logits themselves (no [B, T, V] float32 tensor saved)."""
    B, T, V = 2, 6, 32
    logits = (torch.randn(B, T, V) * 2).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, V, (B, T))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp, h = pm.token_stats_from_logits(logits, tokens, entropy=True, chunk_tokens=4)
    big = [t for t in saved if t.dim() == 3]
    assert [t.dtype for t in big] == [torch.bfloat16]
    (lp.sum() + h.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    reference = pm.logprobs_from_logits(logits.detach().float(), tokens)
    torch.testing.assert_close(lp, reference, rtol=1e-6, atol=1e-6)


def test_logits_helpers_are_stable_for_huge_logits():
    V = 5
    logits = torch.full((1, 2, V), 1e4)  # float32: a naive exp would overflow
    tokens = torch.zeros(1, 2, dtype=torch.long)
    assert_close(pm.entropy_from_logits(logits), torch.full((1, 2), math.log(V)), tol=1e-4)
    assert_close(pm.logprobs_from_logits(logits, tokens), torch.full((1, 2), -math.log(V)), tol=1e-4)


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators(seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(4, 6, generator=g, dtype=torch.float64)
    ref = torch.randn(4, 6, generator=g, dtype=torch.float64)
    naive = {
        "k1": lambda lp, lr: lp - lr,
        "k2": lambda lp, lr: 0.5 * (lp - lr) ** 2,
        "k3": lambda lp, lr: math.exp(lr - lp) - (lr - lp) - 1,
    }
    for name, f in naive.items():
        expected = [[f(float(logp[b, t]), float(ref[b, t])) for t in range(6)] for b in range(4)]
        assert_close(pm.kl_estimate(logp, ref, name), expected)
    assert (pm.kl_estimate(logp, ref, "k3") >= 0).all()


def test_k3_is_clamped_and_unknown_estimator_is_rejected():
    far = pm.kl_estimate(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "k3")
    assert torch.isfinite(far).all()
    assert_close(far, [[math.exp(20.0) - 21.0]], tol=1e-6)
    with pytest.raises(ValueError, match="valid: k1, k2, k3"):
        pm.kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------------------------
# Rewards and advantages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_token_level_rewards(seed):
    lengths, mask, g = make_batch(seed)
    scores = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    kl = rand(g, mask)
    coef = 0.05
    expected = [[0.0] * mask.shape[1] for _ in lengths]
    for b, n in enumerate(lengths):
        for t in range(n):
            expected[b][t] = -coef * float(kl[b, t]) + (float(scores[b]) if t == n - 1 else 0.0)
    assert_close(pm.token_level_rewards(scores, mask, kl=kl, kl_coef=coef), expected)
    no_kl = pm.token_level_rewards(scores, mask)
    assert_close(no_kl.sum(1), [float(scores[b]) if n else 0.0 for b, n in enumerate(lengths)])
    assert (no_kl[0] == 0).all()  # the empty response gets nothing


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_advantages(seed):
    lengths, mask, g = make_batch(seed)
    rewards, values = rand(g, mask), rand(g, mask)
    gamma, lam = 0.99, 0.9
    adv = [[0.0] * mask.shape[1] for _ in lengths]
    ret = [[0.0] * mask.shape[1] for _ in lengths]
    for b, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_v = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + float(values[b, t])
    got_adv, got_ret = pm.gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    assert_close(got_adv, adv)
    assert_close(got_ret, ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_with_lambda_one_is_monte_carlo(seed):
    lengths, mask, g = make_batch(seed)
    rewards, values = rand(g, mask), rand(g, mask)
    adv, ret = pm.gae_advantages(rewards, values, mask, gamma=0.9, lam=1.0)
    mc = pm.discounted_returns(rewards, mask, gamma=0.9)
    assert_close(ret, mc)
    assert_close(adv, torch.where(mask.bool(), mc - values, 0))


@pytest.mark.parametrize("seed", SEEDS)
def test_discounted_returns(seed):
    lengths, mask, g = make_batch(seed)
    rewards = rand(g, mask)
    assert_close(pm.discounted_returns(rewards, mask, gamma=0.95), naive_returns(rewards, lengths, 0.95))


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_and_rloo_advantages(seed):
    g = torch.Generator().manual_seed(seed)
    k = 4
    scores = torch.randint(0, 3, (12,), generator=g).double()  # repeated values, maybe flat groups
    scores[:k] = 1.0  # one group of identical scores
    grpo, grpo_mean, rloo = [], [], []
    for start in range(0, 12, k):
        grp = scores[start : start + k].tolist()
        mean, std = statistics.fmean(grp), statistics.stdev(grp)
        for i, s in enumerate(grp):
            grpo.append((s - mean) / (std + 1e-6))
            grpo_mean.append(s - mean)
            rloo.append(s - sum(grp[j] for j in range(k) if j != i) / (k - 1))
    assert_close(pm.grpo_advantages(scores, k), grpo)
    assert_close(pm.grpo_advantages(scores, k, norm_by_std=False), grpo_mean)
    assert_close(pm.rloo_advantages(scores, k), rloo)
    assert (pm.grpo_advantages(scores, k)[:k] == 0).all()


@pytest.mark.parametrize("fn", [pm.grpo_advantages, pm.rloo_advantages])
def test_group_size_errors(fn):
    with pytest.raises(ValueError, match="batch size 10 is not divisible by group_size 4"):
        fn(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="group_size >= 2"):
        fn(torch.zeros(10), 1)
    with pytest.raises(ValueError, match="group_size 3"):
        pm.reinforce_pp_baseline_advantages(torch.zeros(4), torch.ones(4, 2), 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_advantages(seed):
    lengths, mask, g = make_batch(seed)
    rewards = rand(g, mask)
    returns = torch.tensor(naive_returns(rewards, lengths, 0.9), dtype=torch.float64)
    assert_close(pm.reinforce_pp_advantages(rewards, mask, gamma=0.9), naive_whiten(returns, lengths))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_baseline_advantages(seed):
    lengths, mask, g = make_batch(seed)
    k = 2
    scores = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    centred = []
    for b in range(len(lengths)):
        start = b - b % k
        centred.append(float(scores[b]) - statistics.fmean(scores[start : start + k].tolist()))
    tokens = torch.tensor(
        [[centred[b] if t < n else GARBAGE for t in range(mask.shape[1])] for b, n in enumerate(lengths)],
        dtype=torch.float64,
    )
    expected = naive_whiten(tokens, lengths, eps=1e-6)
    assert_close(pm.reinforce_pp_baseline_advantages(scores, mask, k), expected)


# ---------------------------------------------------------------------------------------------
# Importance weights between the sampler and the trained policy
# ---------------------------------------------------------------------------------------------


def naive_rollout_correction(logp, sampler, lengths, mode, cap):
    """Each sequence's weights by hand: the mode's ratio (per token, of the sequence, or its geometric
    mean), truncated or kept within [1/cap, cap]; the mean ratio and the fraction of tokens changed."""
    out = [[0.0] * logp.shape[1] for _ in lengths]
    ratios, changed = [], []
    for b, n in enumerate(lengths):
        logs = [float(logp[b, t]) - float(sampler[b, t]) for t in range(n)]
        for t in range(n):
            if mode.startswith("token"):
                level = logs[t]
            elif mode.startswith("seq"):
                level = sum(logs)
            else:
                level = sum(logs) / n
            ratio = math.exp(max(-20.0, min(20.0, level)))
            if mode.endswith("tis"):
                out[b][t] = min(ratio, cap)
                changed.append(ratio > cap)
            else:
                keep = 1 / cap <= ratio <= cap
                out[b][t] = 1.0 if keep else 0.0
                changed.append(not keep)
            ratios.append(ratio)
    return out, statistics.fmean(ratios), statistics.fmean(changed)


@pytest.mark.parametrize("mode", pm.ROLLOUT_CORRECTIONS)
@pytest.mark.parametrize("seed", SEEDS)
def test_rollout_correction(seed, mode):
    lengths, mask, g = make_batch(seed, B=16, T=9)
    spread = 0.5 if mode.startswith("token") else 0.15  # a sequence's sum spreads as sqrt(T)
    logp = rand(g, mask, spread)
    sampler = torch.where(mask.bool(), rand(g, mask, spread), -GARBAGE)  # padding: exp(2e6) = inf
    cap = 1.1 if mode == "geo_mis" else 1.5
    weights, stats = pm.rollout_correction(logp, sampler, mask, mode, cap)
    exp_weights, exp_mean, exp_changed = naive_rollout_correction(logp, sampler, lengths, mode, cap)
    assert_close(weights, exp_weights)
    assert 0 < stats["is_weight_capped"] < 1, "the batch should hold both kinds of tokens"
    assert stats["is_weight_capped"] == pytest.approx(exp_changed)
    assert stats["is_weight_mean"] == pytest.approx(exp_mean)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in stats.values())  # no host sync


def test_an_unknown_rollout_correction_is_refused():
    lengths, mask, g = make_batch(0)
    logp = rand(g, mask)
    with pytest.raises(ValueError, match="unknown rollout correction 'seq'"):
        pm.rollout_correction(logp, logp, mask, "seq")


@pytest.mark.parametrize("seed", SEEDS)
def test_logprob_gap(seed):
    lengths, mask, g = make_batch(seed)
    logp = rand(g, mask, 0.3)
    sampler = torch.where(mask.bool(), rand(g, mask, 0.3), GARBAGE)
    diffs = [float(logp[b, t]) - float(sampler[b, t]) for b, n in enumerate(lengths) for t in range(n)]
    gap = pm.logprob_gap(logp, sampler, mask)
    assert_close(gap["logprob_diff"], statistics.fmean(abs(d) for d in diffs))
    assert_close(gap["logprob_diff_max"], max(abs(d) for d in diffs))
    assert_close(gap["logprob_gap_k3"], statistics.fmean(math.exp(d) - d - 1 for d in diffs))
    same = pm.logprob_gap(logp, logp.clone(), mask)
    assert {k: float(v) for k, v in same.items()} == {
        "logprob_diff": 0.0,
        "logprob_diff_max": 0.0,
        "logprob_gap_k3": 0.0,
    }


@pytest.mark.parametrize("mode", pm.ROLLOUT_CORRECTIONS)
def test_importance_weights_of_one_policy_are_one(mode):
    lengths, mask, g = make_batch(0)
    logp = rand(g, mask)
    weights, stats = pm.rollout_correction(logp, logp.clone(), mask, mode, cap=2.0)
    assert_close(weights, mask)
    assert stats == {"is_weight_mean": 1.0, "is_weight_capped": 0.0}


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def naive_policy_loss(logp, old, adv, lengths, clip_low, clip_high, dual_clip):
    total, n_tok, n_clip, n_dual, kl = 0.0, 0, 0, 0, 0.0
    for b, n in enumerate(lengths):
        for t in range(n):
            a = float(adv[b, t])
            ratio = math.exp(float(logp[b, t]) - float(old[b, t]))
            l1 = -a * ratio
            l2 = -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            n_clip += l2 > l1
            if dual_clip is not None and a < 0 and loss > -dual_clip * a:
                loss, n_dual = -dual_clip * a, n_dual + 1
            total += loss
            n_tok += 1
            kl += ratio - 1 - math.log(ratio)
    return total / n_tok, n_clip / n_tok, n_dual / n_tok, kl / n_tok


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_policy_loss(seed, dual_clip):
    lengths, mask, g = make_batch(seed, B=16, T=9)
    logp, old = rand(g, mask, 0.3), rand(g, mask, 0.3)  # ratios well outside [0.8, 1.28]
    adv = rand(g, mask)
    loss, stats = pm.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    exp_loss, exp_clip, exp_dual, exp_kl = naive_policy_loss(logp, old, adv, lengths, 0.2, 0.28, dual_clip)
    assert_close(loss, exp_loss)
    assert 0 < stats["clipfrac"] < 1
    assert stats["clipfrac"] == pytest.approx(exp_clip)
    assert stats["dual_clipfrac"] == pytest.approx(exp_dual)
    assert stats["approx_kl"] == pytest.approx(exp_kl)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in stats.values())  # no host sync


def test_policy_loss_dual_clip_caps_negative_advantages():
    logp, old = torch.tensor([[3.0, 3.0]]), torch.zeros(1, 2)  # ratio e^3 ~ 20
    adv, mask = torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, stats = pm.policy_loss(logp, old, adv, mask, dual_clip=3.0)
    assert_close(loss, (3.0 + -1.2) / 2, tol=1e-6)  # capped at 3, positive side clipped at 1.2
    assert stats["dual_clipfrac"] == 0.5
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        pm.policy_loss(logp, old, adv, mask, dual_clip=1.0)


def test_policy_loss_gradient_is_zero_on_clipped_and_padded_tokens():
    # token 0: A>0, ratio 1.5 > 1.2 (clipped); 1: A<0, ratio 0.5 < 0.8 (clipped);
    # 2: A>0, ratio 1.0 (free); 3: padding.
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 1.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = pm.policy_loss(logp, old, adv, mask)
    loss.backward()
    assert_close(logp.grad, [[0.0, 0.0, -2.0 / 3, 0.0]])  # d(-A*ratio)/dlogp = -A*ratio, /3 tokens
    assert stats["clipfrac"] == pytest.approx(2 / 3)


def test_policy_loss_dual_clip_gradient_is_zero():
    logp = torch.tensor([[3.0]], requires_grad=True)
    loss, _ = pm.policy_loss(logp, torch.zeros(1, 1), torch.tensor([[-1.0]]), torch.ones(1, 1), dual_clip=3.0)
    loss.backward()
    assert logp.grad.item() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_normalizer_splits_batch_exactly(seed):
    lengths, mask, g = make_batch(seed, B=10)
    logp = rand(g, mask, 0.3).requires_grad_()
    old, adv = rand(g, mask, 0.3), rand(g, mask)
    values = rand(g, mask).requires_grad_()
    old_v, ret = rand(g, mask), rand(g, mask)
    n_global = mask.sum()
    halves = [slice(0, 3), slice(3, 10)]  # unequal halves: a plain mean of means would differ

    def both_losses(sl, normalizer):
        pl, _ = pm.policy_loss(logp[sl], old[sl], adv[sl], mask[sl], dual_clip=3.0, normalizer=normalizer)
        vl, _ = pm.value_loss(values[sl], old_v[sl], ret[sl], mask[sl], normalizer=normalizer)
        return pl, vl

    full_pl, full_vl = both_losses(slice(None), None)
    full_grads = torch.autograd.grad(full_pl + full_vl, [logp, values])
    parts = [both_losses(sl, n_global) for sl in halves]
    assert_close(sum(p for p, _ in parts), full_pl)
    assert_close(sum(v for _, v in parts), full_vl)
    split_grads = torch.autograd.grad(sum(p + v for p, v in parts), [logp, values])
    for full, split in zip(full_grads, split_grads):
        assert full.abs().sum() > 0
        assert_close(split, full)
    local = both_losses(halves[0], None)[0]  # local mean differs: the normalizer matters
    assert not torch.isclose(local, parts[0][0])


def naive_value_loss(v, old, ret, lengths, clip):
    total, n_tok, n_clip = 0.0, 0, 0
    for b, n in enumerate(lengths):
        for t in range(n):
            vt, ot, rt = float(v[b, t]), float(old[b, t]), float(ret[b, t])
            l1 = (vt - rt) ** 2
            l2 = l1 if clip is None else (ot + min(max(vt - ot, -clip), clip) - rt) ** 2
            total += 0.5 * max(l1, l2)
            n_tok += 1
            n_clip += l2 > l1
    return total / n_tok, n_clip / n_tok


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(seed, clip):
    lengths, mask, g = make_batch(seed, B=16)
    v, old, ret = rand(g, mask), rand(g, mask), rand(g, mask)
    loss, stats = pm.value_loss(v, old, ret, mask, clip_range=clip)
    exp_loss, exp_clip = naive_value_loss(v, old, ret, lengths, clip)
    assert_close(loss, exp_loss)
    assert stats["vf_clipfrac"] == pytest.approx(exp_clip)
    assert (stats["vf_clipfrac"] > 0) == (clip is not None)


def test_aggregate_loss_empty_batch_and_bad_normalizer():
    x = torch.ones(2, 3, requires_grad=True)
    loss = pm.aggregate_loss(x, torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
    assert pm.aggregate_loss(x, torch.ones(2, 3), normalizer=3).item() == 2.0
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        pm.aggregate_loss(x, torch.ones(2, 3), normalizer=0)


# ---------------------------------------------------------------------------------------------
# Diagnostics and KL controllers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_explained_variance(seed):
    lengths, mask, g = make_batch(seed)
    v, ret = rand(g, mask), rand(g, mask)
    r_vals = valid_values(ret, lengths)
    diff = [r - x for r, x in zip(r_vals, valid_values(v, lengths))]
    expected = 1 - statistics.pvariance(diff) / statistics.pvariance(r_vals)
    assert pm.explained_variance(v, ret, mask) == pytest.approx(expected)
    assert pm.explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert math.isnan(pm.explained_variance(v, torch.ones_like(ret), mask))
    assert math.isnan(pm.explained_variance(v, ret, torch.zeros_like(mask)))


def test_fixed_kl_controller():
    c = pm.FixedKLController(0.1)
    c.update(current_kl=5.0, n_steps=100)
    assert c.value == 0.1
    d = pm.FixedKLController(0.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.1


def test_adaptive_kl_controller():
    c = pm.AdaptiveKLController(init_coef=0.2, target=6.0, horizon=10000)
    c.update(current_kl=6.6, n_steps=256)  # err = 0.1
    assert c.value == pytest.approx(0.2 * (1 + 0.1 * 256 / 10000))
    before = c.value
    c.update(current_kl=60.0, n_steps=1000)  # err = 9, clipped to 0.2
    assert c.value == pytest.approx(before * 1.02)
    before = c.value
    c.update(current_kl=0.0, n_steps=500)  # err = -1, clipped to -0.2
    assert c.value == pytest.approx(before * 0.99)
    resumed = pm.AdaptiveKLController(init_coef=1.0, target=6.0, horizon=10000)
    resumed.load_state_dict(c.state_dict())
    assert resumed.value == c.value
    with pytest.raises(ValueError, match="target and horizon must be > 0"):
        pm.AdaptiveKLController(0.1, target=0.0, horizon=10)

"""The math of PPO, GRPO, RLOO and REINFORCE++ for LLMs, as pure torch functions.

Read top to bottom in the order a training step uses it: log-probs and entropy from logits,
KL estimators, token-level rewards, advantages, importance weights between the sampler and the
trained policy, the policy and value losses, diagnostics, and the KL-coefficient controllers.
Nothing here knows about Ray, models or tokenizers.

Conventions
  B = sequences in the batch, T = padded response length, V = vocabulary size.
  mask [B, T] (bool or 0/1 float) is 1 on real response tokens and 0 on padding. Responses are
  right-padded and may be empty (length 0). Padded positions of every input are ignored, even
  when they hold inf or nan, and every [B, T] output is 0 on padding.

Loss aggregation and `normalizer`
  A per-token loss L [B, T] becomes a number in one of four ways (`aggregate_loss`, `LOSS_AGG_MODES`):
    token-mean               sum_{b,t} L / (number of valid tokens)                  (the default)
    seq-mean-token-mean      sum_b (sum_t L / n_b) / (number of non-empty sequences)
    seq-mean-token-sum       sum_{b,t} L / (number of non-empty sequences)
    seq-mean-token-sum-norm  sum_{b,t} L / (number of non-empty sequences * max_len)
  where n_b is sequence b's valid-token count and max_len a constant (the longest response the
  sampler may produce). The denominator is the `normalizer`, a count (of tokens, or of sequences)
  that `loss_normalizer` computes; by default it is the count of the batch passed in. When a
  mini-batch is split into micro-batches (gradient accumulation) and across data-parallel ranks,
  pass the GLOBAL count of the mini-batch (`loss_normalizer` of its whole mask) as `normalizer`
  on every micro-batch: each mode's numerator is a sum over sequences, so the accumulated
  gradient is then exactly the gradient of the whole mini-batch's loss, whatever the split. If
  the data-parallel wrapper AVERAGES gradients over W ranks (DDP and FSDP do), pass the global
  count / W instead, so the average of the ranks' sums is again the global loss.

Statistics
  The losses and the importance weights return their statistics (clipfrac, approx_kl, ...) as detached
  0-dim tensors on the inputs' device, not python floats: reading one back waits for the device, and an
  update loop reads them all once at its end (algo/step_stats.py's Accumulator) instead of each micro-batch.
"""

import torch

# ----------------------------------------------------------------------------------------------
# Masked statistics
# ----------------------------------------------------------------------------------------------


def masked_sum(x, mask, dim=None):
    """Sum of x over entries where mask is 1. x, mask: same shape; dim=None sums everything."""
    x = torch.where(mask.bool(), x, 0)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x, mask, dim=None):
    """Mean of x over entries where mask is 1: sum(x*m) / sum(m).

    A slice with no valid entry (an empty response when dim=-1) gives 0, not nan.
    """
    m = mask.bool()
    count = m.sum() if dim is None else m.sum(dim)
    total = masked_sum(x, m, dim)
    return torch.where(count > 0, total / count.clamp(min=1), 0)


def masked_var(x, mask, unbiased=True):
    """Variance of x over all valid entries (a 0-dim tensor), with Bessel's correction if unbiased.

    Raises ValueError when fewer than 2 (unbiased) or 1 (biased) entries are valid, rather than
    returning a nan that would silently poison the advantages. (This reads one number back
    from the device.)
    """
    m = mask.bool()
    n = int(m.sum())
    if n < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} valid entries, got {n}")
    mean = masked_mean(x, m)
    var = masked_sum((x - mean) ** 2, m) / n
    return var * n / (n - 1) if unbiased else var


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over the valid entries; 0 on padding.

    Statistics are taken over all valid entries together (the whole batch), unbiased variance.
    shift_mean=False adds the mean back: only the scale changes.
    """
    m = mask.bool()
    mean, var = masked_mean(x, m), masked_var(x, m)
    white = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return torch.where(m, white, 0)


def broadcast_to_tokens(seq_values, mask):
    """[B] -> [B, T]: out[b, t] = seq_values[b] on valid tokens, 0 on padding."""
    return torch.where(mask.bool(), seq_values.unsqueeze(-1), 0).to(seq_values.dtype)


# ----------------------------------------------------------------------------------------------
# From logits: log-probs of the sampled tokens and entropy
# ----------------------------------------------------------------------------------------------


def logprobs_from_logits(logits, tokens):
    """log pi(token) = z[token] - logsumexp(z).  logits [B, T, V], tokens [B, T] (int) -> [B, T].

    Gathers one logit per position instead of materialising log_softmax: the backward pass
    keeps no extra [B, T, V] tensor. Pass float32 logits for float32 accuracy.
    """
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits):
    """H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v.  logits [B, T, V] -> [B, T].

    Written with logsumexp so that large logits do not overflow.
    """
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)


def token_stats_from_logits(logits, tokens, temperature=1.0, entropy=False, chunk_tokens=1024):
    """log pi(token) and, with `entropy`, H of softmax(logits / temperature), in float32, from logits of any
    float dtype.  logits [B, T, V], tokens [B, T] (int) -> (logprobs [B, T], entropy [B, T] or None).

    The same numbers as `logprobs_from_logits` and `entropy_from_logits` on `logits.float() / temperature`,
    with the memory of neither: those keep float32 copies of the whole [B, T, V] for their backward (and
    allocate as much again while they run), where this keeps only `logits` as given (bf16 from a bf16 model)
    and works through `chunk_tokens` positions at a time, forward and backward, recomputing the softmax of
    each chunk in its backward. Gradients (to logits, of both outputs) are those of the plain formulas:
      d logpi / dz_k = 1[k = token] - p_k        d H / dz_k = -p_k (log p_k + H)
    with z = logits / temperature (and 1/temperature more to the logits themselves).
    """
    return _TokenStats.apply(logits, tokens, float(temperature), bool(entropy), int(chunk_tokens))


def _chunks(shape, chunk_tokens):
    """Index pairs (rows, positions) covering [B, T] in pieces of at most chunk_tokens positions: whole rows
    together while a row fits, else each row in runs."""
    rows, length = shape[0], shape[1]
    if length <= chunk_tokens:
        per = max(1, chunk_tokens // max(length, 1))
        for b in range(0, rows, per):
            yield slice(b, b + per), slice(None)
        return
    for b in range(rows):
        for start in range(0, length, chunk_tokens):
            yield slice(b, b + 1), slice(start, start + chunk_tokens)


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, entropy, chunk_tokens):
        B, T = tokens.shape
        logprobs = torch.empty(B, T, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        ent = torch.empty_like(logprobs) if entropy else None
        for at in _chunks((B, T), chunk_tokens):
            z = logits[at].float() / temperature
            lse[at] = torch.logsumexp(z, dim=-1)
            logprobs[at] = z.gather(-1, tokens[at].long().unsqueeze(-1)).squeeze(-1) - lse[at]
            if entropy:  # H = lse - sum_v p_v z_v, with p's temporary reused in place
                p = (z - lse[at].unsqueeze(-1)).exp_()
                ent[at] = lse[at] - p.mul_(z).sum(-1)
        ctx.save_for_backward(logits, tokens, lse, ent if entropy else lse)
        ctx.temperature, ctx.entropy, ctx.chunk_tokens = temperature, entropy, chunk_tokens
        if not entropy:
            return logprobs
        return logprobs, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits, tokens, lse, ent = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for at in _chunks(tokens.shape, ctx.chunk_tokens):
            logp = (logits[at].float() / ctx.temperature).sub_(lse[at].unsqueeze(-1))
            p = logp.exp()
            if grad_logprobs is not None:
                g_lp = grad_logprobs[at].unsqueeze(-1)
                g = p * -g_lp
                g.scatter_add_(-1, tokens[at].long().unsqueeze(-1), g_lp)
            else:
                g = torch.zeros_like(p)
            if ctx.entropy and grad_entropy is not None:  # g -= g_H * p * (log p + H), in logp's memory
                g.sub_(logp.add_(ent[at].unsqueeze(-1)).mul_(p).mul_(grad_entropy[at].unsqueeze(-1)))
            grad[at] = g.div_(ctx.temperature)
        return grad, None, None, None, None


# ----------------------------------------------------------------------------------------------
# KL between the policy and the reference, from tokens sampled by the policy
# ----------------------------------------------------------------------------------------------

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs, ref_logprobs, estimator="k1"):
    """Per-token estimate of KL(pi || pi_ref) from samples of pi.  [B, T] each -> [B, T].

    With log r = log pi_ref - log pi (Schulman, "Approximating KL Divergence", 2020):
      k1 = -log r                unbiased, high variance, can be negative
      k2 = 0.5 * (log r)^2       biased, low variance, >= 0
      k3 = (r - 1) - log r       unbiased, low variance, >= 0; log r clamped to [-20, 20]
    Padding is not masked here: mask the result (e.g. token_level_rewards does).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    log_r = log_r.clamp(-20.0, 20.0)
    return torch.exp(log_r) - 1 - log_r


# ----------------------------------------------------------------------------------------------
# Rewards and advantages
# ----------------------------------------------------------------------------------------------


def _last_token_onehot(mask):
    """[B, T] bool, True at the last valid token of each response (all False if it is empty)."""
    m = mask.bool()
    positions = torch.arange(1, m.shape[-1] + 1, device=m.device)
    last = (positions * m).amax(-1) - 1  # -1 for an empty response
    return positions - 1 == last.unsqueeze(-1)


def token_level_rewards(scores, mask, kl=None, kl_coef=0.0):
    """r[b, t] = scores[b] * [t is the last valid token] - kl_coef * kl[b, t] * mask[b, t].

    scores [B], mask [B, T], kl [B, T] or None -> [B, T]. The KL penalty in the reward follows
    Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"). An empty
    response gets no reward at all.
    """
    m = mask.bool()
    rewards = torch.where(_last_token_onehot(m), scores.unsqueeze(-1), 0).to(scores.dtype)
    if kl is not None:
        rewards = rewards - kl_coef * torch.where(m, kl, 0)
    return rewards


def overlong_penalty(lengths, max_len, buffer, penalty):
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", arXiv 2503.14476, eq. 13), added to
    the scores.  lengths [B] (response tokens, int or float) -> [B] float, <= 0.

      p(l) = 0                                                   l <= max_len - buffer
             -penalty * (l - (max_len - buffer)) / buffer        max_len - buffer < l <= max_len
             -penalty                                            l > max_len
    A linear ramp from 0 to -penalty over the last `buffer` tokens before the length limit, so the
    policy learns to finish before it is cut off; buffer=0 turns it off (all zeros). The paper's
    penalty is 1 (its reward is in [-1, 1]).
    """
    lengths = torch.as_tensor(lengths).float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} is longer than the length limit {max_len}")
    over = (lengths - (max_len - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def truncation_mask(mask, truncated):
    """The loss mask with truncated responses left out (DAPO's overlong filtering, Yu et al. 2025):
    a response cut off at the length limit has no final answer to be scored on, so its tokens get no
    loss.  mask [B, T], truncated [B] bool -> [B, T] in mask's dtype."""
    return mask * (~truncated.bool()).unsqueeze(-1).to(mask.dtype)


def gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95):
    """Generalized Advantage Estimation (Schulman et al. 2016).  [B, T] each -> (adv, returns).

      delta_t = r_t + gamma * V_{t+1} - V_t,     V after the last valid token = 0 (episode ends)
      A_t     = delta_t + gamma * lam * A_{t+1}
      returns = A + V   (the value-function target)
    Both outputs are 0 on padding. Not whitened: see masked_whiten.
    A Python loop over T (each step vectorised over B), as in CleanRL; it is cheap next to a
    forward pass.
    """
    m = mask.bool()
    # Zeroing padding makes the value after the last token 0 and, with right padding, keeps
    # A = 0 on every padded position, so no per-step masking is needed inside the loop.
    rewards, values = torch.where(m, rewards, 0), torch.where(m, values, 0)
    adv = torch.zeros_like(values)
    next_value = next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = delta + gamma * lam * next_adv
        next_value = values[:, t]
        adv[:, t] = next_adv
    return torch.where(m, adv, 0), torch.where(m, adv + values, 0)


def discounted_returns(rewards, mask, gamma=1.0):
    """Reward-to-go G_t = r_t + gamma * G_{t+1}, G = 0 after the last valid token.  [B, T] -> [B, T]."""
    m = mask.bool()
    rewards = torch.where(m, rewards, 0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return torch.where(m, returns, 0)


def _grouped(scores, group_size, method):
    """[B] -> [B / group_size, group_size], groups being consecutive blocks, with clear errors."""
    if scores.dim() != 1:
        raise ValueError(f"{method}: scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if group_size < 2:
        raise ValueError(
            f"{method} needs group_size >= 2 (samples per prompt), got {group_size}: "
            "with one sample the baseline equals the score and every advantage is 0"
        )
    if scores.shape[0] % group_size:
        raise ValueError(
            f"{method}: batch size {scores.shape[0]} is not divisible by group_size {group_size}; "
            "the batch must hold group_size consecutive samples for each prompt"
        )
    return scores.view(-1, group_size)


def grpo_advantages(scores, group_size, norm_by_std=True, eps=1e-6):
    """A_i = (s_i - mean(group)) / (std(group) + eps), std unbiased.  scores [B] -> [B].

    GRPO (Shao et al. 2024, "DeepSeekMath"). norm_by_std=False keeps only the mean baseline
    (Dr. GRPO, Liu et al. 2025). A group of identical scores gives 0.
    """
    g = _grouped(scores, group_size, "GRPO")
    adv = g - g.mean(-1, keepdim=True)
    if norm_by_std:
        adv = adv / (g.std(-1, keepdim=True) + eps)
    return adv.reshape(-1)


def rloo_advantages(scores, group_size):
    """A_i = s_i - mean_{j != i} s_j over the group.  scores [B] -> [B].

    REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics").
    """
    g = _grouped(scores, group_size, "RLOO")
    others_mean = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return (g - others_mean).reshape(-1)


def reinforce_pp_advantages(rewards, mask, gamma=1.0):
    """REINFORCE++ (Hu 2025): A = whiten(discounted_returns(r)) over the batch's valid tokens.

    rewards [B, T] are token-level and already carry the KL penalty (token_level_rewards).
    """
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask)


def reinforce_pp_baseline_advantages(scores, mask, group_size, eps=1e-6):
    """REINFORCE++-baseline (Hu 2025): A = whiten(broadcast(s_i - mean(group))) over valid tokens.

    scores [B], mask [B, T] -> [B, T]. Whitening is over tokens, so long responses weigh more.
    """
    g = _grouped(scores, group_size, "REINFORCE++-baseline")
    centred = (g - g.mean(-1, keepdim=True)).reshape(-1)
    return masked_whiten(broadcast_to_tokens(centred, mask), mask, eps=eps)


# ----------------------------------------------------------------------------------------------
# Importance weights between the sampling policy and the trained one
# ----------------------------------------------------------------------------------------------


ROLLOUT_CORRECTIONS = ("token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mis")
LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to +-this before exp (exp(20) ~ 4.9e8), so a sequence's product cannot overflow."""


def rollout_correction(logprobs, sampler_logprobs, mask, mode="token_tis", cap=2.0):
    """Importance weights of the trained policy over the sampler, by `mode`.  [B, T] each -> (weights, stats).

    The tokens were sampled by an engine whose log-probs differ from the trainer's (other kernels, other
    precision, or weights from before the last update when rollouts lag); the advantages are multiplied by
    these weights to correct the policy gradient for that. With log_ratio_t = logp_t - logp_sampler_t:

      token_tis  w_t = min(exp(log_ratio_t), cap)                truncated per token (IMPALA, Espeholt et
                                                                 al. 2018; Yao et al. 2025 for LLM engines)
      token_mis  w_t = 1 if 1/cap <= exp(log_ratio_t) <= cap     masked per token: a token outside is dropped
      seq_tis    w_t = min(exp(sum_t log_ratio_t), cap)          the sequence's ratio, truncated, on each token
      seq_mis    w_t = 1 if 1/cap <= exp(sum_t log_ratio_t) <= cap        masked per sequence
      geo_mis    w_t = 1 if 1/cap <= exp(mean_t log_ratio_t) <= cap       masked per sequence by the geometric
                                                                 mean of its ratios (cap near 1: 1.001)
    (sums and means over the sequence's valid tokens; log-ratios and their sums clamped to
    +-LOG_RATIO_BOUND before exp; 0 on padding.) A dropped token or sequence keeps its place in the loss's
    count (its weight is 0), so the other samples' weights are what they would be without it.

    Returns (weights, stats); stats holds 0-dim tensors over the valid tokens:
      is_weight_mean    mean of the untruncated ratio at the mode's level (token, sequence or geometric)
      is_weight_capped  fraction of tokens whose weight was truncated (tis) or dropped (mis)
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}: use one of {', '.join(ROLLOUT_CORRECTIONS)}")
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - sampler_logprobs, 0)
    if mode.startswith("token"):
        level = log_ratio
    elif mode.startswith("seq"):
        level = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    else:  # geo: the mean over the sequence's valid tokens
        count = m.sum(-1, keepdim=True).clamp(min=1)
        level = (log_ratio.sum(-1, keepdim=True) / count).expand_as(log_ratio)
    ratio = torch.exp(level.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mode.endswith("tis"):
        weights = ratio.clamp(max=cap)
        dropped = ratio > cap
    else:
        kept = (ratio >= 1.0 / cap) & (ratio <= cap)
        weights = kept.to(ratio.dtype)
        dropped = ~kept
    weights = torch.where(m, weights, 0)
    stats = {
        "is_weight_mean": masked_mean(ratio, m).detach(),
        "is_weight_capped": masked_mean(dropped.float(), m).detach(),
    }
    return weights, stats


def logprob_gap(logprobs, sampler_logprobs, mask):
    """How far the sampler's log-probs are from the trainer's on the sampled tokens.  [B, T] each -> stats
    of 0-dim tensors over the valid tokens:
      logprob_diff      mean |logp - logp_sampler|
      logprob_diff_max  max |logp - logp_sampler|
      logprob_gap_k3    mean of rho - log rho - 1, rho = exp(logp - logp_sampler): the k3 estimate of
                        KL(sampler || trainer), >= 0 and 0 only where they agree (in float64: in
                        float32 a gap of 1e-7 would round to 0)
    A gap that is not ~0 on-policy means the engine computes another distribution than the trainer
    (dtype, chat template, tokenizer, weights not loaded)."""
    m = mask.bool()
    diff = torch.where(m, logprobs - sampler_logprobs, 0)
    bounded = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).double()  # float32 rounds gaps of 1e-7 to 0
    return {
        "logprob_diff": masked_mean(diff.abs(), m).detach(),
        "logprob_diff_max": diff.abs().max().detach() if diff.numel() else diff.new_zeros(()),  # 0 on padding
        "logprob_gap_k3": masked_mean(torch.expm1(bounded) - bounded, m).detach(),
    }


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_agg_mode(mode):
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def loss_normalizer(mask, mode="token-mean"):
    """The count a loss is divided by under `mode`: valid tokens (token-mean) or sequences with at
    least one valid token (the seq-mean modes).  mask [B, T] -> python float, at least 1.

    Computed on a whole mini-batch's mask, it is the global `normalizer` that makes micro-batches
    and ranks add up to that mini-batch (see the module docstring).
    """
    return float(loss_count(mask, mode))


def loss_count(mask, mode="token-mean"):
    """`loss_normalizer` as a 0-dim tensor on the mask's device (at least 1), for callers that must not wait
    for the device to read it."""
    _check_agg_mode(mode)
    m = mask.bool()
    count = m.sum() if mode == "token-mean" else m.any(-1).sum()
    return count.clamp(min=1)


def aggregate_loss(per_token_loss, mask, normalizer=None, agg_mode="token-mean", max_len=None):
    """A per-token loss [B, T] as one number (0-dim), by `agg_mode` (see the module docstring).

      token-mean               sum_{b,t} L[b,t] / normalizer
      seq-mean-token-mean      sum_b (sum_t L[b,t] / n_b) / normalizer      (n_b = valid tokens of b)
      seq-mean-token-sum       sum_{b,t} L[b,t] / normalizer
      seq-mean-token-sum-norm  sum_{b,t} L[b,t] / (normalizer * max_len)
    normalizer: a count of tokens (token-mean) or of non-empty sequences (the others); default
    `loss_normalizer(mask, agg_mode)`, the batch's own. max_len (seq-mean-token-sum-norm only): the
    constant per-sequence divisor, default T. That last mode is Dr. GRPO's (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", arXiv 2503.20783): a constant in place of each
    response's length removes the bias towards long wrong answers; cloudrl passes the longest
    response the sampler may produce. verl's mode of that name divides the sum by the constant
    alone (not by the number of sequences too), which scales the loss by the batch size. An empty
    batch gives 0 (not nan) with the default normalizer.
    """
    _check_agg_mode(agg_mode)
    if normalizer is None:
        normalizer = loss_normalizer(mask, agg_mode)
    elif not torch.is_tensor(normalizer) and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0 (a count of valid tokens or sequences), got {normalizer}")
    m = mask.bool()
    if agg_mode == "seq-mean-token-mean":
        per_seq = masked_sum(per_token_loss, m, dim=-1) / m.sum(-1).clamp(min=1)
        return per_seq.sum() / normalizer
    total = masked_sum(per_token_loss, m)
    if agg_mode == "seq-mean-token-sum-norm":
        return total / (normalizer * (m.shape[-1] if max_len is None else max_len))
    return total / normalizer


def _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, dual_clip):
    """Per-token max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)), capped at
    -dual_clip * A where A < 0. Returns (losses, clipped taken [B, T] bool, dual cap taken [B, T] bool)."""
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (typically 3), or None to disable it; got {dual_clip}")
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    dual_taken = torch.zeros_like(mask.bool())
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual_taken = (advantages < 0) & (losses > bound)
        losses = torch.where(dual_taken, bound, losses)
    return losses, clipped > unclipped, dual_taken


def policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    normalizer=None,
    agg_mode="token-mean",
    max_len=None,
):
    """Clipped surrogate policy loss.  logprobs, old_logprobs, advantages, mask: [B, T].

      ratio = exp(logp - logp_old)
      L_t   = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))   PPO (Schulman 2017);
              clip_high > clip_low is DAPO's "clip-higher" (Yu et al. 2025)
      L_t   = min(L_t, -dual_clip * A)  where A < 0                            dual clip (Ye et al. 2020)
      loss  = aggregate_loss(L, mask, normalizer, agg_mode, max_len)

    Returns (loss, stats); stats holds 0-dim tensors over the valid tokens:
      clipfrac       fraction where the clipped branch is the one taken
      dual_clipfrac  fraction where the dual-clip bound is the one taken
      approx_kl      mean of k3 = (ratio - 1) - log ratio, the estimate of KL(pi_old || pi)
                     from tokens sampled by pi_old (as in CleanRL)
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0)
    advantages = torch.where(m, advantages, 0)
    ratio = torch.exp(log_ratio)
    losses, clip_taken, dual_taken = _clipped_surrogate(ratio, advantages, m, clip_low, clip_high, dual_clip)
    loss = aggregate_loss(losses, m, normalizer, agg_mode, max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clip_taken.float(), m),
            "dual_clipfrac": masked_mean(dual_taken.float(), m),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, m),
        }
    return loss, stats


def gspo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low=3e-4,
    clip_high=4e-4,
    normalizer=None,
    agg_mode="seq-mean-token-mean",
    max_len=None,
):
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071), in its
    token-level form (GSPO-token).  logprobs, old_logprobs, advantages, mask: [B, T].

      s_b    = exp( sum_t (logp - logp_old)[b, t] / n_b )      sequence-level ratio (n_b valid tokens)
      s_bt   = sg(s_b) * pi(y_bt) / sg(pi(y_bt))               = s_b in value; d s_bt = s_b * d logp_bt
      L_t    = max(-A * s_bt, -A * clip(s_bt, 1 - clip_low, 1 + clip_high))
      loss   = aggregate_loss(L, mask, normalizer, agg_mode, max_len)
    (sg = stop-gradient.) With A constant over a response, as every group algorithm gives it, the
    gradient is the paper's sequence-level one: s_b * A_b * mean_t d logp_bt, clipped as a whole
    sequence. The paper's objective averages over sequences of token-means, `agg_mode`'s default;
    its clip range is tiny (3e-4 and 4e-4) because a sequence ratio is a geometric mean of token
    ratios. verl's `compute_policy_loss_gspo` computes the same, but clamps log s_bt at 10 (this
    does not: the clip bounds a large ratio's loss and takes its gradient away) and always uses
    seq-mean-token-mean whatever loss_agg_mode says.

    Returns (loss, stats); stats holds 0-dim tensors:
      clipfrac     fraction of valid tokens whose sequence ratio is clipped
      seq_ratio    mean of s_b over the non-empty sequences
      approx_kl    as in policy_loss, over the token-level ratios
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0)
    advantages = torch.where(m, advantages, 0)
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)
    token_logprobs = torch.where(m, logprobs, 0)
    log_s = token_logprobs - token_logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.where(m, torch.exp(log_s), 0)
    losses, clip_taken, _ = _clipped_surrogate(s, advantages, m, clip_low, clip_high, None)
    loss = aggregate_loss(losses, m, normalizer, agg_mode, max_len)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        stats = {
            "clipfrac": masked_mean(clip_taken.float(), m),
            "seq_ratio": masked_mean(torch.exp(seq_log_ratio), m.any(-1)),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, m),
        }
    return loss, stats


def cispo_policy_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    clip_low=0.2,
    clip_high=0.2,
    normalizer=None,
    agg_mode="token-mean",
    max_len=None,
):
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025, arXiv 2506.13585).
    logprobs, old_logprobs, advantages, mask: [B, T].

      ratio = exp(logp - logp_old)
      w_t   = sg(clip(ratio, 1 - clip_low, 1 + clip_high))          the clipped, detached IS weight
      L_t   = -w_t * A_t * logp_t                                     a REINFORCE-style loss
      loss  = aggregate_loss(L, mask, normalizer, agg_mode, max_len)
    Unlike PPO, no token loses its gradient to the clip: the weight is bounded, the update is not
    dropped (the paper's point: rare "fork" tokens with large ratios keep contributing). The paper
    averages over all tokens of the batch (token-mean) and mostly bounds the weight from above only;
    a large clip_low (up to 1) gets that. verl's `compute_policy_loss_cispo` computes the same but
    clamps the log-ratio to [-20, 20] first.

    Returns (loss, stats); stats holds 0-dim tensors over the valid tokens:
      clipfrac   fraction whose weight was clipped
      approx_kl  as in policy_loss
    """
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, 0)
    advantages = torch.where(m, advantages, 0)
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    losses = -weights * advantages * torch.where(m, logprobs, 0)
    loss = aggregate_loss(losses, m, normalizer, agg_mode, max_len)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((weights != ratio).float(), m),
            "approx_kl": masked_mean(ratio - 1 - log_ratio, m),
        }
    return loss, stats


POLICY_LOSSES = ("ppo", "gspo", "cispo")


def value_loss(values, old_values, returns, mask, clip_range=0.2, normalizer=None):
    """Clipped value loss.  values, old_values, returns, mask: [B, T].

      V_clip = old_V + clip(V - old_V, -clip_range, clip_range)
      L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)          (PPO2 baselines; clip_range=None: no clip)
      loss   = aggregate_loss(L, mask, normalizer)
    Returns (loss, stats) with stats["vf_clipfrac"]: fraction of valid tokens where the clipped
    branch is the one taken (a 0-dim tensor; 0.0 without clipping).
    """
    m = mask.bool()
    unclipped = (values - returns) ** 2
    losses = unclipped
    clipfrac = 0.0
    if clip_range is not None:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clipped - returns) ** 2
        losses = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).float(), m)
    return aggregate_loss(0.5 * losses, m, normalizer), {"vf_clipfrac": clipfrac}


# ----------------------------------------------------------------------------------------------
# Diagnostics
# ----------------------------------------------------------------------------------------------


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over valid tokens, as a float; nan when Var[R] == 0 or no token is valid.

    1 means the critic predicts the returns perfectly, 0 means no better than a constant,
    below 0 worse than a constant.
    """
    if not mask.bool().any():
        return float("nan")
    with torch.no_grad():
        var_r = masked_var(returns, mask, unbiased=False).item()
        if var_r == 0:
            return float("nan")
        return 1.0 - masked_var(returns - values, mask, unbiased=False).item() / var_r


# ----------------------------------------------------------------------------------------------
# KL coefficient controllers (for the KL penalty in the reward or in the loss)
# ----------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef):
        self.value = float(coef)

    def update(self, current_kl, n_steps):
        """No-op: the coefficient stays fixed."""

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

      err   = clip(current_kl / target - 1, -0.2, 0.2)
      coef <- coef * (1 + err * n_steps / horizon)
    n_steps is the number of samples (or steps, as long as horizon uses the same unit) since
    the last update. state_dict() holds the coefficient only; target and horizon are config.
    """

    def __init__(self, init_coef, target, horizon):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got target={target}, horizon={horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl, n_steps):
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])

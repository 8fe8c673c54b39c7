"""The actor's update with each policy objective and loss aggregation mode, in process (one rank, no Ray):
the micro-batch split does not change the update, and every path (KL loss and entropy bonus included) runs."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.algo.batch import build_batch, update_shards
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles.workers import PolicyWorker


def _batch(size: int = 16):
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(3, 20, (4,), generator=gen)] for _ in range(size)]
    lengths = [0, 4] + torch.randint(1, 5, (size - 2,), generator=gen).tolist()  # one empty response
    responses = [[int(t) for t in torch.randint(3, 20, (n,), generator=gen)] for n in lengths]
    batch = build_batch(prompts, responses, pad_id=0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    return batch, gen


@pytest.mark.parametrize(
    "objective, mode",
    [
        ("gspo", "seq-mean-token-mean"),
        ("cispo", "token-mean"),
        ("ppo", "seq-mean-token-sum-norm"),
    ],
)
def test_update_is_the_same_whatever_the_micro_batches(objective, mode):
    overrides = [
        f"actor.policy_loss={objective}",
        f"actor.loss_agg_mode={mode}",
        "actor.clip_low=0.2",  # one range for all three (gspo's own default would clip every sequence here)
        "actor.clip_high=0.2",
        "actor.mini_batch_size=16",
        "actor.lr=1e-3",
        "actor.entropy_coef=0.01",
        "algorithm.kl_mode=loss",
        "data.train_batch_size=4",
        "rollout.n=4",
        "model.sft_warmup_steps=0",
        "critic.mini_batch_size=16",
        "critic.micro_batch_size=16",
    ]
    batch, gen = _batch()
    grads = {}
    for micro in (16, 4):
        cfg = load_config("local", [*overrides, f"actor.micro_batch_size={micro}"])
        worker = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), with_reference=True)
        worker.start_training()
        inputs = batch.only("input_ids", "attention_mask", "response_mask")
        if micro == 16:  # the same old and reference log-probs for both runs: ratios away from 1
            mask = batch["response_mask"]
            batch["old_logprobs"] = (worker.logprobs(inputs) + 0.05 * torch.randn(mask.shape, generator=gen)) * mask
            batch["ref_logprobs"] = (worker.ref_logprobs(inputs) - 0.05 * torch.rand(mask.shape, generator=gen)) * mask

        def keep_gradient(grad_clip, worker=worker, micro=micro):  # in place of the optimizer step
            grads[micro] = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
            return 0.0

        worker._step = keep_gradient
        shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
        metrics = worker.update(shards[0], norms, kl_coef=0.1).stats
        assert metrics["sums"]["actor/kl_loss"] > 0
        assert torch.isfinite(torch.tensor(metrics["sums"]["actor/pg_loss"]))
    for name, grad in grads[16].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[4][name], grad, rtol=1e-5, atol=1e-7, msg=name)

"""`model.compile` (trainer/roles/compile.py), in process on the built-in tiny model: each transformer block of
the actor and its reference is compiled with Inductor, and the log-probs, the update's losses and the
gradients are those of the eager model; generation inside the actor runs the blocks eagerly; a CPU node
without a C++ compiler is refused in one line. What compiling saves is a GPU figure (bench/mfu.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from cloudrl.trainer.algo.batch import build_batch, update_shards
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.inputs.models import resolve_path, transformer_blocks
from cloudrl.trainer.roles import compile as compile_module
from cloudrl.trainer.roles.workers import PolicyWorker
from cloudrl.trainer.rollout.engines import SamplingSettings
from float_close import assert_same_math

OVERRIDES = [
    "algorithm.name=grpo",
    "algorithm.kl_mode=loss",
    "model.sft_warmup_steps=0",
    "data.train_batch_size=1",
    "rollout.n=4",
    "actor.mini_batch_size=4",
    "actor.micro_batch_size=2",  # two micro-batches of different widths: one graph with dynamic shapes
    "actor.lr=1e-3",
]


def graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def run_actor(compiled: bool, batch) -> dict:
    cfg = load_config("local", [*OVERRIDES, f"model.compile={str(compiled).lower()}"])
    actor = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), with_reference=True)
    actor.start_training()
    out = {"blocks": transformer_blocks(actor.model) + transformer_blocks(actor.reference)}
    out["old"] = actor.logprobs(batch)
    out["ref"] = actor.ref_logprobs(batch)

    def keep_gradient(grad_clip):  # in place of the optimizer step
        out["grads"] = {n: p.grad.clone() for n, p in actor.model.named_parameters()}
        return 0.0

    actor._step = keep_gradient
    shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
    out["stats"] = actor.update(shards[0], norms, kl_coef=0.1).stats["sums"]
    before = graphs_compiled()
    settings = SamplingSettings.from_config(cfg.rollout, seed=0)
    out["generated"] = [c.token_ids for c in actor.generate([[5, 6, 7], [8, 9]], settings)]
    out["graphs_while_generating"] = graphs_compiled() - before
    return out


def test_compiled_blocks_compute_what_the_eager_model_does():
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(3, 20, (n,), generator=gen)] for n in (2, 9, 4, 7)]
    responses = [[int(t) for t in torch.randint(3, 20, (n,), generator=gen)] for n in (5, 1, 13, 8)]
    batch = build_batch(prompts, responses, pad_id=0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    batch["old_logprobs"] = -torch.rand(mask.shape, generator=gen) * mask
    batch["ref_logprobs"] = -torch.rand(mask.shape, generator=gen) * mask

    eager = run_actor(False, batch)
    assert not any(b._compiled_call_impl for b in eager["blocks"])
    before = graphs_compiled()
    compiled = run_actor(True, batch)
    assert compiled["blocks"] and all(b._compiled_call_impl for b in compiled["blocks"])
    # Inductor really ran: the policy's training and no-grad forward passes and the reference's, one graph
    # each for every block of the model, not one per block.
    assert 1 <= graphs_compiled() - before <= 6, graphs_compiled() - before

    for key in ("old", "ref"):
        assert_same_math(compiled[key], eager[key], msg=key)
    for key in ("actor/pg_loss", "actor/kl_loss"):
        assert compiled["stats"][key] == pytest.approx(eager["stats"][key], rel=1e-5, abs=1e-6), key
    assert compiled["grads"].keys() == eager["grads"].keys()  # parameter names unchanged by compiling
    for name, grad in eager["grads"].items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(compiled["grads"][name], grad, rtol=1e-4, atol=1e-4 * scale, msg=name)
    assert compiled["graphs_while_generating"] == 0  # the decode loop ran the blocks eagerly
    assert compiled["generated"] == eager["generated"]


def test_a_cpu_node_without_a_compiler_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    block = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"model.compile=true .* needs a C\+\+ compiler .* set model.compile=false"):
        compile_module.compile_blocks(block, torch.device("cpu"))
    assert block._compiled_call_impl is None

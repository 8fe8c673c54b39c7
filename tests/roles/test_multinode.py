"""Data-parallel training and placement on real Ray clusters (CPU, gloo)."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.algo.batch import from_wire, update_shards
from cloudrl.trainer.config import load_config
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles.placement import ClusterTooSmall, check_fits, plan
from cloudrl.trainer.roles.workers import PolicyWorker
from policy_groups import fixed_batch, policy_group

pytestmark = pytest.mark.ray


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2-gloo", "plain-dp"])
def test_two_workers_match_one_on_the_same_global_batch(ray_local, fsdp):
    """One PPO update (2 mini-batches, several micro-batches) with W=2 gloo ranks gives the same
    parameters as W=1 unsharded: the loss is normalised by the global token count, and gradients are
    averaged by FSDP2 (sharded over gloo, the GPU code path) or summed by plain data parallelism. The
    policy's log-probs run before the first update, as in a step with old log-probs."""
    import ray
    from ray.util import remove_placement_group

    def full_params(worker) -> dict:
        """Runs inside a policy worker (defined here so Ray ships it by value): its full parameters.
        `weights()` hands them to rank 0 only; gathering without CPU offload gives every rank the full
        tensors. Under FSDP it is a collective: call it on all ranks at once."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = (
            get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True))
            if worker.sharded
            else worker.model.state_dict()
        )
        return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}

    overrides = [
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=4",
        "actor.lr=1e-3",
        "data.train_batch_size=8",
        "rollout.n=4",
        "model.sft_warmup_steps=20",
        "critic.mini_batch_size=16",
        "critic.micro_batch_size=4",
        f"actor.fsdp={str(fsdp).lower()}",
    ]
    cfg = load_config("local", overrides)
    model_path = resolve_path(cfg.model.path, cfg)
    batch = fixed_batch(cfg, 32)
    initial = {k: from_wire(v) for k, v in PolicyWorker(cfg.to_dict(), model_path).weights()}
    results = {}
    for world in (1, 2):
        group, pg = policy_group(load_config("local", overrides), model_path, world)
        try:
            assert [w["sharded"] for w in group.where()] == [fsdp and world > 1] * world
            shards, norms = update_shards(batch, world, cfg.actor, seed=3)
            assert len(norms) == 2 and all(s.size == 32 // world for s in shards)
            inputs = batch.only("input_ids", "attention_mask", "response_mask")
            before = torch.cat(ray.get([w.logprobs.remote(inputs) for w in group.workers]))
            ray.get([w.update.remote(s, norms, 0.0) for w, s in zip(group.workers, shards)])
            # Gathering the full state is a collective under FSDP: every rank takes part, rank 0 returns it.
            results[world] = {k: from_wire(v) for k, v in ray.get([w.weights.remote() for w in group.workers])[0]}
            assert before.shape[0] == 32 * world  # each rank scored the whole batch
            # Every rank holds the same parameters after the update: ranks whose gradients were not
            # averaged (or whose optimizer stepped differently) would each follow their own shard.
            ranks = ray.get([w.__ray_call__.remote(full_params) for w in group.workers])
            for rank, params in enumerate(ranks[1:], start=1):
                assert params.keys() == ranks[0].keys()
                for name, value in ranks[0].items():
                    torch.testing.assert_close(params[name], value, rtol=1e-6, atol=1e-7, msg=f"rank {rank}: {name}")
        finally:
            group.kill()
            remove_placement_group(pg)
    # Each rank cuts its padded micro-batches to their own width, so float32 rounds otherwise than one rank's;
    # AdamW's first step turns a gradient's rounding near zero into up to 2 x lr for that element. So: every
    # element within 2 x lr, and all but a sliver (1%) equal to 1e-5, where wrong averaging moves nearly all.
    changed = 0
    lr = cfg.actor.lr
    for name, value in results[1].items():
        torch.testing.assert_close(results[2][name], value, rtol=0, atol=2 * lr + 1e-6, msg=name)
        off = ~torch.isclose(results[2][name], value, rtol=1e-5, atol=1e-6)
        assert off.float().mean() <= 0.01, (name, int(off.sum()), off.numel())
        changed += not torch.equal(value, initial[name])
    assert changed > len(results[1]) // 2


def test_check_fits_messages_without_a_cluster():
    cfg = load_config("local", ["actor.nodes=2", "actor.workers_per_node=2", "actor.micro_batch_size=64"])
    check_fits(plan(cfg), [{"CPU": 4}, {"CPU": 4}])  # two nodes with room for two actor ranks each
    with pytest.raises(ClusterTooSmall, match="on 2 different nodes"):
        check_fits(plan(cfg), [{"CPU": 16}])
    with pytest.raises(ClusterTooSmall, match=r"asks for 8 h100 \(8 for actor"):
        check_fits(plan(load_config("local", ["actor.resources={h100: 8}"])), [{"CPU": 8}])


def test_a_worker_that_never_answers_ends_in_one_line(ray_local):
    """Process-group start, engine start and weight sync wait through `get_all`: a rank that never
    answers stops the run with a line naming it and the setting, instead of a hang."""
    import time

    import ray
    from cloudrl.trainer.errors import WorkerTimeout
    from cloudrl.trainer.waiting import get_all

    @ray.remote(num_cpus=0)
    class Stuck:
        def ping(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    workers = [Stuck.remote(), Stuck.remote()]
    try:
        assert get_all([w.ping.remote(0) for w in workers], ["a", "b"], 30, "pinging") == [0, 0]
        start = time.monotonic()
        with pytest.raises(WorkerTimeout) as err:
            get_all(
                [workers[0].ping.remote(0), workers[1].ping.remote(60)],
                ["critic rank 0 on 10.0.0.1", "critic rank 1 on 10.0.0.2"],
                1.0,
                "critic: joining the process group",
            )
        assert time.monotonic() - start < 10
        message = str(err.value)
        assert "\n" not in message and "critic rank 1 on 10.0.0.2" in message and "rank 0" not in message
        assert "trainer.worker_timeout_s=1s" in message
    finally:
        for w in workers:
            ray.kill(w)

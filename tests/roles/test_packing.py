"""Packed sequences and token-budget micro-batches (roles/packing.py), in process on the built-in tiny model:
per-token log-probs, entropies, values, the policy and value losses and their gradients are the same packed
as padded, and grouped by a token budget as by a fixed count."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from cloudrl.trainer.algo.batch import build_batch, position_ids, token_groups, update_shards
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.inputs.demo import build_char_tokenizer, build_tiny_model
from cloudrl.trainer.inputs.models import resolve_path
from cloudrl.trainer.roles.packing import in_batch_order, micro_batches, pack, use_attention
from cloudrl.trainer.roles.worker_base import forward_logprobs, forward_values
from cloudrl.trainer.roles.workers import CriticWorker, PolicyWorker
from float_close import assert_same_math
from torch.multiprocessing.spawn import ProcessRaisedException

# Skewed like reasoning RL: most responses short, a few long (one empty, one longer than the budgets below).
RESPONSE_LENGTHS = [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 4, 2, 9, 1]
PROMPT_LENGTHS = [2, 9, 4, 7, 3, 10, 5, 6, 8, 2, 4, 9, 3, 5, 7, 6]


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal to 1e-4 of the gradient's scale (its largest entry): float32 rounding differs between the
    packed and padded kernels, and an entry near zero has no relative precision of its own."""
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()), msg=what)


def _skewed_batch():
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(3, 20, (n,), generator=gen)] for n in PROMPT_LENGTHS]
    responses = [[int(t) for t in torch.randint(3, 20, (n,), generator=gen)] for n in RESPONSE_LENGTHS]
    batch = build_batch(prompts, responses, pad_id=0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    batch["values"] = 0.1 * torch.randn(mask.shape, generator=gen) * mask
    batch["returns"] = torch.randn(mask.shape, generator=gen) * mask
    return batch, gen


def test_token_groups_fit_the_budget_and_cover_every_sequence_once():
    lengths = [130, 7, 60, 60, 3, 90, 12, 1, 45, 45]
    groups = token_groups(lengths, budget=100)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [0] in groups  # longer than the budget: alone
    assert all(sum(lengths[i] for i in g) <= 100 for g in groups if g != [0])
    assert len(groups) == 5  # first fit, longest first: 130 | 90+7+3 | 60+12+1 | 60 | 45+45 -> 5
    more = token_groups(lengths, budget=100, at_least=8)
    assert len(more) == 8 and sorted(i for g in more for i in g) == list(range(len(lengths)))
    assert len(token_groups([5, 5], budget=100, at_least=4)) == 2  # never more groups than sequences


def test_pack_restarts_positions_and_finds_each_response_token():
    batch = build_batch([[5, 6, 7], [8]], [[11, 12], [13, 14, 15]], pad_id=0)
    p = pack(batch)
    assert p.input_ids.tolist() == [[5, 6, 7, 11, 12, 8, 13, 14, 15]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert p.targets.tolist() == [11, 12, 13, 14, 15]
    assert p.predict_at.tolist() == [2, 3, 5, 6, 7]
    assert p.unpack(p.targets.float()).tolist() == [[11, 12, 0], [13, 14, 15]]


def test_padded_micro_batches_hold_similar_lengths_cut_to_their_own_width():
    """Padded micro-batches take the rows longest first and each is cut to its own widest prompt and response:
    the short sequences no longer run at the longest one's width, and the results go back in batch order."""
    prompts = [[5] * n for n in (2, 9, 3, 8)]
    responses = [[6] * n for n in (1, 30, 2, 25)]
    batch = build_batch(prompts, responses, pad_id=0)
    batch["advantages"] = torch.arange(4.0)[:, None] * batch["response_mask"]
    groups = micro_batches(batch, 2, 0, packed=False)
    assert [rows.tolist() for rows, _ in groups] == [[1, 3], [0, 2]]
    long, short = (micro for _, micro in groups)
    assert long["input_ids"].shape == (2, 9 + 30) and short["input_ids"].shape == (2, 3 + 2)
    assert short["advantages"].shape == short["response_mask"].shape == (2, 2)
    for rows, micro in groups:  # the same real tokens at the same positions, only pad columns gone
        full = batch.select(rows)
        assert micro["attention_mask"].sum() == full["attention_mask"].sum()
        assert (
            micro["input_ids"][micro["attention_mask"].bool()] == full["input_ids"][full["attention_mask"].bool()]
        ).all()
        assert torch.equal(
            position_ids(micro["attention_mask"])[micro["attention_mask"].bool()],
            position_ids(full["attention_mask"])[full["attention_mask"].bool()],
        )
    back = in_batch_order([(rows, micro["advantages"]) for rows, micro in groups], 4, 30)
    assert torch.equal(back, batch["advantages"])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_forward_passes_equal_padded(attention):
    from transformers import LlamaForTokenClassification

    batch, _ = _skewed_batch()
    tok = build_char_tokenizer()
    policy = build_tiny_model(tok).eval()
    config = policy.config
    config.num_labels = 1
    critic = LlamaForTokenClassification(config).eval()
    torch.nn.init.normal_(critic.score.weight)  # a head that outputs something (a fresh critic's is zeroed)
    mask = batch["response_mask"]
    padded, padded_ent = forward_logprobs(policy, batch, 0.7, entropy="grad")
    packed, packed_ent = forward_logprobs(policy, batch, 0.7, entropy="grad", packed=True, attention=attention)
    assert policy.config._attn_implementation == attention
    assert packed.shape == padded.shape == mask.shape
    assert padded.abs().sum() > 1
    # A response token that attended to another packed sequence would be off by the values' scale, not by ulps.
    assert_same_math(packed, padded)
    assert_same_math(packed_ent * mask, padded_ent * mask)
    values = forward_values(critic, batch)
    assert values.abs().sum() > 1
    assert_same_math(forward_values(critic, batch, packed=True, attention=attention), values)

    # The gradient of a loss over the log-probs, through the packed pass.
    grads = []
    for kwargs in ({}, {"packed": True, "attention": attention}):
        policy.zero_grad()
        logprobs, _ = forward_logprobs(policy, batch, 0.7, **kwargs)
        (logprobs * batch["advantages"]).sum().div(batch["response_mask"].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
    for name, grad in grads[0].items():
        assert_grad_close(grads[1][name], grad, name)


MODES = {
    "padded": [],
    "packed": ["model.pack_sequences=true", "actor.micro_batch_size=4", "critic.micro_batch_size=4"],
    "packed+budget": [
        "model.pack_sequences=true",
        "actor.max_tokens_per_micro_batch=100",
        "critic.max_tokens_per_micro_batch=100",
    ],
    "padded+budget": ["actor.max_tokens_per_micro_batch=600", "critic.max_tokens_per_micro_batch=600"],
}
COMMON = [
    "actor.policy_loss=ppo",
    "actor.loss_agg_mode=seq-mean-token-mean",
    "actor.mini_batch_size=16",
    "actor.micro_batch_size=16",
    "actor.lr=1e-3",
    "actor.entropy_coef=0.01",
    "algorithm.kl_mode=loss",
    "data.train_batch_size=4",
    "rollout.n=4",
    "model.sft_warmup_steps=0",
    "critic.mini_batch_size=16",
    "critic.micro_batch_size=16",
]


def test_updates_are_the_same_packed_padded_and_budgeted():
    """The actor's log-probs (old and reference), its update's loss and gradients, and the critic's values and
    gradients, in each mode: padded at a fixed count (today), packed, packed with a token budget, padded with one."""
    batch, gen = _skewed_batch()
    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    seen: dict[str, dict] = {}
    for mode, extra in MODES.items():
        cfg = load_config("local", [*COMMON, *extra])
        path = resolve_path(cfg.model.path, cfg)
        actor = PolicyWorker(cfg.to_dict(), path, with_reference=True)
        critic = CriticWorker(cfg.to_dict(), path)
        for worker in (actor, critic):
            worker.start_training()
        torch.nn.init.normal_(critic.model.score.weight, std=0.1)  # values that are not all zero
        out = {"old": actor.logprobs(inputs), "ref": actor.ref_logprobs(inputs), "values": critic.values(inputs)}
        if mode == "padded":  # the same old and reference log-probs for every mode: ratios away from 1
            mask = batch["response_mask"]
            batch["old_logprobs"] = (out["old"] + 0.05 * torch.randn(mask.shape, generator=gen)) * mask
            batch["ref_logprobs"] = (out["ref"] - 0.05 * torch.rand(mask.shape, generator=gen)) * mask

        for worker in (actor, critic):

            def keep_gradient(grad_clip, worker=worker, out=out):  # in place of the optimizer step
                out[worker.role] = {n: p.grad.clone() for n, p in worker.model.named_parameters()}
                return 0.0

            worker._step = keep_gradient
        shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
        out["actor_stats"] = actor.update(shards[0], norms, kl_coef=0.1).stats["sums"]
        shards, norms = update_shards(batch, 1, cfg.critic, seed=0)
        out["critic_stats"] = critic.update(shards[0], norms).stats["sums"]
        seen[mode] = out

    base = seen["padded"]
    assert base["old"].abs().sum() > 1 and base["values"].abs().sum() > 0.1
    for mode, out in seen.items():
        for key in ("old", "ref", "values"):
            assert_same_math(out[key], base[key], msg=f"{mode} {key}")
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
            assert out["actor_stats"][key] == pytest.approx(base["actor_stats"][key], rel=1e-5, abs=1e-6), (mode, key)
        assert out["critic_stats"]["critic/vf_loss"] == pytest.approx(base["critic_stats"]["critic/vf_loss"], rel=1e-5)
        for role in ("actor", "critic"):
            for name, grad in base[role].items():
                assert grad.abs().sum() > 0, (role, name)
                assert_grad_close(out[role][name], grad, f"{mode} {role} {name}")


def test_packing_self_check_refuses_a_transformers_that_leaks_across_sequences(monkeypatch):
    """model.pack_sequences' start-up self-check (WorkerBase.check_packing): with transformers' packed-sequence
    detection working, a packed pass equals a padded one and training starts; with it gone (an older
    transformers, a remote-code model, a kernel that ignores position ids) the later sequences attend to the
    earlier ones and start-up refuses packing in one line."""
    import transformers.masking_utils as masking

    cfg = load_config("local", [*COMMON, "model.pack_sequences=true"])
    path = resolve_path(cfg.model.path, cfg)
    actor = PolicyWorker(cfg.to_dict(), path)
    actor.start_training()  # runs the self-check
    assert actor.check_packing() < 1e-5
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    leaking = PolicyWorker(cfg.to_dict(), path)
    with pytest.raises(
        ConfigError, match=r"model.pack_sequences=true: a packed forward pass .* set model.pack_sequences=false"
    ) as failure:
        leaking.start_training()
    assert "\n" not in str(failure.value)


def _count_on_rank(rank: int, port: int, lengths: list[list[int]]) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        prompts = [[5] * n for n in lengths[rank]]
        batch = build_batch(prompts, [[6]] * len(prompts), pad_id=0)
        return len(micro_batches(batch, 4, 64, packed=True, agree_on=torch.device("cpu")))
    finally:
        dist.destroy_process_group()


LENGTHS_PER_RANK = [[60, 60, 60, 60], [10, 10, 10, 10]]  # alone: 4 groups and 1


# The two-rank tests share fixtures that replace the optimizer's step (the first test to run pays for them).
STEP_REPLACED = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


@STEP_REPLACED
def test_sharded_ranks_run_as_many_micro_batches(two_ranks):
    """Under FSDP each forward pass gathers the shards, so every rank must run as many: the rank whose
    sequences fit in fewer micro-batches splits them further."""
    assert {rank: two_ranks[("count", rank)] for rank in (0, 1)} == {0: 4, 1: 4}


def test_attention_keys_fail_in_one_line_and_fall_back_without_cuda():
    with pytest.raises(ConfigError, match="runs on GPUs only.*set model.attn_implementation=sdpa"):
        load_config("local", ["model.attn_implementation=flash_attention_2"])
    gpus = ["actor.gpus_per_node=1", "critic.gpus_per_node=1", "rollout.gpus_per_engine=1"]
    with pytest.raises(ConfigError, match="computes in bfloat16 or float16: set model.dtype=bfloat16"):
        load_config("local", [*gpus, "model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch must be >= 0"):
        load_config("local", ["actor.max_tokens_per_micro_batch=-1"])
    with pytest.raises(ConfigError, match="model.attn_implementation"):
        load_config("local", ["model.attn_implementation=flash"])
    if not torch.cuda.is_available():  # logical GPUs on a CPU machine: sdpa computes the same
        model = build_tiny_model(build_char_tokenizer())
        model.set_attn_implementation("eager")
        use_attention(model, "flash_attention_2")
        assert model.config._attn_implementation == "sdpa"


def test_ranks_get_as_many_sequences_and_close_token_counts():
    batch, _ = _skewed_batch()
    two = [*COMMON, "actor.workers_per_node=2", "actor.micro_batch_size=8"]
    cfg = load_config("local", [*two, "actor.max_tokens_per_micro_batch=100"])
    plain = load_config("local", two)
    shards, norms = update_shards(batch, 2, cfg.actor, seed=0)
    _, plain_norms = update_shards(batch, 2, plain.actor, seed=0)
    assert norms == plain_norms  # the normaliser is the whole mini-batch's, whoever trains what
    assert [s.size for s in shards] == [8, 8]
    tokens = [int(s["attention_mask"].sum()) for s in shards]
    assert sorted(torch.cat([s["input_ids"] for s in shards]).sum(1).tolist()) == sorted(
        batch["input_ids"].sum(1).tolist()
    )
    assert abs(tokens[0] - tokens[1]) <= 20, tokens  # contiguous halves differ by 100+ here


def _update_on_rank(rank: int, port: int, overrides: list[str], batch, out) -> None:
    cfg = load_config("local", overrides)
    worker = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), rank=rank, world_size=2)
    worker.start_training("127.0.0.1", port)
    _keep_gradients(worker, out, ("grads", rank))
    shards, norms = update_shards(batch, 2, cfg.actor, seed=0)
    worker.update(shards[rank], norms, kl_coef=0.1)


def _on_rank(rank: int, ports: list[int], packed: list[str], batch, out) -> None:
    """What both two-rank tests need, one process group after the other: the two ranks start once."""
    out[("count", rank)] = _count_on_rank(rank, ports[0], LENGTHS_PER_RANK)
    _update_on_rank(rank, ports[1], packed, batch, out)


def _keep_gradients(worker, out, key) -> None:
    """Record the gradients the optimizer step sees (after the ranks combined theirs), instead of stepping."""

    def step(*args, **kwargs):
        grads = {}
        for name, p in worker.model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective under FSDP
            grads[name] = grad.detach().clone()
        out[key] = grads

    worker.optimizer.step = step


PACKED_TWO_RANKS = [
    *COMMON,
    "actor.grad_clip=0",
    "actor.workers_per_node=2",
    "actor.micro_batch_size=4",
    "model.pack_sequences=true",
    "actor.max_tokens_per_micro_batch=100",
]


@pytest.fixture(scope="module")
def one_rank_update():
    """The skewed batch with old and reference log-probs, and the gradients one padded rank computes on it."""
    batch, gen = _skewed_batch()
    cfg = load_config("local", [*COMMON, "actor.grad_clip=0"])
    actor = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), with_reference=True)
    actor.start_training()
    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    mask = batch["response_mask"]
    batch["old_logprobs"] = (actor.logprobs(inputs) + 0.05 * torch.randn(mask.shape, generator=gen)) * mask
    batch["ref_logprobs"] = (actor.ref_logprobs(inputs) - 0.05 * torch.rand(mask.shape, generator=gen)) * mask
    one: dict = {}
    _keep_gradients(actor, one, 0)
    shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
    actor.update(shards[0], norms, kl_coef=0.1)
    return batch, one[0]


@pytest.fixture(scope="module")
def two_ranks(one_rank_update):
    """Two ranks on gloo: the micro-batch counts of LENGTHS_PER_RANK, and the gradients of two FSDP2 ranks, packed
    with a token budget, on one_rank_update's batch."""
    batch, _ = one_rank_update
    for attempt in range(3):  # a port is free when chosen; another process may take it before rank 0 listens
        ports = []
        for _ in range(2):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        out = mp.get_context("spawn").Manager().dict()
        try:
            mp.spawn(_on_rank, args=(ports, PACKED_TWO_RANKS, batch, out), nprocs=2, join=True)
            return dict(out)
        except ProcessRaisedException as exc:
            if "EADDRINUSE" not in str(exc) or attempt == 2:
                raise


@STEP_REPLACED
def test_two_ranks_packed_and_budgeted_match_one_padded_rank(one_rank_update, two_ranks):
    """Two FSDP2 ranks on gloo, packed with a token budget and balanced by tokens, give the gradients of one
    padded rank."""
    _, one = one_rank_update
    for name, grad in one.items():
        assert grad.abs().sum() > 0, name
        for rank in (0, 1):
            assert_grad_close(two_ranks[("grads", rank)][name], grad, f"rank {rank} {name}")

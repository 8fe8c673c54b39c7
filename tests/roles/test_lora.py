"""LoRA on the actor (model.lora_rank, inputs/lora.py), in process on the built-in tiny model: only the adapters
train; the reference is exactly the base model with the adapters off; the engines get the plain model's names and
merged weights (HF and vLLM paths); checkpoints hold the adapters and their optimizer state and round-trip bit for
bit; the HF export is the merged model plus the adapter; under model.dtype=bfloat16 the frozen base is held in
bf16 and the adapters in fp32; two FSDP2 ranks on gloo update as one rank does."""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch
import torch.multiprocessing as mp
from cloudrl.trainer.algo.batch import from_wire, split_batch, update_shards
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.errors import ModelLoadError
from cloudrl.trainer.inputs.models import load_causal_lm, resolve_path
from cloudrl.trainer.roles.packing import in_batch_order, micro_batches
from cloudrl.trainer.roles.worker_base import forward_logprobs
from cloudrl.trainer.roles.workers import PolicyWorker
from float_close import assert_same_math
from policy_groups import fixed_batch

RANK, ALPHA = 4, 8.0
LORA = [
    "model.sft_warmup_steps=0",
    f"model.lora_rank={RANK}",
    f"model.lora_alpha={ALPHA}",
    "data.train_batch_size=4",
    "rollout.n=4",
    "actor.mini_batch_size=16",
    "actor.micro_batch_size=8",
    "actor.lr=1e-2",
    "actor.grad_clip=0",
    "critic.mini_batch_size=16",
    "critic.micro_batch_size=16",
]


def _actor(*extra: str, with_reference: bool = True) -> tuple[PolicyWorker, object]:
    cfg = load_config("local", [*LORA, *extra])
    worker = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), with_reference=with_reference)
    worker.start_training()
    return worker, cfg


def _updated(worker: PolicyWorker, cfg, steps: int = 1):
    """`worker` after `steps` PPO updates on the fixed batch (its adapters then differ from their start)."""
    batch = fixed_batch(cfg, 16)
    for _ in range(steps):
        shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
        worker.update(shards[0], norms, kl_coef=0.0)
    return batch


def _plain(cfg):
    return load_causal_lm(resolve_path(cfg.model.path, cfg)).eval()


def _expected_merge(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    """W + B @ A * alpha / rank of every adapted layer, from the wrapped model's own parameters."""
    params = dict(worker.model.named_parameters())
    out = {}
    for name, p in params.items():
        if ".lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix(".base_layer.weight")
            a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
            out[plain] = (p + b @ a * (ALPHA / RANK)).detach()
        else:
            out[plain] = p.detach()
    return out


def test_only_the_adapters_train_and_the_reference_is_the_base_model_exactly():
    worker, cfg = _actor()
    assert worker.reference is None  # no second copy of the weights
    trained = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # all-linear: the attention and MLP projections of both blocks, not the output head
    assert len(trained) == 2 * 7 * 2 and not any("lm_head" in n for n in trained)
    in_optimizer = [p for g in worker.optimizer.param_groups for p in g["params"]]
    assert len(in_optimizer) == len(trained) and all(p.requires_grad for p in in_optimizer)

    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    batch = _updated(worker, cfg, steps=2)  # B starts at zero: A's gradient is zero until B has moved
    for name, p in worker.model.named_parameters():
        assert torch.equal(p, before[name]) != (name in trained), name  # adapters moved, the base did not

    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    plain, a = _plain(cfg), cfg.actor  # the base model alone, in the worker's micro-batches (the same shapes)
    groups = micro_batches(inputs, a.micro_batch_size, a.max_tokens_per_micro_batch, cfg.model.pack_sequences)
    parts = [(rows, forward_logprobs(plain, micro, cfg.rollout.temperature)[0]) for rows, micro in groups]
    base = in_batch_order(parts, inputs.size, inputs["response_mask"].shape[1])
    assert torch.equal(worker.ref_logprobs(inputs), base)
    assert not torch.allclose(worker.logprobs(inputs), base)  # the adapters do change the policy


def test_the_engines_get_the_plain_models_names_and_the_merged_weights():
    worker, cfg = _actor()
    _updated(worker, cfg)
    expected = _expected_merge(worker)
    plain = _plain(cfg)
    pushed = dict(worker.weights())
    assert list(pushed) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert pushed[name].shape == tuple(value.shape), name
        torch.testing.assert_close(torch.from_numpy(pushed[name]), expected[name], rtol=0, atol=1e-6, msg=name)

    # The HF engine path: the rollout worker loads them by name and then computes the policy's log-probs.
    from cloudrl.trainer.algo.batch import from_wire
    from cloudrl.trainer.rollout.engines import HFEngine

    engine = HFEngine(plain, worker.tokenizer)
    engine.load_weights((n, from_wire(t)) for n, t in worker.weights())
    batch = fixed_batch(cfg, 8).only("input_ids", "attention_mask", "response_mask")
    assert_same_math(forward_logprobs(plain, batch, cfg.rollout.temperature)[0], worker.logprobs(batch))

    # The vLLM weight-sync path (NCCL or CUDA IPC): the same names, shapes and merged values, one at a time.
    if importlib.util.find_spec("vllm") is None:
        return
    from cloudrl.trainer.rollout.weight_sync import cast_source

    source = cast_source(worker.model, adapters=worker.adapters)
    params = dict(plain.named_parameters())
    assert [(m.name, m.shape) for m in source.metadata()] == [(n, tuple(p.shape)) for n, p in params.items()]
    for name, tensor in source:
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_bit_for_bit(tmp_path):
    worker, cfg = _actor()
    _updated(worker, cfg, steps=2)
    files, scheduler = worker.save_shards(str(tmp_path / "actor"))
    assert files == {}
    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(tmp_path / "actor")).read_metadata().state_dict_metadata)
    tensors = [k for k in keys if k.startswith(("model.", "optimizer.state."))]
    # The adapters and their two AdamW moments; the frozen base is model.path's, read again on resume.
    assert tensors and all(".lora_" in k for k in tensors)
    assert len([k for k in tensors if k.startswith("model.")]) == sum(
        p.requires_grad for p in worker.model.parameters()
    )

    fresh, _ = _actor()
    fresh.load_shards(str(tmp_path / "actor"), scheduler)
    saved, loaded = worker._sharded_state(), fresh._sharded_state()
    assert saved["model"].keys() == loaded["model"].keys()
    assert all(".lora_" in name for name in saved["model"])
    for name, value in saved["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert saved["optimizer"]["state"].keys() == loaded["optimizer"]["state"].keys()
    for name, slots in saved["optimizer"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(loaded["optimizer"]["state"][name][slot], value), (name, slot)
    assert fresh.scheduler.state_dict() == worker.scheduler.state_dict()
    # And the resumed worker trains on exactly as the saved one does.
    _updated(worker, cfg)
    _updated(fresh, cfg)
    for (name, a), b in zip(worker.model.named_parameters(), fresh.model.parameters()):
        assert torch.equal(a, b), name


def test_the_hf_export_is_the_merged_model_and_the_adapter(tmp_path):
    from peft import PeftModel

    worker, cfg = _actor()
    batch = _updated(worker, cfg).only("input_ids", "attention_mask", "response_mask")
    worker.export_hf(str(tmp_path / "hf_model"))
    merged = load_causal_lm(str(tmp_path / "hf_model")).eval()
    expected = _expected_merge(worker)
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)
    adapted = PeftModel.from_pretrained(_plain(cfg), str(tmp_path / "hf_model" / "adapter")).eval()
    policy = worker.logprobs(batch)
    for model in (merged, adapted):
        torch.testing.assert_close(forward_logprobs(model, batch, cfg.rollout.temperature)[0], policy)


def test_a_bfloat16_run_holds_the_frozen_base_in_bfloat16_and_trains_fp32_adapters(tmp_path):
    """model.dtype=bfloat16: the frozen base is held in bf16 (half its fp32 bytes), the adapters and their AdamW
    moments in fp32; an update moves only the adapters; the reference is the bf16 base; the export merges in fp32
    and rounds once."""
    worker, cfg = _actor("model.dtype=bfloat16")
    params = dict(worker.model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained and all(params[n].dtype == torch.float32 for n in trained)
    frozen = {n: p for n, p in params.items() if n not in trained}
    assert all(p.dtype == torch.bfloat16 for p in frozen.values())
    fp32 = _plain(cfg)
    assert sum(p.numel() * p.element_size() for p in frozen.values()) * 2 == sum(
        p.numel() * p.element_size() for p in fp32.parameters()
    )
    before = {n: t.detach().clone() for n, t in [*worker.model.named_parameters(), *worker.model.named_buffers()]}

    batch = _updated(worker, cfg, steps=2)
    for name, t in [*worker.model.named_parameters(), *worker.model.named_buffers()]:
        assert torch.equal(t, before[name]) != (name in trained), name  # adapters moved, bit for bit nothing else
        assert t.dtype == before[name].dtype, name
    moments = [t for state in worker.optimizer.state.values() for k, t in state.items() if k != "step"]
    assert len(moments) == 2 * len(trained) and all(t.dtype == torch.float32 for t in moments)

    # The reference: the base in bfloat16, as a plain model loaded in model.dtype computes it.
    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    bf16 = load_causal_lm(resolve_path(cfg.model.path, cfg), "bfloat16").eval()
    a = cfg.actor  # in the worker's micro-batches (the same shapes, so the same bf16 rounding)
    groups = micro_batches(inputs, a.micro_batch_size, a.max_tokens_per_micro_batch, cfg.model.pack_sequences)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = [(rows, forward_logprobs(bf16, micro, cfg.rollout.temperature)[0]) for rows, micro in groups]
    base = in_batch_order(parts, inputs.size, inputs["response_mask"].shape[1])
    assert torch.equal(worker.ref_logprobs(inputs), base)

    # Export: each adapted weight is W (bf16) + B @ A * scale summed in fp32, then rounded once to bf16.
    worker.export_hf(str(tmp_path / "hf_model"))
    exported = load_causal_lm(str(tmp_path / "hf_model"), "bfloat16").state_dict()
    params = dict(worker.model.named_parameters())
    merged = 0
    for name, p in params.items():
        if name not in frozen:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        expected = p.detach()
        if name.endswith(".base_layer.weight"):
            module = name.removesuffix(".base_layer.weight")
            a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
            expected = (p.float() + b @ a * (ALPHA / RANK)).to(torch.bfloat16).detach()
            merged += 1
        assert exported[plain].dtype == torch.bfloat16 and torch.equal(exported[plain], expected), plain
    assert merged == len(trained) // 2
    pushed = {n: from_wire(t) for n, t in worker.weights()}
    assert list(pushed) == list(exported) and all(torch.equal(pushed[n], t) for n, t in exported.items())


def test_lora_keys_fail_in_one_line():
    for override, words in [
        ("model.lora_rank=-1", "model.lora_rank"),
        ("model.lora_alpha=0", "model.lora_alpha"),
        ("model.lora_target_modules=[]", "is empty"),
        ("model.lora_target_modules=[all-linear,q_proj]", "give it alone"),
    ]:
        with pytest.raises(ConfigError, match=words) as info:
            load_config("local", [*LORA, override])
        assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="model.lora_target_modules") as info:
        _actor("model.lora_target_modules=[no_such_proj]")
    assert "\n" not in str(info.value)
    with pytest.raises(ModelLoadError, match="plain linear layers only"):
        _actor("model.lora_target_modules=[embed_tokens]")


def _sharded_update(rank: int, port: int, batch, dtype: str, out) -> None:
    cfg = load_config("local", [*LORA, "actor.workers_per_node=2", f"model.dtype={dtype}"])
    worker = PolicyWorker(cfg.to_dict(), resolve_path(cfg.model.path, cfg), rank=rank, world_size=2)
    worker.start_training("127.0.0.1", port)
    assert worker.sharded
    held = {(p.requires_grad, p.to_local().dtype) for p in worker.model.parameters()}
    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    ref = worker.ref_logprobs(split_batch(inputs, 2)[rank])  # as the driver calls it: each rank its part
    shards, norms = update_shards(batch, 2, cfg.actor, seed=0)
    worker.update(shards[rank], norms, kl_coef=0.0)
    weights = worker.weights()  # a collective; rank 0 gets the merged weights
    trained = sum(p.requires_grad for p in worker.model.parameters())
    moments = {t.dtype for state in worker.optimizer.state.values() for k, t in state.items() if k != "step"}
    out[rank] = {"ref": ref, "weights": weights, "trained": trained, "held": held, "moments": moments}


DTYPES = ["float32", "bfloat16"]


def _sharded_updates(rank: int, ports: list[int], batches: dict, out) -> None:
    """Each model.dtype in turn, in a process group of its own: the two ranks start once for both."""
    for dtype, port in zip(DTYPES, ports):
        result: dict = {}
        _sharded_update(rank, port, batches[dtype], dtype, result)
        torch.distributed.destroy_process_group()
        out[(dtype, rank)] = result[rank]


@pytest.fixture(scope="module")
def two_rank_updates():
    """{dtype: (the fixed batch, {rank: what that rank saw})} of two FSDP2 ranks on gloo updating on the batch."""
    batches = {dtype: fixed_batch(load_config("local", [*LORA, f"model.dtype={dtype}"]), 16) for dtype in DTYPES}
    ports = []
    for _ in DTYPES:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    out = mp.get_context("spawn").Manager().dict()
    mp.spawn(_sharded_updates, args=(ports, batches, out), nprocs=2, join=True)
    return {dtype: (batches[dtype], {rank: out[(dtype, rank)] for rank in (0, 1)}) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_fsdp2_ranks_on_gloo_update_the_adapters_as_one_rank(dtype, two_rank_updates):
    """Wrapped before sharding: two FSDP2 ranks keep the base frozen (in model.dtype, the adapters in fp32), give
    the base model's reference log-probs (the first forward: FSDP2 must still see the adapters as trained) and
    push the merged weights of the one-rank update."""
    batch, two = two_rank_updates[dtype]
    worker, cfg = _actor(f"model.dtype={dtype}")
    inputs = batch.only("input_ids", "attention_mask", "response_mask")
    ref = worker.ref_logprobs(inputs)
    shards, norms = update_shards(batch, 1, cfg.actor, seed=0)
    worker.update(shards[0], norms, kl_coef=0.0)
    one = dict(worker.weights())

    assert two[0]["trained"] == two[1]["trained"] == sum(p.requires_grad for p in worker.model.parameters())
    base = getattr(torch, dtype)
    assert two[0]["held"] == two[1]["held"] == {(False, base), (True, torch.float32)}
    assert two[0]["moments"] == two[1]["moments"] == {torch.float32}
    # Each rank cuts its micro-batches to their own width: in bf16 other shapes round differently, by an ulp.
    assert_same_math(torch.cat([two[0]["ref"], two[1]["ref"]]), ref, computed_in=getattr(torch, dtype))
    assert two[1]["weights"] is None
    sharded = dict(two[0]["weights"])
    assert list(sharded) == list(one)
    # float32: the merge equal to 1e-4. bf16: each rank's micro-batches, cut to their own width, round otherwise
    # than the one rank's, and AdamW's first step turns a gradient's rounding near zero into up to 2 x lr;
    # the float32 run is the exact check of the merge.
    atol = 1e-5 if dtype == "float32" else 2 * cfg.actor.lr
    for name, value in one.items():
        torch.testing.assert_close(from_wire(sharded[name]), from_wire(value), rtol=1e-4, atol=atol)

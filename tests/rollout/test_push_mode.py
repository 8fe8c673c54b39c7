"""How the weights reach the engines follows where placement puts them (weight_sync.push_mode, read by
WeightPush.choose from the GPUs the engines hold in what Ray reserved, `Roles.engine_gpus`): a GPU collective wherever the actor computes on CUDA and the
engines hold GPUs, whatever their tensor parallelism; the object store only where the engines are on CPU or
the GPUs are logical (a CPU rehearsal). Pure config arithmetic: no Ray, no GPU."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import load_config
from cloudrl.trainer.presets import available_presets
from cloudrl.trainer.roles.placement import engine_gpus, plan
from cloudrl.trainer.rollout.weight_sync import push_mode

# The one GPU preset whose push is not yet a GPU collective: SGLang engines colocated with the actor have no
# CUDA IPC path in cloudrl yet, so their tensors go through the object store.
OBJECT_STORE_ON_GPUS = {"sglang-2x8"}


def gpu_presets() -> list[str]:
    return [name for name in available_presets() if load_config(name).actor.gpus_per_node > 0]


def test_there_are_gpu_presets_to_check():
    assert {"gsm8k-7b", "engine-2node", "search-r1", "sglang-2x8"} <= set(gpu_presets())


@pytest.mark.parametrize("preset", gpu_presets())
def test_every_gpu_presets_push_agrees_with_its_placement(preset):
    cfg = load_config(preset)
    gpus = engine_gpus(plan(cfg))
    assert gpus > 0, f"{preset}: its engines hold no GPUs"
    expected = "object_store" if preset in OBJECT_STORE_ON_GPUS else "nccl"
    assert push_mode(cfg, actor_on_cuda=True, engine_gpus=gpus) == expected
    # The same layout rehearsed on logical GPUs (the actor computes on CPU) keeps the object store.
    assert push_mode(cfg, actor_on_cuda=False, engine_gpus=gpus) == "object_store"


def test_vllm_engines_at_tensor_parallel_1_get_a_gpu_push():
    """The common "GRPO, vLLM tp=1" layout: placement gives each engine a GPU of its own whenever the actor has
    GPUs (rollout.gpus_per_engine left at 0), and the push goes over NCCL, not through the object store."""
    cfg = load_config(
        "local",
        ["algorithm.name=grpo", "rollout.engine=vllm", "rollout.num_engines=4", "actor.gpus_per_node=4"]
        + ["actor.micro_batch_size=16"],
    )
    assert cfg.rollout.tensor_parallel_size == 1 and cfg.rollout.gpus_per_engine == 0
    assert engine_gpus(plan(cfg)) == 4
    assert push_mode(cfg, actor_on_cuda=True, engine_gpus=engine_gpus(plan(cfg))) == "nccl"


def test_engines_on_cpu_and_the_hf_engine_use_the_object_store():
    on_cpu = load_config("local", ["algorithm.name=grpo", "rollout.engine=vllm"])
    assert engine_gpus(plan(on_cpu)) == 0 and push_mode(on_cpu, False, 0) == "object_store"
    hf = load_config("local", ["algorithm.name=grpo", "actor.gpus_per_node=1", "rollout.gpus_per_engine=1"])
    assert push_mode(hf, actor_on_cuda=True, engine_gpus=engine_gpus(plan(hf))) == "object_store"

"""FSDP2 sharding (torch.distributed.fsdp.fully_shard) for the trained roles.

Used when `<role>.fsdp=true` and the role has more than one worker (or runs on a GPU): the same code
shards over NCCL on GPUs and over gloo on CPU, so the CPU suite exercises the GPU path. The process
group must exist first (TrainableWorker.start_training). Each transformer block is a shard unit, then
the root. Parameters stay fp32 (the master weights the optimizer updates); with `model.dtype=bfloat16`
the forward and backward run in bf16 and gradients are reduced in fp32. Checkpoints are sharded: each
rank writes and reads its own DTensor shards with torch.distributed.checkpoint (TrainableWorker.save_shards,
load_shards), resharded on load, so they never depend on the number of workers. Weight sync and the HF
export gather the full weights (TrainableWorker._full_state).
"""

from __future__ import annotations

import torch


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", "model"), model), "layers", None)
    return list(layers) if layers is not None else []


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None, cpu_offload: bool = False) -> None:
    """Shard `model` in place over the default process group. `compute_dtype` None (or the parameters'
    own dtype) computes in the stored dtype; CPU offload keeps parameters and optimizer state on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    stored = next(model.parameters()).dtype
    param_dtype = compute_dtype if compute_dtype not in (None, stored) else None
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

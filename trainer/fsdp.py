"""FSDP2 sharding for GPU workers (torch.distributed.fsdp.fully_shard).

Used when a role has more than one GPU worker and `<role>.fsdp=true`. Each transformer block is a
shard unit, then the root. Checkpoints and weight sync gather the full state through
torch.distributed.checkpoint.state_dict (see TrainableWorker._full_state), so checkpoints never
depend on the number of workers.
GPU only: CPU workers use plain data parallelism (see TrainableWorker).
"""

from __future__ import annotations

import torch


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", "model"), model), "layers", None)
    return list(layers) if layers is not None else []


def shard_model(model: torch.nn.Module, cpu_offload: bool = False) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=next(model.parameters()).dtype,
                                                reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in _blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)

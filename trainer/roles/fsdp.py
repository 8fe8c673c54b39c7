"""FSDP2 sharding (torch.distributed.fsdp.fully_shard) for the trained roles.

Used when `<role>.fsdp=true` and the role has more than one worker (or runs on a GPU): the same code
shards over NCCL on GPUs and over gloo on CPU, so the CPU suite exercises the GPU path. The process
group must exist first (TrainableWorker.start_training). Each transformer block is a shard unit, then
the root. Parameters stay fp32 (the master weights the optimizer updates; under LoRA only the adapters, the
frozen base is held in model.dtype); with `model.dtype=bfloat16` the forward and backward run in bf16 and
gradients are reduced in fp32.

Only rank 0 reads the weights: every rank builds the model's skeleton on the meta device (`skeleton`),
shards it, allocates its own shard, and rank 0 broadcasts the weights it read into every rank's shard
(`shard_from_rank0`). No rank but rank 0 ever holds the whole model, in host memory or on its GPU, and
with CPU offload the shards go straight to host memory. Checkpoints are sharded: each
rank writes and reads its own DTensor shards with torch.distributed.checkpoint (TrainableWorker.save_shards,
load_shards), resharded on load, so they never depend on the number of workers. Weight sync and the HF
export gather the full weights (TrainableWorker._full_state).
"""

from __future__ import annotations

from typing import Literal

import torch

ModelKind = Literal["causal_lm", "value"]


def shard_model(model: torch.nn.Module, compute_dtype: torch.dtype | None, cpu_offload: bool = False) -> None:
    """Shard `model` in place over the default process group. `compute_dtype` None (or the parameters'
    own dtype) computes in the stored dtype; CPU offload keeps parameters and optimizer state on the host. The
    stored dtype is the trained parameters' (FSDP2 wants one among them): under LoRA the frozen base is already
    in the compute dtype and the float32 adapters are cast for compute."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from ..inputs.models import transformer_blocks

    params = list(model.parameters())
    stored = next((p.dtype for p in params if p.requires_grad), params[0].dtype)
    param_dtype = compute_dtype if compute_dtype not in (None, stored) else None
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def skeleton(kind: ModelKind, path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """The modules `inputs.models` would load from `path` (a causal LM, or a critic's one-output token
    classifier), with every parameter and buffer on the meta device: the architecture without the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from ..errors import ModelLoadError
    from ..inputs.models import disable_dropout

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ModelLoadError(
            f"cannot read the model config in {path!r} ({reason}): check the model directory"
        ) from None
    if kind == "value":
        config.num_labels = 1
    auto_cls = AutoModelForTokenClassification if kind == "value" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto_cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return disable_dropout(model)


def shard_from_rank0(
    model: torch.nn.Module,
    source: torch.nn.Module | None,
    compute_dtype: torch.dtype | None,
    cpu_offload: bool,
    device: torch.device,
) -> None:
    """Shard the meta-device `model` over the default process group and fill every rank's shard from
    `source`, the model rank 0 read (None on the other ranks). A collective: every rank calls it.
    Non-persistent buffers (rotary frequencies) are not in a state dict: rank 0 broadcasts them too."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    shard_model(model, compute_dtype, cpu_offload=cpu_offload)
    # Offloaded shards live in host memory; buffers are used by the forward pass, on the device.
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    state = source.state_dict() if source is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, state, options=options)
    persistent = set(model.state_dict())
    read = dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in persistent:
                continue
            if source is not None:
                buf.copy_(read[name])
            dist.broadcast(buf, src=0)

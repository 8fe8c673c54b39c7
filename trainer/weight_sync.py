"""New policy weights to the rollout engines after every update, without a disk round trip.

Two paths (README.md, "vLLM rollouts"):

- Object store (CPU, and the default everywhere; tested). Actor rank 0 gathers the full state dict
  (Hugging Face names, CPU tensors) and returns it from `PolicyWorker.weights`; Ray keeps that one
  copy in the object store and every `RolloutWorker.load_weights` reads it from there (driver.py,
  `sync_weights`). Each engine copies the tensors into its model in memory.
- NCCL or CUDA IPC (GPU only, UNTESTED ON THIS MACHINE: the CI machine has no GPU). `WeightSyncGroup`
  below drives vLLM's own weight-transfer engines: an NCCL broadcast group between actor rank 0 and
  every engine worker (rank 0 sends, engine e's tensor-parallel workers are ranks 1 + e*tp ...), or
  CUDA IPC handles when the engines share the actor's GPUs (`placement.colocate_all`), since NCCL
  cannot put two ranks on one GPU. The engine side is set up by `VLLMEngine` (it starts vLLM with
  the matching `weight_transfer_config`).

Nothing here imports Ray or vLLM at import time.
"""

from __future__ import annotations


class EngineClient:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`) over our RolloutWorker actors.

    vLLM's client for Ray treats several handles as data-parallel replicas of one engine, which
    number their own NCCL ranks; our engines are independent, so each gets its own rank offset here.
    """

    def __init__(self, workers: list, tensor_parallel_size: int):
        self.workers = workers
        self.tensor_parallel_size = tensor_parallel_size

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        import ray

        refs = []
        for i, worker in enumerate(self.workers):
            info = dict(init_info)
            if "rank_offset" in info:  # NCCL only; IPC needs no ranks
                info["rank_offset"] += i * self.tensor_parallel_size
            refs.append(worker.init_weight_transfer.remote(info))
        ray.get(refs)

    def start_weight_update(self) -> None:
        import ray

        ray.get([w.start_weight_update.remote() for w in self.workers])

    def update_weights(self, update_info: dict) -> None:
        import ray

        ray.get([w.update_weights.remote(update_info) for w in self.workers])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        import ray

        ray.get([w.finish_weight_update.remote() for w in self.workers])


class WeightSyncGroup:
    """GPU only, untested on this machine. Pushes a policy's weights straight into the vLLM engines.

    Built on every actor rank (FSDP gathers each full tensor collectively; rank 0 sends):

        group = WeightSyncGroup(model, rollout_workers, rank=rank, tensor_parallel_size=tp,
                                backend="nccl", master_address=addr, master_port=port)
        group.push()   # after every update, on every actor rank

    Construction blocks until every engine worker has joined (NCCL rendezvous on
    `master_address:master_port`, which rank 0's node must be able to open). Backend "ipc" needs
    the engines on the same GPUs as the actor ranks, and all actor ranks in one default process group.
    """

    def __init__(self, model, rollout_workers: list, *, rank: int, tensor_parallel_size: int,
                 backend: str = "nccl", master_address: str = "", master_port: int = 0):
        from vllm.distributed.weight_transfer.base import ModuleSource

        client = EngineClient(rollout_workers, tensor_parallel_size)
        source = ModuleSource(model)  # named_parameters(): Hugging Face names; full_tensor() under FSDP
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                       NCCLTrainerWeightTransferEngine)

            info = NCCLTrainerInitInfo(master_address=master_address, master_port=master_port,
                                       world_size=1 + len(rollout_workers) * tensor_parallel_size, rank=rank)
            self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        elif backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import (IPCTrainerInitInfo,
                                                                      IPCTrainerWeightTransferEngine)

            self.transfer = IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=rank), client=client,
                                                                        source=source)
        else:
            raise ValueError(f"unknown weight sync backend {backend!r}: use nccl or ipc")

    def push(self) -> None:
        """Send every parameter; returns when the engines have loaded them."""
        self.transfer.send_weights()

    def close(self) -> None:
        self.transfer.shutdown()

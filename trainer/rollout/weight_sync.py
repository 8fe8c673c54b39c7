"""New policy weights to the rollout engines after every update, without a disk round trip.

Two paths (docs/vllm.md, "How the weights get to the engines"):

- Object store (CPU, and the default everywhere; tested end to end). Actor rank 0 gathers the full
  state dict (Hugging Face names, CPU tensors) and returns it from `PolicyWorker.weights`; Ray keeps
  that one copy in the object store and every `RolloutWorker.load_weights` reads it from there
  (`WeightPush` below, which the driver calls once per step). Each engine copies the tensors into its model in memory.
- NCCL or CUDA IPC (GPU only). `WeightSyncGroup` below drives vLLM's own weight-transfer engines
  (vLLM 0.32): an NCCL broadcast group between actor rank 0 and every engine worker (rank 0 sends,
  engine e's tensor-parallel workers are ranks 1 + e*tp ...), or CUDA IPC handles when the engines
  share the actor's GPUs (`placement.colocate_all`), since NCCL cannot put two ranks on one GPU. The
  engine side is set up by `VLLMEngine` (it starts vLLM with the matching `weight_transfer_config`,
  and with VLLM_ALLOW_INSECURE_SERIALIZATION=1 for IPC, without which the handles cannot reach vLLM's
  engine-core process).

What is tested on CPU (tests/rollout/test_vllm_weight_sync.py, contract tests against the installed vLLM):
`EngineClient` has the methods and parameters of vLLM's `VLLMWeightSyncClient` protocol; the init and
update payloads that vLLM's trainer-side engines build pass through `EngineClient`, `VLLMEngine` and
vLLM's own `LLM` methods, the msgpack encoding of `LLM.collective_rpc` and vLLM's engine-side parsing;
each engine worker gets a distinct NCCL rank (vLLM's own rank arithmetic); the sender calls
start_weight_update, then update_weights, then finish_weight_update; the IPC payload needs the
serialisation switch. There the NCCL group creation and broadcast, and the CUDA device queries and IPC
export (CPU shared-memory handles stand in), are stubbed. Not yet run on a GPU: the NCCL rendezvous
and broadcast, CUDA IPC itself, and sleep mode.

Every wait on an engine is bounded (`timeout_s`, trainer.worker_timeout_s): an engine that never
answers ends the run with a WorkerTimeout naming it. The NCCL rendezvous inside vLLM
(`StatelessProcessGroup`) has its own timeout.

Nothing here imports Ray or vLLM at import time.
"""

from __future__ import annotations

from typing import Literal

from ..waiting import get_all
from .vllm_engine import engines_sleep

DEFAULT_TIMEOUT_S = 600.0

PushMode = Literal["none", "object_store", "nccl"]


class WeightPush:
    """The driver's side of the weight sync: after every update, the new policy weights to every engine,
    by the one path this run uses, chosen once here.

    - "none": the rollout runs inside the actor (`placement.rollout_in_actor`), which generates with the
      weights it trains: nothing to push.
    - "object_store": actor rank 0's state dict goes into Ray's object store once and every engine loads
      it after the batch it is generating (`RolloutQueue.push`); the driver does not wait.
    - "nccl": vLLM engines on GPUs next to a CUDA actor: the actor ranks broadcast the weights over NCCL
      (CUDA IPC when colocated, `WeightSyncGroup`); the driver waits for the broadcast.

    Engines that sleep between rollouts (`rollout.sleep_between_rollouts`, always under
    `placement.colocate_all`) give their GPU memory to the update (`release_engines`) and are woken around
    the load, on every path: the weights first, then, once the new weights are in, the KV cache. After
    every push each engine is fully awake. Where the engines share the trainers' GPUs (`colocate_all`),
    the trainers first hand back the memory their allocator keeps cached from the update
    (`release_memory`): vLLM wakes into its own allocator, which cannot use those blocks.

        push = WeightPush(cfg, roles, queue)   # opens the NCCL group where that is the path
        push.release_engines()                 # after the rollout
        timings = push(after=update_refs)      # after the update was sent
    """

    def __init__(self, cfg, roles, queue):
        self.roles = roles
        self.queue = queue
        self.timeout_s = cfg.trainer.worker_timeout_s
        self.sleeps = engines_sleep(cfg)
        self.neighbours = self.gpu_neighbours(cfg, roles)
        self.mode: PushMode = self.choose(cfg, roles)
        if self.mode == "nccl":
            self.open_group()

    @staticmethod
    def choose(cfg, roles) -> PushMode:
        """NCCL only where the actor really computes on CUDA and the engines are vLLM on GPUs: a
        rehearsal on logical GPUs keeps the object store."""
        if roles.rollout_in_actor:
            return "none"
        engines_on_gpu = (
            cfg.rollout.gpus_per_engine > 0 or cfg.rollout.tensor_parallel_size > 1 or cfg.placement.colocate_all
        )
        if cfg.rollout.engine != "vllm" or cfg.actor.gpus_per_node <= 0 or not engines_on_gpu:
            return "object_store"
        on_cuda = roles.actor.where()[0]["device"].startswith("cuda")
        return "nccl" if on_cuda else "object_store"

    @staticmethod
    def gpu_neighbours(cfg, roles) -> list:
        """The role groups whose workers compute on the engines' GPUs: under `placement.colocate_all` the
        actor and its guests (critic, reward workers); [] where the engines own their GPUs."""
        if not cfg.placement.colocate_all or roles.rollout_in_actor:
            return []
        groups = [roles.actor, getattr(roles, "critic", None), getattr(roles, "reward", None)]
        return [g for g in groups if g is not None]

    def open_group(self) -> None:
        """Every actor rank joins the NCCL group with every engine worker (rank 0's address)."""
        import ray

        actor = self.roles.actor
        addr, port = ray.get(actor.workers[0].master_address.remote())
        get_all(
            [w.open_weight_sync.remote(self.roles.rollout.workers, addr, port) for w in actor.workers],
            actor.labels(),
            self.timeout_s,
            f"opening the weight sync with the engines at {addr}:{port}",
        )

    def release_engines(self) -> None:
        """With sleep mode, the engines free their weights and KV cache once the rollout is taken."""
        if not self.sleeps:
            return
        engines = self.roles.rollout
        get_all(
            [e.sleep.remote() for e in engines.workers],
            engines.labels(),
            self.timeout_s,
            "putting the engines to sleep",
        )

    def __call__(self, after: list = ()) -> dict[str, float]:
        """Push the weights once the update calls `after` are done. Returns the engines' load timings
        (on the object store path, those of the previous push: `RolloutQueue.push`)."""
        import ray

        if self.mode == "none":
            return {}
        engines, actor = self.roles.rollout, self.roles.actor
        if self.mode == "nccl" or self.sleeps:
            ray.wait(list(after), num_returns=len(after))  # the update first: its failure raises when collected
        if self.sleeps and self.neighbours:  # the update's cached blocks back to the GPU before vLLM wakes
            workers = [w for g in self.neighbours for w in g.workers]
            labels = [label for g in self.neighbours for label in g.labels()]
            get_all([w.release_memory.remote() for w in workers], labels, self.timeout_s, "releasing cached memory")
        if self.sleeps:  # weights first; the KV cache only once the new weights are in
            get_all(
                [e.wake_weights.remote() for e in engines.workers],
                engines.labels(),
                self.timeout_s,
                "waking the engines",
            )
        if self.mode == "nccl":  # the actor drives the engines' side, each after its batch in flight
            self.queue.pushed_by_actor()
            get_all([w.push_weights.remote() for w in actor.workers], actor.labels(), self.timeout_s, "the weight sync")
            timings = {}
        else:
            weights = [w.weights.remote() for w in actor.workers]
            timings = self.queue.push(weights[0], weights[1:], actor.labels()[1:])
            if self.sleeps:
                timings = self.queue.settle()
        if self.sleeps:
            get_all(
                [e.wake_kv_cache.remote() for e in engines.workers],
                engines.labels(),
                self.timeout_s,
                "allocating the engines' KV cache",
            )
        return timings


class EngineClient:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`) over our RolloutWorker actors.

    vLLM's client for Ray treats several handles as data-parallel replicas of one engine, which
    number their own NCCL ranks; our engines are independent, so each gets its own rank offset here.
    """

    def __init__(self, workers: list, tensor_parallel_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.workers = workers
        self.tensor_parallel_size = tensor_parallel_size
        self.timeout_s = timeout_s
        self.labels = [f"rollout engine {i}" for i in range(len(workers))]

    def _wait(self, refs: list, what: str) -> None:
        get_all(refs, self.labels, self.timeout_s, what)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        refs = []
        for i, worker in enumerate(self.workers):
            info = dict(init_info)
            if "rank_offset" in info:  # NCCL only; IPC needs no ranks
                info["rank_offset"] += i * self.tensor_parallel_size
            refs.append(worker.init_weight_transfer.remote(info))
        self._wait(refs, "opening the weight-sync channel to the rollout engines")

    def start_weight_update(self) -> None:
        self._wait([w.start_weight_update.remote() for w in self.workers], "starting a weight update")

    def update_weights(self, update_info: dict) -> None:
        self._wait([w.update_weights.remote(update_info) for w in self.workers], "receiving new weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._wait([w.finish_weight_update.remote() for w in self.workers], "finishing a weight update")


def cast_source(model, dtype=None, device=None):
    """vLLM's weight source over `model.named_parameters()`, sending `dtype` (the engines' dtype, e.g. bf16
    from fp32 master weights: half the bytes on the wire) and on `device` when given. The device matters
    with `actor.cpu_offload=true`: FSDP2 then gathers each full tensor on the CPU, but NCCL's broadcast
    and CUDA IPC both need it on this rank's GPU."""
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, materialize_full_tensor

    if dtype is None and device is None:
        return ModuleSource(model)

    class CastSource(ModuleSource):
        def metadata(self) -> list:
            return [ParamMeta(m.name, dtype or m.dtype, m.shape) for m in super().metadata()]

        def __iter__(self):
            for name, param in self._module.named_parameters():
                yield name, materialize_full_tensor(param).to(device=device, dtype=dtype)

    return CastSource(model)


def send_device():
    """Where the weight push puts each tensor before vLLM sends it: this rank's GPU (None on a CPU rank)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


class WeightSyncGroup:
    """GPU only, not yet run on a GPU. Pushes a policy's weights straight into the vLLM engines.

    Built on every actor rank (FSDP gathers each full tensor collectively; rank 0 sends):

        group = WeightSyncGroup(model, rollout_workers, rank=rank, tensor_parallel_size=tp,
                                backend="nccl", master_address=addr, master_port=port, timeout_s=600)
        group.push()   # after every update, on every actor rank

    Construction blocks until every engine worker has joined (NCCL rendezvous on
    `master_address:master_port`, which rank 0's node must be able to open). Backend "ipc" needs
    the engines on the same GPUs as the actor ranks, and all actor ranks in one default process group.
    `timeout_s` bounds every wait on an engine (WorkerTimeout naming the engines that did not answer).
    """

    def __init__(
        self,
        model,
        rollout_workers: list,
        *,
        rank: int,
        tensor_parallel_size: int,
        backend: str = "nccl",
        master_address: str = "",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dtype=None,
    ):
        client = EngineClient(rollout_workers, tensor_parallel_size, timeout_s=timeout_s)
        source = cast_source(model, dtype, send_device())  # Hugging Face names; full_tensor() under FSDP
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            info = NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=1 + len(rollout_workers) * tensor_parallel_size,
                rank=rank,
            )
            self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        elif backend == "ipc":
            import torch
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

            # Packed: one bounded buffer (1 GiB) at a time instead of a full copy of the model per rank.
            # vLLM's packed producer runs on CUDA streams, so the CPU rehearsal (shared-memory handles
            # standing in for CUDA IPC) sends unpacked.
            self.transfer = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=rank, packed=torch.cuda.is_available()),
                client=client,
                source=source,
            )
        else:
            raise ValueError(f"unknown weight sync backend {backend!r}: use nccl or ipc")

    def push(self) -> None:
        """Send every parameter; returns when the engines have loaded them."""
        self.transfer.send_weights()

"""New policy weights to the rollout engines after every update, without a disk round trip.

Two paths (docs/vllm.md, "How the weights get to the engines"):

- Object store (CPU, and the default everywhere; tested end to end). Actor rank 0 gathers the full
  state dict (Hugging Face names, CPU tensors) and returns it from `PolicyWorker.weights`; Ray keeps
  that one copy in the object store and every `RolloutWorker.load_weights` reads it from there
  (`WeightPush` below, which the driver calls once per step). Each engine copies the tensors into its model in memory.
- NCCL or CUDA IPC (GPU only). `WeightSyncGroup` below drives vLLM's own weight-transfer engines
  (vLLM 0.32): an NCCL broadcast group between actor rank 0 and every engine worker (rank 0 sends,
  engine e's tp x pp workers are ranks 1 + e*tp*pp ..., `group_ranks`), or CUDA IPC handles when the engines
  share the actor's GPUs (`placement.colocate_all`), since NCCL cannot put two ranks on one GPU. The
  engine side is set up by `VLLMEngine` (it starts vLLM with the matching `weight_transfer_config`,
  and with VLLM_ALLOW_INSECURE_SERIALIZATION=1 for IPC, without which the handles cannot reach vLLM's
  engine-core process). The vLLM names that differ between its supported releases (0.32, 0.33) are
  vllm_compat.py's. SGLang engines on their own GPUs get the same NCCL broadcast through SGLang's own
  group (`init_weights_update_group`, `update_weights_from_distributed`): `SGLangTransfer` below.

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

import math
from typing import Literal, NamedTuple

from ..config import TrainerConfig
from ..hangs import WATCH
from ..waiting import get_all
from . import vllm_compat
from .sglang_engine import WEIGHT_GROUP
from .vllm_engine import engines_sleep, transfer_backend

DEFAULT_TIMEOUT_S = TrainerConfig.worker_timeout_s
"""Every wait on an engine, where the caller passes no trainer.worker_timeout_s (tests and benches)."""

PushMode = Literal["none", "object_store", "nccl"]


class WeightPush:
    """The driver's side of the weight sync: after every update, the new policy weights to every engine,
    by the one path this run uses, chosen once here.

    - "none": the rollout runs inside the actor (`placement.rollout_in_actor`), which generates with the
      weights it trains: nothing to push.
    - "object_store": actor rank 0's state dict goes into Ray's object store once and every engine loads
      it after the batch it is generating (`RolloutQueue.push`); the driver does not wait.
    - "nccl": vLLM engines on GPUs next to a CUDA actor: the actor ranks broadcast the weights over NCCL
      (CUDA IPC when colocated, `WeightSyncGroup`); the driver waits for the broadcast. Likewise SGLang
      engines on their own GPUs, over SGLang's group (`SGLangTransfer`).

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
        """From the placement: the GPUs the engines hold in what Ray reserved (`roles.engine_gpus`), and whether
        the actor really computes on CUDA there (`where()`; logical GPUs rehearsed on CPU do not). `push_mode`
        decides."""
        if roles.rollout_in_actor:
            return "none"
        actor_on_cuda = roles.actor.where()[0]["device"].startswith("cuda")
        return push_mode(cfg, actor_on_cuda, roles.engine_gpus)

    @property
    def engines_replaceable(self) -> bool:
        """Whether a lost engine can be replaced mid-run: the weights reach the engines through the object
        store, from the queue, and no engine sleeps. An NCCL group cannot lose a member, and sleeping engines
        share the trainers' GPUs (a lost one is a lost training node): both go through recovery.py's restart."""
        return self.mode == "object_store" and not self.sleeps

    def describe(self, cfg) -> str:
        """The line a run prints once at start: how the weights reach the engines."""
        if self.mode == "none":
            return "weight push: none (the actor's workers generate with the weights they train)"
        gpus = f"{self.roles.engine_gpus:g}"
        if self.mode == "nccl":
            how = {"nccl": "NCCL", "ipc": "CUDA IPC", "sglang": "NCCL (SGLang's group)"}[transfer_backend(cfg)]
            return f"weight push: {how}, {gpus} engine GPU(s), {cfg.model.dtype}"
        where = f"{gpus} engine GPU(s)" if gpus != "0" else "engines on CPU"
        return f"weight push: Ray object store ({where}, {cfg.model.dtype})"

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

        if self.mode == "none":
            return {}
        engines, actor = self.roles.rollout, self.roles.actor
        if self.mode == "nccl" or self.sleeps:  # the update first: its failure raises when collected
            WATCH.wait("actor update", list(after), actor.labels(), "the actor's update", fetch=False)
        if self.mode == "nccl":
            # Every actor rank enters collectives (FSDP's gathers, then the broadcast) as soon as its push
            # starts, and an engine joins only after the batches started before it (max_staleness=k starts up to
            # k before the update). A long generation would hold the ranks inside a collective past the NCCL
            # watchdog's timeout; so the push starts once those batches are done (their results wait in the
            # object store), which costs nothing: the engines could not load the weights any sooner.
            generating, labels = self.queue.generating()
            WATCH.wait("generation", generating, labels, "generating the batches in flight", fetch=False)
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
            pushes = [w.push_weights.remote() for w in actor.workers]
            timings = get_all(pushes, actor.labels(), self.timeout_s, "the weight sync")[0] or {}  # rank 0's split
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


def group_ranks(num_engines: int, tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> tuple[int, list[int]]:
    """The NCCL weight-sync group's world size and each engine's rank offset: actor rank 0 is rank 0, then
    every engine's tensor x pipeline parallel workers in turn (vLLM numbers a worker rank_offset plus its
    rank in the engine, which runs over tp x pp), wherever on the cluster those workers run."""
    per_engine = tensor_parallel_size * pipeline_parallel_size
    return 1 + num_engines * per_engine, [1 + e * per_engine for e in range(num_engines)]


class EngineClient:
    """vLLM's weight-sync client protocol (`VLLMWeightSyncClient`) over our RolloutWorker actors.

    vLLM's client for Ray treats several handles as data-parallel replicas of one engine, which
    number their own NCCL ranks; our engines are independent, so each gets its own rank offset here.
    """

    def __init__(
        self,
        workers: list,
        tensor_parallel_size: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pipeline_parallel_size: int = 1,
    ):
        self.workers = workers
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.timeout_s = timeout_s
        self.labels = [f"rollout engine {i}" for i in range(len(workers))]

    def _wait(self, refs: list, what: str) -> None:
        get_all(refs, self.labels, self.timeout_s, what)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        refs = []
        for i, worker in enumerate(self.workers):
            info = dict(init_info)
            if "rank_offset" in info:  # NCCL only; IPC needs no ranks
                info["rank_offset"] += i * self.tensor_parallel_size * self.pipeline_parallel_size
            refs.append(worker.init_weight_transfer.remote(info))
        self._wait(refs, "opening the weight-sync channel to the rollout engines")

    def start_weight_update(self) -> None:
        self._wait([w.start_weight_update.remote() for w in self.workers], "starting a weight update")

    def update_weights(self, update_info: dict) -> None:
        self._wait([w.update_weights.remote(update_info) for w in self.workers], "receiving new weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._wait([w.finish_weight_update.remote() for w in self.workers], "finishing a weight update")


class ParamInfo(NamedTuple):
    """One tensor of a weight push: its name, the dtype it is sent in and its full shape."""

    name: str
    dtype: object
    shape: tuple[int, ...]


def full_tensor(param, dtype=None):
    """The whole tensor of a parameter: FSDP2's DTensor shards are gathered (a collective, called in the same
    order on every rank), a plain tensor is itself. With `dtype` each rank casts its shard first, so the
    gather moves the engines' dtype (bf16: half the bytes of the fp32 master weights)."""
    gather = getattr(param, "full_tensor", None)
    if not callable(gather):
        return param
    if dtype is not None and param.dtype != dtype:
        return param.detach().to(dtype).full_tensor()
    return gather()


class CastSource:
    """A policy's weights for a push: `metadata()` (names, dtypes, full shapes, without a gather) and
    iteration ((name, full tensor) in the same order). vLLM's engines take it through
    `vllm_compat.weight_source`, SGLang's through `SGLangTransfer`."""

    def __init__(self, model, dtype=None, device=None, adapters=None):
        self.model, self.dtype, self.device, self.adapters = model, dtype, device, adapters

    def metadata(self) -> list[ParamInfo]:
        if self.adapters is not None:
            shapes = self.adapters.merged_shapes(self.model)
        else:
            shapes = [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]
        return [ParamInfo(n, self.dtype or d, tuple(s)) for n, d, s in shapes]

    def __iter__(self):
        """(name, full tensor) in `metadata()`'s order. Counts, for the push's metrics, the time spent gathering
        and casting (`gather_seconds()`, apart from what the consumer does with each tensor: the send) and the
        bytes yielded (`nbytes`)."""
        if self.adapters is not None:
            named = self.adapters.merged_parameters(self.model, full_tensor)
        else:
            named = ((n, full_tensor(p, self.dtype)) for n, p in self.model.named_parameters())
        self.spans, self.nbytes = [], 0
        on_cuda = self.device is not None and self.device.type == "cuda"
        named = iter(named)
        while True:
            span = _Span(on_cuda)
            item = next(named, None)  # the gather (FSDP2's full_tensor) runs here
            if item is None:
                return
            name, tensor = item
            if self.device is not None or self.dtype is not None:
                tensor = tensor.to(device=self.device, dtype=self.dtype)
            self.spans.append(span.end())
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def gather_seconds(self) -> float:
        """Seconds the last iteration spent gathering and casting (on a GPU the device's time between CUDA
        events, read once here after the send, so the gathers are timed without waiting for each)."""
        return sum(span.seconds() for span in getattr(self, "spans", []))


class _Span:
    """A timed stretch of the weight source's work: CUDA events on a GPU (no wait for the device until
    `seconds()`), the host's clock otherwise."""

    def __init__(self, on_cuda: bool):
        import time

        self.events = None
        if on_cuda:
            import torch

            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.start, self.stop = time.perf_counter(), None

    def end(self) -> _Span:
        import time

        if self.events is not None:
            self.events[1].record()
        self.stop = time.perf_counter()
        return self

    def seconds(self) -> float:
        if self.events is None:
            return self.stop - self.start
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def cast_source(model, dtype=None, device=None, adapters=None) -> CastSource:
    """The weight source over `model.named_parameters()`, sending `dtype` (the engines' dtype, e.g. bf16
    from fp32 master weights: half the bytes on the wire) and on `device` when given. The device matters
    with `actor.cpu_offload=true`: FSDP2 then gathers each full tensor on the CPU, but NCCL's broadcast
    and CUDA IPC both need it on this rank's GPU. `adapters` (a LoRA actor's inputs.lora.Adapters): the
    plain model's parameters instead, by its names, each adapted weight merged with its adapter."""
    return CastSource(model, dtype, device, adapters)


def send_device():
    """Where the weight push puts each tensor before vLLM sends it: this rank's GPU (None on a CPU rank)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


class WeightSyncGroup:
    """GPU only, not yet run on a GPU. Pushes a policy's weights straight into the vLLM engines (backend nccl
    or ipc), or into SGLang engines on their own GPUs (backend sglang: `SGLangTransfer`).

    Built on every actor rank (FSDP gathers each full tensor collectively; rank 0 sends):

        group = WeightSyncGroup(model, rollout_workers, rank=rank, tensor_parallel_size=tp,
                                backend="nccl", master_address=addr, master_port=port, timeout_s=cfg.trainer.worker_timeout_s)
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
        pipeline_parallel_size: int = 1,
        backend: str = "nccl",
        master_address: str = "",
        master_port: int = 0,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        dtype=None,
        adapters=None,
        bucket_mb: int = 1024,
    ):
        client = EngineClient(
            rollout_workers, tensor_parallel_size, timeout_s=timeout_s, pipeline_parallel_size=pipeline_parallel_size
        )
        # Hugging Face names; full_tensor() under FSDP; LoRA merged (`adapters`)
        self.source = source = cast_source(model, dtype, send_device(), adapters)
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            info = NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=group_ranks(len(rollout_workers), tensor_parallel_size, pipeline_parallel_size)[0],
                rank=rank,
            )
            self.transfer = NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=client, source=vllm_compat.weight_source(source)
            )
        elif backend == "ipc":
            import torch
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

            # Packed: one bounded buffer (1 GiB) at a time instead of a full copy of the model per rank.
            # vLLM's packed producer runs on CUDA streams, so the CPU rehearsal (shared-memory handles
            # standing in for CUDA IPC) sends unpacked.
            self.transfer = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=rank, packed=torch.cuda.is_available()),
                client=client,
                source=vllm_compat.weight_source(source),
            )
        elif backend == "sglang":
            self.transfer = SGLangTransfer(
                source,
                rollout_workers,
                rank=rank,
                tensor_parallel_size=tensor_parallel_size,
                master_address=master_address,
                master_port=master_port,
                timeout_s=timeout_s,
                bucket_bytes=bucket_mb << 20,
            )
        else:
            raise ValueError(f"unknown weight sync backend {backend!r}: use nccl, ipc or sglang")

    def push(self) -> dict[str, float]:
        """Send every parameter; returns when the engines have loaded them, with the push's split:
        `timing/push_gather` (gathering and casting the full tensors, `CastSource.gather_seconds`),
        `timing/push_broadcast` (the rest: the sends and the engines' loads) and `perf/push_gb_per_s` (the bytes
        sent, one copy, over the whole push)."""
        import time

        start = time.perf_counter()
        self.transfer.send_weights()
        total = max(time.perf_counter() - start, 1e-9)
        gather = min(self.source.gather_seconds(), total)
        return {
            "timing/push_gather": gather,
            "timing/push_broadcast": total - gather,
            "perf/push_gb_per_s": getattr(self.source, "nbytes", 0) / total / 1e9,
        }


def open_torch_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
    rank: int = 0,
    backend: str = "nccl",
):
    """A torch process group of `world_size` ranks that meet at `master_address:master_port` (rank 0 hosts the
    TCP store there), this process being `rank`. SGLang's workers create theirs with the same torch calls
    (`init_weights_update_group`: a `tcp://` rendezvous, the store's keys prefixed with the group name, the
    group made by torch's own group helper), so that both sides find each other's keys. Rank 0's store listens on
    `master_address` alone."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from ..rendezvous import listening_store

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:  # the store's server, on master_address alone (torch's own would listen on every interface)
        store = listening_store(master_address, world_size, timeout, port=master_port)
    else:
        host = f"[{master_address}]" if ":" in master_address else master_address  # an IPv6 address
        url = f"tcp://{host}:{master_port}"
        store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    return group


def tensor_bytes(meta) -> int:
    """The bytes of one announced tensor (`TensorMeta`: its dtype and full shape)."""
    return math.prod(meta.shape) * meta.dtype.itemsize


def weight_buckets(meta: list, limit: int) -> list[list]:
    """`meta` in order, cut into consecutive buckets of at most `limit` bytes (a larger tensor alone)."""
    buckets: list[list] = []
    size = 0
    for m in meta:
        if buckets and size + tensor_bytes(m) <= limit:
            buckets[-1].append(m)
            size += tensor_bytes(m)
        else:
            buckets.append([m])
            size = tensor_bytes(m)
    return buckets


def push_mode(cfg, actor_on_cuda: bool, engine_gpus: int) -> PushMode:
    """How the weights reach the engines, from where placement put them: a GPU collective (NCCL, or CUDA IPC
    inside the same call where vLLM engines share the actor's GPUs) whenever the actor computes on CUDA and
    the engines hold GPUs, whatever their tensor parallelism; the Ray object store where the engines are on
    CPU, or the GPUs are logical (a CPU rehearsal), or the engine cannot take a GPU push: the HF engine, and
    SGLang colocated with the actor (no CUDA IPC path yet) or with pipeline parallelism (SGLang numbers a
    worker rank_offset + its tp rank)."""
    r = cfg.rollout
    sglang_nccl = r.engine == "sglang" and not cfg.placement.colocate_all and r.pipeline_parallel_size == 1
    if not (r.engine == "vllm" or sglang_nccl):
        return "object_store"
    return "nccl" if actor_on_cuda and engine_gpus > 0 else "object_store"


class SGLangTransfer:
    """GPU only, not yet run on a GPU. The trainer side of SGLang's NCCL weight update, for SGLang engines on
    their own GPUs: the same call sequence as vLLM's NCCL path, over SGLang's own group.

    Actor rank 0 is rank 0 of SGLang's group; engine e's workers are ranks 1 + e*tp ... (`group_ranks`;
    SGLang numbers a worker rank_offset + its tp rank, so engines with pipeline parallelism keep the object
    store: `WeightPush.choose`). Opening: rank 0 asks every engine to join (`init_weights_update_group`,
    which blocks in the rendezvous), joins itself (`open_group`, default `open_torch_group`), then waits for
    the engines. Each push: every actor rank iterates the source (FSDP2 gathers each full tensor
    collectively); rank 0 sends them in buckets of at most `bucket_bytes` (rollout.weight_push_bucket_mb; a
    larger tensor alone): per bucket it asks every engine to receive (`update_weights_from_distributed` with
    the bucket's names, dtypes and shapes; SGLang allocates all of a call's receive buffers at once), broadcasts
    each tensor in that order and waits for the engines; the last bucket flushes the engines' prefix cache; then
    it finishes the update. Other actor ranks make no engine calls. Every wait on an engine is bounded by
    `timeout_s`.
    """

    def __init__(
        self,
        source,
        rollout_workers: list,
        *,
        rank: int,
        tensor_parallel_size: int,
        master_address: str,
        master_port: int,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        open_group=None,
        bucket_bytes: int = 1 << 30,
    ):
        self.source = source
        self.bucket_bytes = bucket_bytes
        self.workers = rollout_workers
        self.labels = [f"rollout engine {i}" for i in range(len(rollout_workers))]
        self.timeout_s = timeout_s
        self.group = None
        if rank != 0:
            return
        world_size, offsets = group_ranks(len(rollout_workers), tensor_parallel_size)
        where = f"{master_address}:{master_port}"
        refs = [
            w.init_weight_transfer.remote(
                dict(master_address=master_address, master_port=master_port, rank_offset=o, world_size=world_size)
            )
            for w, o in zip(rollout_workers, offsets)
        ]
        # The engines wait in the rendezvous for rank 0, so they are asked first and waited for last.
        self.group = (open_group or open_torch_group)(master_address, master_port, world_size, WEIGHT_GROUP, timeout_s)
        get_all(refs, self.labels, timeout_s, f"opening SGLang's weight-update group at {where}")

    def _engines(self, method: str, what: str, *args) -> None:
        get_all([getattr(w, method).remote(*args) for w in self.workers], self.labels, self.timeout_s, what)

    def send_weights(self) -> None:
        """Send every tensor; returns when the engines have loaded them."""
        if self.group is None:
            for _ in self.source:  # only the gathers, in step with rank 0
                pass
            return
        meta = self.source.metadata()
        buckets = weight_buckets(meta, self.bucket_bytes)
        self._engines("start_weight_update", "starting a weight update")
        tensors = iter(self.source)
        for i, bucket in enumerate(buckets, 1):
            update = dict(
                names=[m.name for m in bucket],
                dtypes=[str(m.dtype).removeprefix("torch.") for m in bucket],
                shapes=[list(m.shape) for m in bucket],
                flush_cache=i == len(buckets),
            )
            # The engines wait in the broadcasts: asked first, waited for once the bucket is sent.
            refs = [w.update_weights.remote(update) for w in self.workers]
            for expected in bucket:
                name, tensor = next(tensors, (None, None))
                if name != expected.name or tuple(tensor.shape) != expected.shape:
                    got = "nothing" if name is None else f"{name!r} {tuple(tensor.shape)}"
                    raise ValueError(
                        f"the weight source yielded {got} where its metadata announced {expected.name!r} "
                        f"{expected.shape}: the engines would load the wrong tensors"
                    )
                self.group.broadcast(tensor.contiguous(), 0).wait()
            mib = sum(tensor_bytes(m) for m in bucket) / 2**20
            what = f"receiving bucket {i}/{len(buckets)} ({len(bucket)} tensors, {mib:.0f} MiB) over SGLang's group"
            get_all(refs, self.labels, self.timeout_s, what)
        if next(tensors, None) is not None:
            raise ValueError("the weight source yielded more tensors than its metadata announced")
        self._engines("finish_weight_update", "finishing a weight update")

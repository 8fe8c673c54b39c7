"""What every role's worker shares: the forward passes, the process group, and the training step.

`WorkerBase` holds a worker's config, rank and device; `TrainableWorker` adds the fp32 master weights,
FSDP2 sharding after the process group exists, the optimizer and the data-parallel gradient step that
the policy and the critic share (workers.py). No Ray at import time.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..algo import ppo_math as pm
from ..algo.batch import Batch, position_ids
from ..algo.step_stats import Accumulator
from ..config import config_from_dict
from ..errors import TrainerError
from ..hangs import arm_stack_dump
from ..inputs.models import dtype_of
from ..rendezvous import listening_store
from .fsdp import ModelKind
from .packing import micro_batches, pack, packing_gap, refuse_inexact_packing, use_attention


def forward_logprobs(
    model, batch: Batch, temperature: float, entropy: str = "none", packed: bool = False, attention: str | None = None
):
    """Log-probs [N, R] of the response tokens under `model` at `temperature`, and their entropies
    when `entropy` is "grad" (part of the loss) or "metric" (detached, for logging). `packed`: run the
    sequences concatenated without padding (packing.py; the same results, in the same layout).
    `attention`: the attention kernel to run with (model.attn_implementation; None keeps the model's)."""
    if attention is not None:
        use_attention(model, attention)
    if packed:
        return _packed_logprobs(model, batch, temperature, entropy)
    width = batch.prompt_width
    mask = batch["attention_mask"]
    kwargs = {}
    keep = batch["input_ids"].shape[1] - width + 1  # the positions that predict response tokens (+ the last)
    if _takes_logits_to_keep(_plain_type(model)):  # skips the LM head on prompt positions (a vocab-wide matmul each)
        kwargs["logits_to_keep"] = keep
    logits = model(
        input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask), use_cache=False, **kwargs
    ).logits
    logprobs, ent = _token_stats(logits[:, -keep:-1], batch["input_ids"][:, width:], temperature, entropy)
    return logprobs * batch["response_mask"], ent


def _token_stats(logits, tokens, temperature: float, entropy: str):
    """Log-probs and (for `entropy` "grad" or "metric") entropies, in float32 chunks that keep no float32
    copy of the logits (ppo_math.token_stats_from_logits)."""
    if entropy == "none":
        return pm.token_stats_from_logits(logits, tokens, temperature), None
    logprobs, ent = pm.token_stats_from_logits(logits, tokens, temperature, entropy=True)
    return logprobs, ent if entropy == "grad" else ent.detach()


def _packed_logprobs(model, batch: Batch, temperature: float, entropy: str):
    """forward_logprobs on the packed micro-batch: the LM head runs on the response positions alone."""
    p = pack(batch)
    kwargs = {}
    if _takes_logits_to_keep(_plain_type(model)):  # a tensor of positions keeps just those
        kwargs["logits_to_keep"] = p.predict_at
    logits = model(input_ids=p.input_ids, attention_mask=None, position_ids=p.position_ids, use_cache=False, **kwargs)
    logits = logits.logits if kwargs else logits.logits[:, p.predict_at]
    logprobs, ent = _token_stats(logits, p.targets[None], temperature, entropy)
    if ent is not None:
        ent = p.unpack(ent)
    return p.unpack(logprobs) * batch["response_mask"], ent


def _plain_type(model) -> type:
    """The transformers class whose forward runs: under LoRA, peft's wrapper passes its arguments through to it."""
    return type(model.get_base_model()) if hasattr(type(model), "get_base_model") else type(model)


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def forward_values(model, batch: Batch, packed: bool = False, attention: str | None = None) -> torch.Tensor:
    """Values [N, R]: the critic's estimate before each response token (`packed`, `attention`: as in
    forward_logprobs)."""
    if attention is not None:
        use_attention(model, attention)
    if packed:
        p = pack(batch)
        out = model(input_ids=p.input_ids, attention_mask=None, position_ids=p.position_ids, use_cache=False)
        return p.unpack(out.logits[0, p.predict_at, 0].float()) * batch["response_mask"]
    width = batch.prompt_width
    mask = batch["attention_mask"]
    out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    return out.logits[:, width - 1 : -1, 0].float() * batch["response_mask"]


class WorkerBase:
    """What every role's worker has: its config, rank, device and process-group plumbing.

    A worker's constructor catches the TrainerError of a start that fails and hands it to
    `_failed_to_start`, which keeps it for `where` to raise.
    """

    role: str
    sharded = False  # TrainableWorker decides per role
    start_error: TrainerError | None = None  # why the constructor failed, inside a Ray actor

    def __init__(self, cfg_dict: dict, rank: int = 0, world_size: int = 1):
        from ..inputs.models import quiet_transformers

        quiet_transformers()
        self.cfg = config_from_dict(cfg_dict)
        self.rank = rank
        self.world_size = world_size
        # The GPUs a worker may use are the ones its CUDA_VISIBLE_DEVICES names (Ray sets it for ranks
        # that own GPUs, the launcher for colocated workers, "" for CPU-only workers); on a machine
        # without CUDA the same layout runs on CPU (a rehearsal with logical GPUs).
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(self.cfg.trainer.seed + rank)

    def _failed_to_start(self, exc: TrainerError, rank: int) -> None:
        """A worker that cannot start (a model that cannot load, a reward file missing on its node) ends
        the run with one line naming its role, rank and node. Inside a Ray actor the error is kept and
        raised by the worker's first call, `where()` (launch_roles waits on it for every worker): raised
        from the constructor, Ray would print its traceback into the job's log and hand back only its
        text. A worker built directly (tests, benchmarks) raises it at once."""
        try:
            import ray
        except ImportError:  # built in-process where Ray is not installed (bench/gpu_smoke.py on a GPU image)
            raise exc from None
        error = type(exc)(f"{self.role} rank {rank} on node {ray.util.get_node_ip_address()}: {exc}")
        if not (ray.is_initialized() and ray.get_runtime_context().get_actor_id()):
            raise error from exc  # built directly, not as an actor
        self.start_error = error

    def where(self) -> dict:
        """Node, process and GPU ids of this worker (the placement log, and the colocation plan). The
        first call every worker gets: it raises the error of a constructor that failed, and arms the stack
        dump the driver's hang watch asks for."""
        if self.start_error is not None:
            raise self.start_error
        import ray

        arm_stack_dump()  # from now on the driver can ask where this process is stuck (hangs.py)
        ctx = ray.get_runtime_context()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible is not None else [str(g) for g in ray.get_gpu_ids()]
        return {
            "rank": self.rank,
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": gpus,
            "device": str(self.device),
            "sharded": self.sharded,
        }

    def release_memory(self) -> None:
        """Hand the blocks torch's caching allocator keeps from the last update back to the GPU, so that
        vLLM engines sharing it (placement.colocate_all) can wake into them. Nothing to do on CPU."""
        if self.device.type == "cuda":
            gc.collect()  # tensors only a reference cycle still holds
            torch.cuda.empty_cache()

    def master_address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for a weight-sync group whose store rank 0 opens there."""
        import ray

        addr = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        return addr, port

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0's side of the role's process-group rendezvous, opened before any rank joins: a TCPStore
        server on this node's IP alone (not every interface) and on a port this process holds from the
        moment the kernel picks it (no other process can take it between choosing and binding). Returns
        the (address, port) the other ranks join."""
        import ray

        timeout = timedelta(seconds=self.cfg.trainer.worker_timeout_s)
        self.rendezvous = listening_store(ray.util.get_node_ip_address(), self.world_size, timeout)
        return self.rendezvous.host, self.rendezvous.port

    def init_process_group(self, addr: str, port: int, cpu_offload: bool = False) -> None:
        """Join the role's process group through rank 0's rendezvous (`open_rendezvous`): NCCL between
        GPUs (plus gloo for CPU tensors when FSDP keeps parameters on the host), gloo on CPU."""
        import torch.distributed as dist

        if self.device.type == "cuda":
            backend = "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"
        else:
            backend = "gloo"
        timeout = timedelta(seconds=self.cfg.trainer.worker_timeout_s)
        store = getattr(self, "rendezvous", None)
        if store is None:  # a caller that chose the address itself (bench/gpu_smoke.py): rank 0 serves it there
            master = self.rank == 0
            store = dist.TCPStore(
                addr, port, self.world_size, is_master=master, timeout=timeout, wait_for_workers=False
            )
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)


class TrainableWorker(WorkerBase):
    """Optimizer, LR schedule and the data-parallel gradient step shared by policy and critic.

    Construction loads the model with fp32 master weights; `start_training` (called once on every
    rank by ActorGroup.start_training) joins the process group, then shards and builds the optimizer.
    Compute runs in `model.dtype`: FSDP2's mixed-precision policy when sharded, autocast otherwise.
    """

    role = "actor"
    model: torch.nn.Module

    def __init__(self, cfg_dict: dict, rank: int = 0, world_size: int = 1):
        super().__init__(cfg_dict, rank, world_size)
        rc = getattr(self.cfg, self.role)
        # FSDP2 over the role's process group: NCCL on GPUs, gloo on CPU (the same code path).
        self.sharded = rc.fsdp and (self.world_size > 1 or self.device.type == "cuda")
        self.compute_dtype = dtype_of(self.cfg.model.dtype)
        self.optimizer = None
        self._read_on_rank0: dict[int, torch.nn.Module] = {}  # skeleton id -> the model rank 0 read

    def load_model(self, kind: ModelKind, path: str, dtype: str, lora: bool = False) -> torch.nn.Module:
        """The role's model from `path`. Unsharded: read here. Sharded: the skeleton on the meta device
        on every rank, and the weights read by rank 0 alone, kept until `shard` fills every rank's shard
        from them (so no other rank holds the whole model, in host memory or on its GPU). `lora`: wrapped
        with the model.lora_* adapters (inputs/lora.py), before it is sharded."""
        from ..inputs.models import load_causal_lm, load_value_model
        from .fsdp import skeleton

        load = load_value_model if kind == "value" else load_causal_lm
        trust = self.cfg.model.trust_remote_code

        def adapted(model: torch.nn.Module) -> torch.nn.Module:
            if not lora:
                return model
            from ..inputs.lora import wrap

            return wrap(model, self.cfg.model, self.cfg.trainer.seed)

        if not self.sharded:
            return adapted(load(path, dtype, trust))
        model = adapted(skeleton(kind, path, dtype_of(dtype), trust))
        if self.rank == 0:
            self._read_on_rank0[id(model)] = adapted(load(path, dtype, trust))
        return model

    def place(self, model: torch.nn.Module, compute_dtype: torch.dtype | None) -> None:
        """Put a model from `load_model` where it computes: on this worker's device, or sharded over the
        role's ranks with its weights broadcast from rank 0 (a collective when sharded); with model.compile,
        its blocks compiled."""
        if not self.sharded:
            model.to(self.device)
        else:
            from .fsdp import shard_from_rank0, shard_model

            offload = getattr(self.cfg, self.role).cpu_offload
            if not next(model.parameters()).is_meta:  # read whole here (a lone rank sharded after it loaded)
                shard_model(model, compute_dtype, cpu_offload=offload)  # FSDP2 moves each shard where it lives
            else:
                source = self._read_on_rank0.pop(id(model), None)
                shard_from_rank0(model, source, compute_dtype, offload, self.device)
        if self.cfg.model.compile:
            from .compile import compile_blocks

            compile_blocks(model, self.device)

    def start_training(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        rc = getattr(self.cfg, self.role)
        if self.world_size > 1 or self.sharded:
            if not port:  # a lone sharded rank: its own rendezvous
                addr, port = self.open_rendezvous()
            self.init_process_group(addr, port, cpu_offload=self.sharded and rc.cpu_offload)
        if self.cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.place(self.model, self.compute_dtype)
        self.model.train()
        # The fused kernel updates every parameter in one call instead of a dozen small ops each;
        # sharded (DTensor) parameters keep torch's default implementation.
        fused = True if self.device.type in ("cpu", "cuda") and not self.sharded else None
        # Only what trains: every parameter, or under LoRA the adapters alone (the frozen base has no state).
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=rc.lr, weight_decay=rc.weight_decay, fused=fused)
        warmup = rc.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        # FSDP averages gradients over ranks; plain data parallelism here sums them. Losses are
        # divided by the global token count, so the sum is the exact global token mean.
        self.grad_scale = float(self.world_size) if self.sharded else 1.0
        if self.cfg.model.pack_sequences:
            self.check_packing()

    @torch.no_grad()
    def check_packing(self) -> float:
        """model.pack_sequences' start-up self-check: one packed and one padded forward pass of the real
        model (sharded as it trains) over a few short sequences; refuses packing in one line where they
        differ (packing.packing_gap). Every rank runs it (a sharded forward pass is a collective). The gap."""
        m = self.cfg.model
        was_training = self.model.training
        self.model.eval()

        def run(batch: Batch, packed: bool) -> torch.Tensor:
            with self.autocast():
                micro = to_device(batch, self.device)
                return self.packing_check_outputs(micro, packed, m.attn_implementation)

        try:
            gap = packing_gap(run, self.model.config.vocab_size)
        finally:
            self.model.train(was_training)
        refuse_inexact_packing(gap, self.compute_dtype, m.attn_implementation)
        return gap

    def packing_check_outputs(self, micro: Batch, packed: bool, attention: str) -> torch.Tensor:
        """[N, R] per response token: what this role's forward pass produces (log-probs, values)."""
        raise NotImplementedError

    def autocast(self):
        """Compute in model.dtype over fp32 master weights (FSDP2 casts by itself when sharded)."""
        if self.sharded or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def eager_if_compiled(self):
        """Run compiled blocks eagerly inside this context (model.compile; generation with a KV cache)."""
        if not self.cfg.model.compile:
            return contextlib.nullcontext()
        from .compile import eager_blocks

        return eager_blocks()

    def add_step_stats(self, acc, started: float, shard: Batch) -> None:
        """The update's training tokens/s on this worker (prompt and response tokens, every epoch) and this
        worker's peak memory since the previous update: `memory_peaks`, the largest over ranks."""
        seconds = max(time.perf_counter() - started, 1e-9)
        acc.add(f"perf/{self.role}_tokens_per_s_per_worker", float(shard["attention_mask"].sum()) / seconds, 1.0)
        for name, gib in memory_peaks(self.device).items():
            acc.peak(f"memory/{self.role}_{name}_gib", gib)

    def _mini_batch_updates(
        self, shard: Batch, normalizers: list[float], micro_loss: Callable[[Batch, float, Accumulator], torch.Tensor]
    ) -> Accumulator:
        """The update loop of both trained roles: this rank's part of every mini-batch (`normalizers[i]`: mini-batch
        i's global loss count) in micro-batches, each micro-batch's `micro_loss(micro, normalizer, acc)` (which adds
        its statistics to `acc`) backpropagated, then one optimizer step per mini-batch."""
        rc = getattr(self.cfg, self.role)
        per_rank = shard.size // len(normalizers)
        acc = Accumulator()
        for mini, norm in zip(shard.chunks(per_rank), normalizers):
            groups = micro_batches(
                mini,
                rc.micro_batch_size,
                rc.max_tokens_per_micro_batch,
                self.cfg.model.pack_sequences,
                self.device if self.sharded else None,  # sharded ranks run as many micro-batches
            )
            for _, micro in groups:
                loss = micro_loss(to_device(micro, self.device), norm, acc)
                (loss * self.grad_scale).backward()
            acc.add(f"{self.role}/grad_norm", self._step(rc.grad_clip), 1.0)
        return acc

    def _step(self, grad_clip: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.world_size > 1 and not self.sharded:
            import torch.distributed as dist

            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # sharded: the norm over every rank's shards
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def _full_state(self, with_optimizer: bool) -> tuple[dict, dict | None]:
        """Unsharded model (and optimizer) state keyed by parameter name, on CPU. Under FSDP this
        is a collective: every rank must call it, and only rank 0 receives the tensors."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.sharded)
        # Unsharded models already hold full tensors: their state_dict is the same, and it is the
        # cheaper call on the per-step weight-sync path.
        state = get_model_state_dict(self.model, options=options) if self.sharded else self.model.state_dict()
        model_state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=options) if with_optimizer else None
        return model_state, optim_state

    def get_state(self) -> dict | None:
        """Model, optimizer and scheduler state from rank 0 (other ranks return None). Keyed by
        parameter name and unsharded, so a checkpoint loads into any number of workers."""
        if self.rank != 0 and not self.sharded:
            return None
        model_state, optim_state = self._full_state(with_optimizer=True)
        if self.rank != 0:
            return None
        return {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()}

    def set_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])

    # Sharded checkpoints (checkpoint.py, shards.py): each rank reads and writes only its own shard.
    def _state_options(self):
        """What a checkpoint holds: everything, or under LoRA what trains (the adapters; the frozen base is
        model.path's, read again on resume). Loading then sets only those: DCP's load has already failed on any
        of them the checkpoint lacks."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        lora = bool(self.cfg.model.lora_rank) and self.role == "actor"
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _sharded_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # DTensors when sharded
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._state_options())
        return {"model": model_state, "optimizer": optim_state}

    def save_shards(self, directory: str) -> tuple[dict[str, int], dict | None]:
        """Write this rank's shards of the weights and optimizer state into the DCP `directory`; a
        collective over the role's ranks. A node that does not see `directory`'s parent (no shared disk
        with the driver) writes to its scratch directory instead and keeps it for the driver to pull
        (state/transfer.py). Returns (the scratch files by name and size, {} when written in place; the
        scheduler state on rank 0)."""
        import torch.distributed.checkpoint as dcp

        from ..state import transfer

        target = directory if self.sees(os.path.dirname(directory)) else self.open_scratch()
        try:
            with _single_process_quiet():
                dcp.save(self._sharded_state(), checkpoint_id=target)
        except BaseException as exc:
            if target != directory:  # a failed save (a full scratch disk) leaves no scratch copy behind either
                self.drop_scratch()
            error = _shard_error(exc, f"{self.role} rank {self.rank}: writing its checkpoint shards to {target}")
            if error is None:
                raise
            raise error from None
        files = transfer.listing(target) if target != directory else {}
        return files, self.scheduler.state_dict() if self.rank == 0 else None

    def sees(self, directory: str) -> bool:
        """Whether this node sees the driver's `directory` (the driver's node, or a volume both mount): the
        one test of whether a rank reads and writes the driver's files in place or moves them in chunks."""
        return os.path.isdir(directory)

    # A node that does not see the driver's directory moves files through a scratch directory of its own,
    # one chunk per call (state/transfer.py). One at a time per worker: opening one drops the last.
    scratch: str | None = None

    def open_scratch(self) -> str:
        import tempfile

        self.drop_scratch()
        self.scratch = tempfile.mkdtemp(prefix="cloudrl-scratch-")
        return self.scratch

    def drop_scratch(self) -> None:
        import shutil

        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _open_scratch_dir(self) -> str:
        if self.scratch is None:
            raise TrainerError(f"{self.role} rank {self.rank}: no scratch directory is open for a file transfer")
        return self.scratch

    def scratch_files(self) -> dict[str, int]:
        from ..state import transfer

        return transfer.listing(self._open_scratch_dir())

    def read_chunk(self, name: str, offset: int, size: int) -> bytes:
        from ..state import transfer

        return transfer.read_chunk(self._open_scratch_dir(), name, offset, size)

    def write_chunk(self, name: str, offset: int, data: bytes) -> None:
        from ..state import transfer

        transfer.write_chunk(self._open_scratch_dir(), name, offset, data)

    def load_shards(self, directory: str, scheduler: dict, from_scratch: bool = False) -> None:
        """Read this rank's part of the DCP `directory` (resharded to this run's ranks); a collective.
        `from_scratch`: this node does not see `directory`, and the driver has pushed its files into this
        worker's scratch directory (state/transfer.py), dropped once read. The metadata is read as DCP's own
        classes only and non-tensor items with weights_only=True (state/checkpoint.py): a checkpoint is
        data, whatever its files hold."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from ..state.checkpoint import safe_planner, safe_reader

        source = self._open_scratch_dir() if from_scratch else directory
        try:
            state = self._sharded_state()
            with _single_process_quiet():
                dcp.load(state, checkpoint_id=source, storage_reader=safe_reader(source), planner=safe_planner())
        except BaseException as exc:
            error = _shard_error(exc, f"{self.role} rank {self.rank}: reading its checkpoint shards from {directory}")
            if error is None:
                raise
            raise error from None
        finally:
            if from_scratch:
                self.drop_scratch()
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=self._state_options(),
        )
        self.scheduler.load_state_dict(scheduler)


@dataclass
class UpdateResult:
    """What a trained role's `update` returns to the driver."""

    stats: dict
    """Token-weighted sums of the rank's statistics (step_stats.Accumulator.result); step_stats.combine merges ranks."""


GIB = float(1 << 30)


def memory_peaks(device: torch.device) -> dict[str, float]:
    """This process's peak memory since the last call, in GiB, and the peaks reset for the next one:
    `peak_rss` (host memory resident, on every device; Linux's VmHWM, reset through /proc/self/clear_refs
    where the sandbox allows it, else the peak since its last reset; without procfs the lifetime peak) and on CUDA `peak_allocated` and `peak_reserved` (the caching
    allocator's tensors, and what it holds from the GPU)."""
    peaks = {"peak_rss": _peak_rss_bytes() / GIB}
    if device.type == "cuda":
        peaks["peak_allocated"] = torch.cuda.max_memory_allocated(device) / GIB
        peaks["peak_reserved"] = torch.cuda.max_memory_reserved(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return peaks


def _peak_rss_bytes() -> float:
    try:
        with open("/proc/self/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):  # no procfs: the lifetime peak (ru_maxrss is in KiB on Linux)
        import resource

        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
    except OSError:  # a sandbox that refuses the reset: the next reading covers the steps since the last one
        pass
    return float(hwm.split()[1]) * 1024


def to_device(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch({k: v.to(device, non_blocking=True) for k, v in batch.items()})


def _shard_error(exc: BaseException, what: str) -> TrainerError | None:
    """DCP reports a rank's failure (a full disk, a refused metadata file) as a CheckpointException, a
    BaseException that would end the Ray actor as if it had died: a CheckpointError naming the first
    cause, in one line, to raise instead. None for anything else (raised unchanged)."""
    from ..errors import CheckpointError, first_line

    failures = getattr(exc, "failures", None)
    if isinstance(exc, Exception) or not isinstance(failures, dict):
        return None
    causes = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [exc]
    cause = causes[0]
    return CheckpointError(f"{what} failed ({type(cause).__name__}: {first_line(cause)[:300]})")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load of a rank without a process group (one worker, no FSDP) that
    it assumes a single process, which is exactly the case: keep job logs free of it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield

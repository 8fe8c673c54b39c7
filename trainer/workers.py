"""The roles' worker classes. `group.py` turns them into Ray actors; this module never imports Ray
at import time, so the classes can be read and tested on their own.

- PolicyWorker     trains the policy (one data-parallel rank); can hold the frozen reference too,
                   and can generate with the policy itself (placement.rollout_in_actor).
- CriticWorker     trains the value model (one data-parallel rank).
- ReferenceWorker  frozen initial policy, for the KL term.
- RewardWorker     rule-based reward functions, plus an optional reward model.
- RolloutWorker    a generation engine (transformers or vLLM) that receives new weights each step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import time
from datetime import timedelta

import torch

from . import ppo_math as pm
from .batch import Batch, from_wire, position_ids, to_wire
from .config import config_from_dict
from .models import dtype_of


def forward_logprobs(model, batch: Batch, temperature: float, entropy: str = "none"):
    """Log-probs [N, R] of the response tokens under `model` at `temperature`, and their entropies
    when `entropy` is "grad" (part of the loss) or "metric" (detached, for logging)."""
    width = batch.prompt_width
    mask = batch["attention_mask"]
    kwargs = {}
    keep = batch["input_ids"].shape[1] - width + 1  # the positions that predict response tokens (+ the last)
    if _takes_logits_to_keep(type(model)):  # skips the LM head on prompt positions (a vocab-wide matmul each)
        kwargs["logits_to_keep"] = keep
    logits = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask),
                   use_cache=False, **kwargs).logits
    logits = logits[:, -keep:-1].float() / temperature
    logprobs = pm.logprobs_from_logits(logits, batch["input_ids"][:, width:])
    ent = None
    if entropy == "grad":
        ent = pm.entropy_from_logits(logits)
    elif entropy == "metric":
        with torch.no_grad():
            ent = pm.entropy_from_logits(logits.detach())
    return logprobs * batch["response_mask"], ent


@functools.cache
def _takes_logits_to_keep(model_cls: type) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model_cls.forward).parameters


def forward_values(model, batch: Batch) -> torch.Tensor:
    """Values [N, R]: the critic's estimate before each response token."""
    width = batch.prompt_width
    mask = batch["attention_mask"]
    out = model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    return out.logits[:, width - 1:-1, 0].float() * batch["response_mask"]


class WorkerBase:
    """What every role's worker has: its config, rank, device and process-group plumbing."""

    def __init__(self, cfg_dict: dict, rank: int = 0, world_size: int = 1):
        from .models import quiet_transformers

        quiet_transformers()
        self.cfg = config_from_dict(cfg_dict)
        self.rank, self.world_size = rank, world_size
        # The GPUs a worker may use are the ones its CUDA_VISIBLE_DEVICES names (Ray sets it for ranks
        # that own GPUs, the launcher for colocated workers, "" for CPU-only workers); on a machine
        # without CUDA the same layout runs on CPU (a rehearsal with logical GPUs).
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(self.cfg.trainer.seed + rank)

    def where(self) -> dict:
        """Node, process and GPU ids of this worker (the placement log, and the colocation plan)."""
        import ray

        ctx = ray.get_runtime_context()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = [g for g in visible.split(",") if g] if visible is not None else [str(g) for g in ray.get_gpu_ids()]
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "gpus": gpus, "device": str(self.device), "sharded": getattr(self, "sharded", False)}

    def master_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, addr: str, port: int, cpu_offload: bool = False) -> None:
        """Join the role's process group: NCCL between GPUs (plus gloo for CPU tensors when FSDP keeps
        parameters on the host), gloo on CPU."""
        import torch.distributed as dist

        if self.device.type == "cuda":
            backend = "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"
        else:
            backend = "gloo"
        timeout = timedelta(seconds=self.cfg.trainer.worker_timeout_s)
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timeout)


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

    def start_training(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        rc = getattr(self.cfg, self.role)
        if self.world_size > 1 or self.sharded:
            if not port:
                port = self.master_address()[1]
            self.init_process_group(addr, port, cpu_offload=self.sharded and rc.cpu_offload)
        if self.cfg.model.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.model.to(self.device)
        if self.sharded:
            from .fsdp import shard_model

            shard_model(self.model, self.compute_dtype, cpu_offload=rc.cpu_offload)
        self.model.train()
        # The fused kernel updates every parameter in one call instead of a dozen small ops each;
        # sharded (DTensor) parameters keep torch's default implementation.
        fused = True if self.device.type in ("cpu", "cuda") and not self.sharded else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=rc.lr, weight_decay=rc.weight_decay,
                                           fused=fused)
        warmup = rc.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        # FSDP averages gradients over ranks; plain data parallelism here sums them. Losses are
        # divided by the global token count, so the sum is the exact global token mean.
        self.grad_scale = float(self.world_size) if self.sharded else 1.0
        self.comm_seconds = 0.0  # gradient all-reduce time of the current update

    def autocast(self):
        """Compute in model.dtype over fp32 master weights (FSDP2 casts by itself when sharded)."""
        if self.sharded or self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _step(self, grad_clip: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.world_size > 1 and not self.sharded:
            import torch.distributed as dist

            flat = torch.cat([p.grad.reshape(-1) for p in params])
            start = time.perf_counter()
            dist.all_reduce(flat)
            self.comm_seconds += time.perf_counter() - start
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
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
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

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
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        set_model_state_dict(self.model, state["model"], options=options)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        self.scheduler.load_state_dict(state["scheduler"])


class _Accumulator:
    """Token-weighted sums of per-micro-batch statistics; the driver combines ranks exactly."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(value) * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def result(self) -> dict:
        return {"sums": self.sums, "weights": self.weights}


class PolicyWorker(TrainableWorker):
    role = "actor"

    def __init__(self, cfg_dict: dict, model_path: str, rank: int = 0, world_size: int = 1,
                 with_reference: bool = False):
        super().__init__(cfg_dict, rank, world_size)
        from .models import load_causal_lm, load_tokenizer

        cfg = self.cfg
        self.model_path = model_path
        self.model = load_causal_lm(model_path, "float32", cfg.model.trust_remote_code)  # master weights
        self.tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
        self.reference = self.engine = None
        if with_reference:  # frozen: held in model.dtype, sharded like the policy
            self.reference = load_causal_lm(model_path, cfg.model.dtype, cfg.model.trust_remote_code)
            self.reference.eval().requires_grad_(False)

    def start_training(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        super().start_training(addr, port)
        if self.reference is not None:
            self.reference.to(self.device)
            if self.sharded:
                from .fsdp import shard_model

                shard_model(self.reference, None, cpu_offload=self.cfg.actor.cpu_offload)

    def generate(self, prompts: list[list[int]], settings) -> list:
        """Rollout inside the actor (`placement.rollout_in_actor`): sample with the policy being
        trained, so the engine never needs new weights."""
        from .rollout import Completions, HFEngine

        if self.engine is None:
            self.engine = HFEngine(self.model, self.tokenizer, self.device)
        self.model.eval()
        try:
            with self.autocast():
                return Completions(self.engine.generate(prompts, settings))
        finally:
            self.model.train()

    # no_grad, not inference_mode: inference tensors inside a sharded model (FSDP2's unsharded
    # parameter storage) could not be updated by the next training step.
    @torch.no_grad()
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Log-probs of the sampled tokens under the current policy (the PPO `old` log-probs)."""
        with self.autocast():
            return self._inference(self.model, batch)

    @torch.no_grad()
    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._inference(self.reference, batch)

    def _inference(self, model, batch: Batch) -> torch.Tensor:
        was_training = model.training
        model.eval()
        out = [forward_logprobs(model, _to(mb, self.device), self.cfg.rollout.temperature)[0].float().cpu()
               for mb in batch.chunks(self.cfg.actor.micro_batch_size)]
        model.train(was_training)
        return torch.cat(out)

    def update(self, shard: Batch, normalizers: list[float], kl_coef: float) -> dict:
        """PPO epochs over this rank's part of every mini-batch. `normalizers[i]` is the global
        number of response tokens in mini-batch i (over all ranks)."""
        a, alg = self.cfg.actor, self.cfg.algorithm
        per_rank = shard.size // len(normalizers)
        acc = _Accumulator()
        self.comm_seconds = 0.0
        kl_in_loss = alg.kl_mode == "loss" and kl_coef > 0 and "ref_logprobs" in shard
        for mini, norm in zip(shard.chunks(per_rank), normalizers):
            for micro in mini.chunks(a.micro_batch_size):
                micro = _to(micro, self.device)
                mask = micro["response_mask"]
                with self.autocast():
                    logprobs, entropy = forward_logprobs(self.model, micro, self.cfg.rollout.temperature,
                                                         entropy="grad" if a.entropy_coef else "metric")
                if "old_logprobs" in micro:
                    old = micro["old_logprobs"]
                else:  # on-policy: this forward pass is the sampling policy's (see Trainer.on_policy)
                    old = logprobs.detach()
                    if "engine_logprobs" in micro:
                        diff = pm.masked_mean((old - micro["engine_logprobs"]).abs(), mask)
                        acc.add("rollout/logprob_diff", diff.item(), mask.sum().item())
                advantages = micro["advantages"]
                if "is_weights" in micro:  # truncated importance weights for engine/trainer mismatch
                    advantages = advantages * micro["is_weights"]
                loss, stats = pm.policy_loss(logprobs, old, advantages, mask, a.clip_low, a.clip_high,
                                             a.dual_clip or None, normalizer=norm)
                acc.add("actor/pg_loss", loss.item() * norm / max(mask.sum().item(), 1.0), mask.sum().item())
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * pm.aggregate_loss(entropy, mask, norm)
                if kl_in_loss:
                    kl = pm.kl_estimate(logprobs, micro["ref_logprobs"], alg.kl_estimator)
                    loss = loss + kl_coef * pm.aggregate_loss(kl, mask, norm)
                    acc.add("actor/kl_loss", pm.masked_mean(kl, mask).item(), mask.sum().item())
                (loss * self.grad_scale).backward()
                tokens = mask.sum().item()
                acc.add("actor/entropy", pm.masked_mean(entropy.detach(), mask).item(), tokens)
                for name, value in stats.items():
                    acc.add(f"actor/{name}", value, tokens)
            acc.add("actor/grad_norm", self._step(a.grad_clip), 1.0)
        acc.add("actor/lr", self.scheduler.get_last_lr()[0], 1.0)
        acc.add("timing/comm_actor", self.comm_seconds, 1.0)
        return acc.result()

    def update_then_generate(self, shard: Batch, normalizers: list[float], kl_coef: float,
                             prompts: list[list[int]], settings) -> tuple[dict, list, float]:
        """This step's update, then the next step's rollout with the updated policy, in one call
        (`placement.rollout_in_actor`): one driver round trip per step instead of two. Returns the
        update's statistics, the completions and the seconds spent generating."""
        stats = self.update(shard, normalizers, kl_coef)
        if not prompts:  # more actor workers than prompts
            return stats, [], 0.0
        start = time.perf_counter()
        completions = self.generate(prompts, settings)
        return stats, completions, time.perf_counter() - start

    def weights(self) -> list[tuple[str, object]] | None:
        """The policy's parameters by Hugging Face name, on CPU, for the rollout engines (rank 0;
        the other ranks only take part in the gather under FSDP and return None)."""
        if self.rank != 0 and not self.sharded:
            return None
        state, _ = self._full_state(with_optimizer=False)
        # The engines serve model.dtype (bf16 weights from fp32 master weights).
        return [(name, to_wire(t.to(self.compute_dtype))) for name, t in state.items()] if self.rank == 0 else None

    def open_weight_sync(self, rollout_workers: list, addr: str, port: int) -> None:
        """GPU only (its protocol is tested against vLLM's classes, not yet run on a GPU): an NCCL group
        with the vLLM engines, or CUDA IPC when they share this worker's GPUs; every actor rank takes
        part, rank 0 sends."""
        from .vllm_engine import transfer_backend
        from .weight_sync import WeightSyncGroup

        self.weight_sync = WeightSyncGroup(
            self.model, rollout_workers, rank=self.rank, tensor_parallel_size=self.cfg.rollout.tensor_parallel_size,
            backend=transfer_backend(self.cfg), master_address=addr, master_port=port,
            timeout_s=self.cfg.trainer.worker_timeout_s, dtype=self.compute_dtype)

    def push_weights(self) -> None:
        self.weight_sync.push()

    def export_hf(self, path: str) -> str:
        """Save the policy with save_pretrained (rank 0 writes; every rank must call it under FSDP)."""
        if self.rank != 0 and not self.sharded:
            return path
        state, _ = self._full_state(with_optimizer=False)
        if self.rank == 0:
            state = {k: v.to(self.compute_dtype) for k, v in state.items()}
            self.model.config.torch_dtype = self.compute_dtype
            self.model.save_pretrained(path, state_dict=state)
            self.tokenizer.save_pretrained(path)
        return path


class CriticWorker(TrainableWorker):
    role = "critic"

    def __init__(self, cfg_dict: dict, model_path: str, rank: int = 0, world_size: int = 1):
        super().__init__(cfg_dict, rank, world_size)
        from .models import load_value_model

        self.model = load_value_model(model_path, "float32", self.cfg.model.trust_remote_code)  # master weights

    @torch.no_grad()  # not inference_mode: see PolicyWorker.logprobs
    def values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        with self.autocast():
            out = [forward_values(self.model, _to(mb, self.device)).float().cpu()
                   for mb in batch.chunks(self.cfg.critic.micro_batch_size)]
        self.model.train()
        return torch.cat(out)

    def update(self, shard: Batch, normalizers: list[float]) -> dict:
        c = self.cfg.critic
        per_rank = shard.size // len(normalizers)
        acc = _Accumulator()
        self.comm_seconds = 0.0
        for mini, norm in zip(shard.chunks(per_rank), normalizers):
            for micro in mini.chunks(c.micro_batch_size):
                micro = _to(micro, self.device)
                mask = micro["response_mask"]
                with self.autocast():
                    values = forward_values(self.model, micro)
                loss, stats = pm.value_loss(values, micro["values"], micro["returns"], mask,
                                            c.clip_value or None, normalizer=norm)
                (loss * self.grad_scale).backward()
                tokens = mask.sum().item()
                acc.add("critic/vf_loss", loss.item() * norm / max(tokens, 1.0), tokens)
                for name, value in stats.items():
                    acc.add(f"critic/{name}", value, tokens)
            acc.add("critic/grad_norm", self._step(c.grad_clip), 1.0)
        acc.add("timing/comm_critic", self.comm_seconds, 1.0)
        return acc.result()


class ReferenceWorker(WorkerBase):
    def __init__(self, cfg_dict: dict, model_path: str, rank: int = 0, world_size: int = 1):
        super().__init__(cfg_dict, rank, world_size)
        from .models import load_causal_lm

        self.model = load_causal_lm(model_path, self.cfg.model.dtype, self.cfg.model.trust_remote_code)
        self.model.to(self.device).eval().requires_grad_(False)

    @torch.inference_mode()
    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.cat([forward_logprobs(self.model, _to(mb, self.device), self.cfg.rollout.temperature)[0].cpu()
                          for mb in batch.chunks(self.cfg.reference.micro_batch_size)])


class RewardWorker(WorkerBase):
    def __init__(self, cfg_dict: dict, model_path: str, rank: int = 0, world_size: int = 1):
        super().__init__(cfg_dict, rank, world_size)
        from .models import load_reward_model, load_tokenizer, resolve_path
        from .rewards import resolve_reward_fn

        self.tokenizer = load_tokenizer(model_path, self.cfg.model.trust_remote_code)
        self.fn = resolve_reward_fn(self.cfg.reward.function)
        self.reward_model = self.rm_tokenizer = None
        if self.cfg.reward.model_path:
            rm_path = resolve_path(self.cfg.reward.model_path, self.cfg)
            self.reward_model = load_reward_model(rm_path, self.cfg.model.dtype).to(self.device).eval()
            self.rm_tokenizer = load_tokenizer(rm_path)
            self.rm_tokenizer.padding_side = "right"

    def score(self, responses: list[list[int]], records: list) -> torch.Tensor:
        """Scores [N] for the responses to `records` (one PromptRecord per response)."""
        from .rewards import score_responses

        texts, values = score_responses(self.fn, self.tokenizer, responses, records)
        scores = torch.tensor(values, dtype=torch.float32)
        if self.reward_model is not None:
            scores += self.cfg.reward.model_weight * self._model_scores([r.prompt_text for r in records], texts)
        return scores

    @torch.no_grad()
    def _model_scores(self, prompts: list[str], texts: list[str]) -> torch.Tensor:
        out = []
        size = self.cfg.reward.micro_batch_size
        for start in range(0, len(texts), size):
            enc = self.rm_tokenizer([p + t for p, t in zip(prompts[start:start + size], texts[start:start + size])],
                                    return_tensors="pt", padding=True).to(self.device)
            out.append(self.reward_model(**enc).logits[:, 0].float().cpu())
        return torch.cat(out)


class RolloutWorker(WorkerBase):
    def __init__(self, cfg_dict: dict, model_path: str, rank: int = 0, world_size: int = 1):
        super().__init__(cfg_dict, rank, world_size)
        from .rollout import make_engine

        self.engine = make_engine(self.cfg, model_path, str(self.device))

    def generate(self, prompts: list[list[int]], settings) -> list:
        from .rollout import Completions

        return Completions(self.engine.generate(prompts, settings))

    def load_weights(self, named_tensors: list[tuple[str, object]]) -> None:
        """Weights from `PolicyWorker.weights` (numpy arrays on the wire, see batch.to_wire)."""
        self.engine.load_weights((name, from_wire(t)) for name, t in named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()

    # Colocated GPUs: wake the weights, receive new ones, and only then reallocate the KV cache.
    def wake_weights(self) -> None:
        self.engine.wake_weights()

    def wake_kv_cache(self) -> None:
        self.engine.wake_kv_cache()

    # GPU weight sync (weight_sync.py; vLLM engines only): the trainer side drives these.
    def init_weight_transfer(self, init_info: dict) -> None:
        self.engine.init_weight_transfer(init_info)

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.engine.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()


def _to(batch: Batch, device: torch.device) -> Batch:
    if device.type == "cpu":
        return batch
    return Batch({k: v.to(device, non_blocking=True) for k, v in batch.items()})

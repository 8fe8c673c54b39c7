"""The roles' worker classes. `roles.py` turns them into Ray actors; this module never imports Ray
at import time, so the classes can be read and tested on their own.

- PolicyWorker     trains the policy (one data-parallel rank); can hold the frozen reference too,
                   and can generate with the policy itself (placement.rollout_in_actor).
- CriticWorker     trains the value model (one data-parallel rank).
- ReferenceWorker  frozen initial policy, for the KL term.
- RewardWorker     rule-based reward functions, plus an optional reward model.
- RolloutWorker    a generation engine (transformers or vLLM) that receives new weights each step.

What they share (forward passes, process group, sharding, optimizer step) is in worker_base.py. Each
constructor hands a TrainerError to `WorkerBase._failed_to_start`, so that a worker that cannot start
ends the run with one line naming its role, rank and node.
"""

from __future__ import annotations

import math
import os
import time

import torch

from ..algo import ppo_math as pm
from ..algo.batch import Batch, from_wire, to_wire
from ..algo.step_stats import Accumulator
from ..errors import TrainerError
from .flops import Utilisation
from .packing import in_batch_order, micro_batches
from .staging import NodePaths, on_this_node
from .worker_base import (
    TrainableWorker,
    UpdateResult,
    WorkerBase,
    forward_logprobs,
    forward_values,
    to_device,
)


class PolicyWorker(TrainableWorker):
    role = "actor"

    def __init__(
        self,
        cfg_dict: dict,
        model_path: str | NodePaths,
        rank: int = 0,
        world_size: int = 1,
        with_reference: bool = False,
    ):
        try:
            super().__init__(cfg_dict, rank, world_size)
            from ..inputs.models import load_tokenizer

            cfg = self.cfg
            model_path = on_this_node(model_path)
            self.model_path = model_path
            lora = cfg.model.lora_rank > 0
            # fp32 master weights; under LoRA only the adapters, the frozen base is held in model.dtype (lora.py)
            self.model = self.load_model("causal_lm", model_path, "float32", lora=lora)
            self.tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
            self.reference = None
            self.adapters = None  # LoRA: where the adapters are and how they merge (inputs/lora.py)
            self.pushes = 0  # weight pushes so far (the first says what it sends)
            if lora:
                from ..inputs.lora import Adapters

                self.adapters = Adapters.of(self.model)
            self.engine = None
            self.last_update_end: float | None = None  # perf_counter when update() last returned
            # LoRA: the reference is this model with its adapters off (ref_logprobs), no second copy.
            if with_reference and not lora:  # frozen: held in model.dtype, sharded like the policy
                self.reference = self.load_model("causal_lm", model_path, cfg.model.dtype)
                self.reference.eval().requires_grad_(False)
        except TrainerError as exc:
            self._failed_to_start(exc, rank)

    def start_training(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        super().start_training(addr, port)
        if self.reference is not None:
            self.place(self.reference, None)

    def generate(self, prompts: list[list[int]], settings) -> list:
        """Rollout inside the actor (`placement.rollout_in_actor`): sample with the policy being
        trained, so the engine never needs new weights."""
        from ..rollout.engines import Completions, HFEngine

        if self.engine is None:
            self.engine = HFEngine(self.model, self.tokenizer, self.device)
        self.model.eval()
        start = time.perf_counter()
        try:
            with self.autocast(), self.eager_if_compiled():
                out = Completions(self.engine.generate(prompts, settings))
            out.seconds, out.gpus = time.perf_counter() - start, float(self.device.type == "cuda")
            return out
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
        if self.adapters is not None:  # LoRA: the base model, exactly, as held (model.dtype)
            from ..inputs.lora import base_only

            with base_only(self.model), self.autocast():
                return self._inference(self.model, batch)
        return self._inference(self.reference, batch)

    def _inference(self, model, batch: Batch) -> torch.Tensor:
        start = time.perf_counter()
        was_training = model.training
        model.eval()
        m, a = self.cfg.model, self.cfg.actor
        agree = self.device if self.sharded else None  # sharded ranks run as many micro-batches
        groups = micro_batches(batch, a.micro_batch_size, a.max_tokens_per_micro_batch, m.pack_sequences, agree)
        out = [(rows, self._logprobs(model, to_device(mb, self.device))[0].float().cpu()) for rows, mb in groups]
        model.train(was_training)
        meter(self).forward(batch["attention_mask"], time.perf_counter() - start)  # the tensors are on the host: done
        return in_batch_order(out, batch.size, batch["response_mask"].shape[1])

    def packing_check_outputs(self, micro: Batch, packed: bool, attention: str) -> torch.Tensor:
        temperature = self.cfg.rollout.temperature
        return forward_logprobs(self.model, micro, temperature, packed=packed, attention=attention)[0]

    def _logprobs(self, model, micro: Batch, entropy: str = "none"):
        m = self.cfg.model
        return forward_logprobs(
            model,
            micro,
            self.cfg.rollout.temperature,
            entropy,
            packed=m.pack_sequences,
            attention=m.attn_implementation,
        )

    def update(self, shard: Batch, normalizers: list[float], kl_coef: float) -> UpdateResult:
        """PPO epochs over this rank's part of every mini-batch. `normalizers[i]` is the global
        number of response tokens in mini-batch i (over all ranks). Also reports the seconds since this
        worker's previous update ended (its other calls, such as log-probs and the weight export, and
        its waiting for this one)."""
        start = time.perf_counter()
        acc = self._ppo_epochs(shard, normalizers, kl_coef)
        if self.last_update_end is not None:
            acc.add("timing/actor_between_updates", start - self.last_update_end, 1.0)
        add_utilisation(self, acc, start, shard)
        self.add_step_stats(acc, start, shard)
        self.last_update_end = time.perf_counter()
        return UpdateResult(acc.result())

    def _ppo_epochs(self, shard: Batch, normalizers: list[float], kl_coef: float) -> Accumulator:
        actor_cfg = self.cfg.actor
        alg = self.cfg.algorithm
        kl_in_loss = alg.kl_mode == "loss" and kl_coef > 0 and "ref_logprobs" in shard
        agg = {"agg_mode": actor_cfg.loss_agg_mode, "max_len": self.cfg.response_limit}

        def micro_loss(micro: Batch, norm: float, acc: Accumulator) -> torch.Tensor:
            mask = micro["response_mask"]
            # Statistics stay on the device (0-dim tensors); the Accumulator reads them back once, after the loop.
            tokens = mask.sum()
            with self.autocast():
                logprobs, entropy = self._logprobs(
                    self.model, micro, entropy="grad" if actor_cfg.entropy_coef else "metric"
                )
            if "old_logprobs" in micro:
                old = micro["old_logprobs"]
            else:  # on-policy: this forward pass is the sampling policy's (see Trainer.on_policy)
                old = logprobs.detach()
                if "engine_logprobs" in micro:
                    gap = pm.logprob_gap(old, micro["engine_logprobs"], mask)
                    acc.peak("rollout/logprob_diff_max", gap.pop("logprob_diff_max"))
                    for name, value in gap.items():
                        acc.add(f"rollout/{name}", value, tokens)
                    if self.cfg.corrects_logprobs:  # the importance weights, from this same pass
                        r = self.cfg.rollout
                        weights, is_stats = pm.rollout_correction(
                            old, micro["engine_logprobs"], mask, r.logprob_correction_mode, r.logprob_correction_cap
                        )
                        micro["is_weights"] = weights
                        for name, value in is_stats.items():
                            acc.add(f"rollout/{name}", value, tokens)
            advantages = micro["advantages"]
            if "is_weights" in micro:  # truncated importance weights: trainer over sampler
                advantages = advantages * micro["is_weights"]
            clip = (actor_cfg.clip_low, actor_cfg.clip_high)
            if actor_cfg.policy_loss == "gspo":
                loss, stats = pm.gspo_policy_loss(logprobs, old, advantages, mask, *clip, norm, **agg)
            elif actor_cfg.policy_loss == "cispo":
                loss, stats = pm.cispo_policy_loss(logprobs, old, advantages, mask, *clip, norm, **agg)
            else:
                loss, stats = pm.policy_loss(
                    logprobs, old, advantages, mask, *clip, actor_cfg.dual_clip or None, norm, **agg
                )
            # The micro-batch's own loss, weighted by its own count: their mean is the mini-batch's loss.
            local = pm.loss_count(mask, actor_cfg.loss_agg_mode).double()
            acc.add("actor/pg_loss", loss.detach().double() * norm / local, local)
            if actor_cfg.entropy_coef:
                loss = loss - actor_cfg.entropy_coef * pm.aggregate_loss(entropy, mask, norm, **agg)
            if kl_in_loss:
                kl = pm.kl_estimate(logprobs, micro["ref_logprobs"], alg.kl_estimator)
                loss = loss + kl_coef * pm.aggregate_loss(kl, mask, norm, **agg)
                acc.add("actor/kl_loss", pm.masked_mean(kl, mask).detach(), tokens)
            acc.add("actor/entropy", pm.masked_mean(entropy.detach(), mask), tokens)
            for name, value in stats.items():
                acc.add(f"actor/{name}", value, tokens)
            return loss

        acc = self._mini_batch_updates(shard, normalizers, micro_loss)
        acc.add("actor/lr", self.scheduler.get_last_lr()[0], 1.0)
        return acc

    def weights(self) -> list[tuple[str, object]] | None:
        """The policy's parameters by Hugging Face name, on CPU, for the rollout engines (rank 0;
        the other ranks only take part in the gather under FSDP and return None)."""
        from ..rollout.engines import PushedWeights

        if self.rank != 0 and not self.sharded:
            return None
        start = time.perf_counter()
        state, _ = self._full_state(with_optimizer=False)
        if self.rank != 0:
            return None
        if self.adapters is not None:  # the engines load the plain model: its names, the adapters merged in
            state = self.adapters.merged_state(state)
        size = sum(t.numel() for t in state.values()) * self.compute_dtype.itemsize
        if self.pushes == 0:
            self._say_what_is_pushed(len(state), size)
        self.pushes += 1
        # The engines serve model.dtype (bf16 weights from fp32 master weights).
        out = PushedWeights((name, to_wire(t.to(self.compute_dtype))) for name, t in state.items())
        out.gather_s, out.nbytes = time.perf_counter() - start, size  # timing/push_gather, perf/push_gb_per_s
        return out

    def _say_what_is_pushed(self, tensors: int, size: int) -> None:
        """One line in the job's log (rank 0, the first push): what the engines get."""
        what = "the full weights"
        if self.adapters is not None:
            what = (
                f"merged LoRA weights (model.lora_rank={self.cfg.model.lora_rank}, {len(self.adapters.layers)} "
                f"adapted layers: W + B @ A * scale, under the base model's names)"
            )
        print(f"actor: each weight push sends {what}: {tensors} tensors, {size / 2**20:.1f} MiB", flush=True)

    def open_weight_sync(self, rollout_workers: list, addr: str, port: int) -> None:
        """GPU only (its protocol is tested against vLLM's classes, not yet run on a GPU): an NCCL group
        with the vLLM engines, or CUDA IPC when they share this worker's GPUs; every actor rank takes
        part, rank 0 sends."""
        from ..rollout.vllm_engine import transfer_backend
        from ..rollout.weight_sync import WeightSyncGroup

        self.weight_sync = WeightSyncGroup(
            self.model,
            rollout_workers,
            rank=self.rank,
            tensor_parallel_size=self.cfg.rollout.tensor_parallel_size,
            pipeline_parallel_size=self.cfg.rollout.pipeline_parallel_size,
            backend=transfer_backend(self.cfg),
            master_address=addr,
            master_port=port,
            timeout_s=self.cfg.trainer.worker_timeout_s,
            dtype=self.compute_dtype,
            adapters=self.adapters,
            bucket_mb=self.cfg.rollout.weight_push_bucket_mb,
        )

    def push_weights(self) -> dict[str, float]:
        """Send the weights over the NCCL or IPC group (every rank; rank 0 sends). Returns the push's split
        (`WeightSyncGroup.push`): timing/push_gather, timing/push_broadcast, perf/push_gb_per_s."""
        if self.pushes == 0 and self.rank == 0:
            meta = self.weight_sync.source.metadata()  # names, dtypes and full shapes, without a gather
            self._say_what_is_pushed(len(meta), sum(math.prod(m.shape) * m.dtype.itemsize for m in meta))
        self.pushes += 1
        return self.weight_sync.push()

    def export_hf(self, path: str) -> dict[str, int]:
        """Save the policy with save_pretrained (rank 0 writes; every rank must call it under FSDP). Under LoRA:
        the merged model in `path` (loads as the plain model), and the adapters alone in `path`/adapter (peft's
        format, for PeftModel.from_pretrained over the base model). A node that does not see `path`'s parent
        exports into its scratch directory instead, for the driver to pull (state/shards.export_policy).
        Returns those files by relative name and size ({} when written in place, and on other ranks)."""
        from ..state import transfer

        if self.rank != 0 and not self.sharded:
            return {}
        state, _ = self._full_state(with_optimizer=False)
        if self.rank != 0:
            return {}
        target = path if self.sees(os.path.dirname(path)) else self.open_scratch()
        model = self.model
        if self.adapters is not None:
            self.model.save_pretrained(os.path.join(target, "adapter"), state_dict=self.adapters.adapter_state(state))
            state = self.adapters.merged_state(state)
            model = self.model.get_base_model()
        state = {k: v.to(self.compute_dtype) for k, v in state.items()}
        model.config.torch_dtype = self.compute_dtype
        model.save_pretrained(target, state_dict=state)
        self.tokenizer.save_pretrained(target)
        return transfer.listing(target) if target != path else {}


class CriticWorker(TrainableWorker):
    role = "critic"

    def __init__(self, cfg_dict: dict, model_path: str | NodePaths, rank: int = 0, world_size: int = 1):
        try:
            super().__init__(cfg_dict, rank, world_size)
            model_path = on_this_node(model_path)
            self.model = self.load_model("value", model_path, "float32")  # master weights
        except TrainerError as exc:
            self._failed_to_start(exc, rank)

    @torch.no_grad()  # not inference_mode: see PolicyWorker.logprobs
    def values(self, batch: Batch) -> torch.Tensor:
        start = time.perf_counter()
        self.model.eval()
        c = self.cfg.critic
        agree = self.device if self.sharded else None  # sharded ranks run as many micro-batches
        groups = micro_batches(
            batch, c.micro_batch_size, c.max_tokens_per_micro_batch, self.cfg.model.pack_sequences, agree
        )
        with self.autocast():
            out = [(rows, self._values(to_device(mb, self.device)).float().cpu()) for rows, mb in groups]
        self.model.train()
        meter(self).forward(batch["attention_mask"], time.perf_counter() - start)
        return in_batch_order(out, batch.size, batch["response_mask"].shape[1])

    def _values(self, micro: Batch) -> torch.Tensor:
        m = self.cfg.model
        return forward_values(self.model, micro, packed=m.pack_sequences, attention=m.attn_implementation)

    def packing_check_outputs(self, micro: Batch, packed: bool, attention: str) -> torch.Tensor:
        return forward_values(self.model, micro, packed=packed, attention=attention)

    def update(self, shard: Batch, normalizers: list[float]) -> UpdateResult:
        start = time.perf_counter()
        critic_cfg = self.cfg.critic

        def micro_loss(micro: Batch, norm: float, acc: Accumulator) -> torch.Tensor:
            mask = micro["response_mask"]
            with self.autocast():
                values = self._values(micro)
            loss, stats = pm.value_loss(
                values, micro["values"], micro["returns"], mask, critic_cfg.clip_value or None, normalizer=norm
            )
            tokens = mask.sum()  # on the device, like the statistics: read back once, after the loop
            acc.add("critic/vf_loss", loss.detach().double() * norm / tokens.double().clamp(min=1.0), tokens)
            for name, value in stats.items():
                acc.add(f"critic/{name}", value, tokens)
            return loss

        acc = self._mini_batch_updates(shard, normalizers, micro_loss)
        add_utilisation(self, acc, start, shard)
        self.add_step_stats(acc, start, shard)
        return UpdateResult(acc.result())


def meter(worker) -> Utilisation:
    """A trained role's FLOPs meter (flops.py), made on its first use."""
    if getattr(worker, "flops_meter", None) is None:
        cfg = worker.cfg
        worker.flops_meter = Utilisation(worker.model, worker.device, worker.compute_dtype, cfg.trainer.peak_tflops)
    return worker.flops_meter


def add_utilisation(worker, acc: Accumulator, started: float, shard: Batch) -> None:
    """MFU of the update that started at `started` (`perf/<role>_mfu`) and of the forward-only passes since the
    previous update (`perf/<role>_forward_mfu`: old and reference log-probs, values), each the mean over
    ranks; neither where the device's peak is unknown (flops.peak_flops). The update has waited for its
    device by now: the optimizer step reads the gradient norm back."""
    m = meter(worker)
    mfu = m.mfu(shard["attention_mask"], time.perf_counter() - started)
    if mfu is not None:
        acc.add(f"perf/{worker.role}_mfu", mfu, 1.0)
    forward = m.forward_mfu()
    if forward is not None:
        acc.add(f"perf/{worker.role}_forward_mfu", forward, 1.0)


class ReferenceWorker(WorkerBase):
    role = "reference"

    def __init__(self, cfg_dict: dict, model_path: str | NodePaths, rank: int = 0, world_size: int = 1):
        try:
            super().__init__(cfg_dict, rank, world_size)
            from ..inputs.models import load_causal_lm

            model_path = on_this_node(model_path)
            self.model = load_causal_lm(model_path, self.cfg.model.dtype, self.cfg.model.trust_remote_code)
            self.model.to(self.device).eval().requires_grad_(False)
            if self.cfg.model.compile:
                from .compile import compile_blocks

                compile_blocks(self.model, self.device)
        except TrainerError as exc:
            self._failed_to_start(exc, rank)

    @torch.inference_mode()
    def ref_logprobs(self, batch: Batch) -> torch.Tensor:
        m, r = self.cfg.model, self.cfg.reference
        groups = micro_batches(batch, r.micro_batch_size, r.max_tokens_per_micro_batch, m.pack_sequences)
        out = []
        for rows, mb in groups:
            logprobs, _ = forward_logprobs(
                self.model,
                to_device(mb, self.device),
                self.cfg.rollout.temperature,
                packed=m.pack_sequences,
                attention=m.attn_implementation,
            )
            out.append((rows, logprobs.cpu()))
        return in_batch_order(out, batch.size, batch["response_mask"].shape[1])


class RewardWorker(WorkerBase):
    role = "reward"

    def __init__(
        self,
        cfg_dict: dict,
        model_path: str | NodePaths,
        rank: int = 0,
        world_size: int = 1,
        reward_model_path: str | NodePaths | None = None,
    ):
        try:
            super().__init__(cfg_dict, rank, world_size)
            from ..inputs.models import load_reward_model, load_tokenizer
            from ..inputs.rewards import check_reward_runs, resolve_reward

            self.tokenizer = load_tokenizer(on_this_node(model_path), self.cfg.model.trust_remote_code)
            self.fn = resolve_reward(self.cfg.reward)
            check_reward_runs(self.fn)  # code_tests on a node that cannot isolate code: one line, at start
            self.reward_model = None
            self.rm_tokenizer = None
            if reward_model_path is not None:
                rm_path = on_this_node(reward_model_path)
                self.reward_model = load_reward_model(rm_path, self.cfg.model.dtype).to(self.device).eval()
                self.rm_tokenizer = load_tokenizer(rm_path)
                self.rm_tokenizer.padding_side = "right"
        except TrainerError as exc:
            self._failed_to_start(exc, rank)

    def score(self, completions: list, records: list):
        """Scores [N] for an engine's `completions` (rollout.Completion) of `records` (one PromptRecord
        each), as a numpy array on the wire (batch.to_wire). The rollout queue passes the engine's result
        straight on (rollout/queue.py)."""
        from ..inputs.rewards import score_responses

        responses = [c.token_ids for c in completions]
        reward = self.cfg.reward
        texts, values = score_responses(self.fn, self.tokenizer, responses, records, reward.function, reward.timeout_s)
        scores = torch.tensor(values, dtype=torch.float32)
        if self.reward_model is not None:
            scores += self.cfg.reward.model_weight * self._model_scores([r.prompt_text for r in records], texts)
        return to_wire(scores)

    @torch.no_grad()
    def _model_scores(self, prompts: list[str], texts: list[str]) -> torch.Tensor:
        out = []
        size = self.cfg.reward.micro_batch_size
        for start in range(0, len(texts), size):
            enc = self.rm_tokenizer(
                [p + t for p, t in zip(prompts[start : start + size], texts[start : start + size])],
                return_tensors="pt",
                padding=True,
            ).to(self.device)
            out.append(self.reward_model(**enc).logits[:, 0].float().cpu())
        return torch.cat(out)


class RolloutWorker(WorkerBase):
    role = "rollout"

    def __init__(self, cfg_dict: dict, model_path: str | NodePaths, rank: int = 0, world_size: int = 1):
        try:
            super().__init__(cfg_dict, rank, world_size)
            cfg = self.cfg
            model_path = on_this_node(model_path)
            self.model_path = model_path
            self.done_at: float | None = None  # when the last batch ended (load_weights reports the idle time)
            self.version = 0
            """The weight push this engine generates with (0: the weights it started with)."""
            if cfg.rollout.engine == "vllm":  # vLLM is imported only where an engine is built
                from ..rollout.vllm_engine import VLLMEngine

                self.engine = VLLMEngine(model_path, cfg, engine_index=rank)
            elif cfg.rollout.engine == "sglang":  # likewise SGLang
                from ..rollout.sglang_engine import SGLangEngine

                self.engine = SGLangEngine(model_path, cfg, engine_index=rank)
            else:
                from ..rollout.engines import HFEngine

                self.engine = HFEngine.load(model_path, cfg.model.dtype, str(self.device), cfg.model.trust_remote_code)
        except TrainerError as exc:
            self._failed_to_start(exc, rank)

    def generate(self, prompts: list[list[int]], settings, samples: list[dict] | None = None, board=None) -> list:
        """The batch's samples. `board`: rollout.partial's WeightBoard (rollout/partial.py): generate in
        segments, taking weights pushed meanwhile between them."""
        from ..rollout.engines import Completions

        start = time.perf_counter()
        try:
            if self.cfg.rollout.environment:  # multi-turn episodes against the user's environment (environment.py)
                out = Completions(self.episode_loop().run(prompts, settings, samples))
            elif self.cfg.search.enabled:  # multi-turn, querying the retriever on this node (multiturn.py)
                out = Completions(self.turn_loop().run(prompts, settings))
            elif board is not None:
                out = Completions(self.generate_in_segments(prompts, settings, board))
            else:
                out = Completions(self.engine.generate(prompts, settings))
            out.seconds, out.gpus = time.perf_counter() - start, self.engine_gpus()  # generation_throughput
            return out
        finally:
            self.done_at = time.perf_counter()  # from here the engine waits for its next call

    def engine_gpus(self) -> float:
        """The GPUs this engine generates on: a vLLM or SGLang engine's tensor x pipeline parallel ranks, a
        transformers engine's share (rollout.gpus_per_engine, else one); 0 on a CPU."""
        r = self.cfg.rollout
        if self.device.type != "cuda":
            return 0.0
        if r.engine in ("vllm", "sglang"):
            return float(r.ranks_per_engine)
        return r.gpus_per_engine or 1.0

    def episode_loop(self):
        """The episode loop over `rollout.environment`'s class, made once (the file is loaded once)."""
        if getattr(self, "_episode_loop", None) is None:
            from ..inputs.models import load_tokenizer
            from ..inputs.user_files import load_environment
            from ..rollout.environment import EpisodeLimits, EpisodeLoop

            cfg = self.cfg
            env_class = load_environment(cfg.rollout.environment)
            tok = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
            self._episode_loop = EpisodeLoop(
                self.engine.generate, tok, env_class, EpisodeLimits.from_config(cfg.rollout)
            )
        return self._episode_loop

    def turn_loop(self):
        if getattr(self, "_turn_loop", None) is None:
            from ..inputs.models import load_tokenizer
            from ..rollout.multiturn import TurnLoop, search_limits
            from ..search.retrieval import RetrievalClient

            cfg = self.cfg
            tok = getattr(self.engine, "tokenizer", None) or load_tokenizer(
                self.model_path, cfg.model.trust_remote_code
            )
            client = RetrievalClient.from_config(cfg.search)
            self._turn_loop = TurnLoop(self.engine.generate, tok, client.passages, search_limits(cfg.rollout))
        return self._turn_loop

    def generate_in_segments(self, prompts: list[list[int]], settings, board) -> list:
        """rollout.partial: the batch in segments, each continued with the newest weights on `board`."""
        from ..rollout.partial import generate_in_segments, segment_tokens

        tok = self.engine_tokenizer() if settings.stop else None

        def stop_at(ids: list[int]) -> int | None:
            def holds_stop(k: int) -> bool:
                text = tok.decode(ids[:k], skip_special_tokens=True)
                return any(s in text for s in settings.stop)

            if not holds_stop(len(ids)):
                return None
            return next(k for k in range(1, len(ids) + 1) if holds_stop(k))

        def newer() -> int:
            return self.take_newer_weights(board)

        segment = segment_tokens(self.cfg.rollout)
        return generate_in_segments(
            self.engine.generate, prompts, settings, segment, self.version, newer, stop_at if tok else None
        )

    def take_newer_weights(self, board) -> int:
        """Load the weights `board` holds if they are newer than this engine's and already in the object store
        (a push not yet gathered is not waited for); returns the version this engine now has."""
        import ray

        newer = ray.get(board.newer_than.remote(self.version), timeout=self.cfg.trainer.worker_timeout_s)
        if newer is not None:
            version, (ref,) = newer
            if ray.wait([ref], timeout=0)[0]:
                self.load_weights(ray.get(ref), version)
        return self.version

    def engine_tokenizer(self):
        """The engine's tokenizer (the transformers engine's own, else loaded once)."""
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None and getattr(self, "_tokenizer", None) is None:
            from ..inputs.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_path, self.cfg.model.trust_remote_code)
        return tok or self._tokenizer

    def load_weights(self, named_tensors: list[tuple[str, object]], version: int | None = None) -> dict[str, float]:
        """Weights from `PolicyWorker.weights` (numpy arrays on the wire, see batch.to_wire), push `version`
        (None: the next). Returns how long the engine sat idle since its last batch until they arrived, the
        load's time, and the actor's gather time and the weights' bytes (engines.object_store_push). A push
        this engine took already, in the middle of a batch (rollout.partial), is not loaded again."""
        start = time.perf_counter()
        idle = start - self.done_at if self.done_at is not None else 0.0
        self.done_at = None
        if version is not None and version <= self.version:
            return {"idle_s": idle, "load_s": 0.0}
        self.version = self.version + 1 if version is None else version
        self.engine.load_weights((name, from_wire(t)) for name, t in named_tensors)
        # the actor's side of the push (engines.PushedWeights), for engines.object_store_push
        pushed = {"gather_s": getattr(named_tensors, "gather_s", 0.0), "bytes": getattr(named_tensors, "nbytes", 0)}
        return {"idle_s": idle, "load_s": time.perf_counter() - start, **pushed}

    def sleep(self) -> None:
        self.engine.sleep()

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

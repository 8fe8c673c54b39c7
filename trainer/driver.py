"""The training loop. One PPO step reads top to bottom:

    rollout -> rewards -> reference log-probs and values -> advantages -> update actor and critic
    -> push the new weights to the rollout engines -> log

`train(cfg)` plans what each role asks of the cluster (placement.py), joins the Ray cluster (or starts
a local one) and checks that it can hold them, then runs the checks and loads that need no cluster
(inputs.py: run directory, checkpoint, model, data, reward function), starts the roles and always
shuts them down again; a worker's expected failure ends the run with its own one line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .algo import ppo_math as pm
from .algo.advantages import compute_advantages
from .algo.batch import build_batch, split_batch, update_shards
from .config import Config
from .inputs.data import PromptLoader, PromptRecord
from .inputs.prepare import Inputs, prepare
from .inputs.rewards import score_responses
from .metrics import MetricsLogger, Timer, combine, format_summary, print_sample
from .recovery import StopRequest, run_with_restarts
from .roles.cluster import connect, preflight
from .rollout.engines import SamplingSettings
from .rollout.multiturn import turn_metrics
from .rollout.queue import RolloutQueue, Rollouts
from .state import checkpoint
from .state.run_dir import record_start
from .state.shards import load_roles, save_roles
from .state.storage import fetch_checkpoint, upload_if_configured
from .waiting import get_all, worker_errors


def train(cfg: Config) -> dict:
    """Run the whole training job and return its summary."""
    from .roles.launch import launch_roles
    from .roles.placement import plan

    requests = plan(cfg)  # what each role asks of the cluster, decided here once
    started_ray = connect(cfg, requests)
    try:
        preflight(requests)  # a cluster too small fails in seconds, before anything heavy
        fetch_checkpoint(cfg)  # trainer.checkpoint_uri: its newest copy when newer than run_dir's (storage.py)
        inputs = prepare(cfg)
        print("cloudrl trainer, resolved config:\n" + cfg.to_yaml(), flush=True)
        with worker_errors(), StopRequest() as stop:  # a worker's expected failure ends the run with its own line

            def run(roles, restarts: int) -> dict:
                record_start(cfg, roles)
                return Trainer(cfg, roles, inputs, restarts, stop).fit()

            # A lost worker or node: roles restarted from the latest checkpoint (recovery.py).
            return run_with_restarts(
                cfg, requests, inputs, lambda: launch_roles(cfg, requests, inputs.model_path, inputs.critic_path), run
            )
    finally:
        if started_ray:
            import ray

            ray.shutdown()


@dataclass
class History:
    """Rewards worth reporting at the end; saved with checkpoints so a resumed run reports them too."""

    val_before: float | None = None
    val_last: float | None = None
    first_reward: float | None = None
    last_reward: float | None = None
    resumed_from: int | None = None


@dataclass
class Launched:
    """A step whose updates were sent to the workers (`Trainer.ppo_step`); `finish_step` collects them."""

    step: int
    metrics: dict
    timer: Timer
    started: float
    update_sent: float
    actor_refs: list
    critic_refs: list
    tokens: float


class Trainer:
    def __init__(self, cfg: Config, roles, inputs: Inputs, restarts: int = 0, stop=None):
        """`restarts`: restarts after a lost worker or node so far (logged as trainer/restarts); `stop`:
        the StopRequest that SIGTERM sets (recovery.py), or None."""
        self.cfg, self.roles, self.inputs = cfg, roles, inputs
        self.restarts, self.stop = restarts, stop
        self.tokenizer = inputs.tokenizer
        self.reward_fn = inputs.reward_fn if cfg.reward.in_driver else None
        self.loader = PromptLoader(inputs.train, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
        a = cfg.algorithm
        self.kl_ctl = (
            pm.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
            if a.kl_target > 0
            else pm.FixedKLController(a.kl_coef)
        )
        self.history = History()
        self.step = 0
        self.last_step_end = 0.0  # perf_counter when the last step was finished (finish_step)
        self.rollouts = RolloutQueue(
            roles.rollout.workers,
            roles.rollout.labels(),
            cfg.trainer.worker_timeout_s,
            None if cfg.reward.in_driver else roles.reward.workers,
        )
        self.gpu_weight_sync = self.open_gpu_weight_sync()

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        logger = MetricsLogger(cfg, cfg.trainer.run_dir, self.step)
        try:
            if self.step == 0 and self.inputs.val:
                self.history.val_before = self.history.val_last = self.validate()["val/reward_mean"]
                logger.log(0, {"val/reward_mean": self.history.val_before})
            last_ckpt = checkpoint.latest(cfg.trainer.run_dir)
            ahead: Launched | None = None  # a step whose update still runs while the next one starts
            while self.step < cfg.trainer.total_steps:
                self.step += 1
                launched = self.ppo_step(self.loader.next_batch())
                if ahead is not None:
                    logger.log(ahead.step, self.finish_step(ahead))
                    ahead = None
                if self.runs_ahead():
                    ahead = launched
                    continue
                metrics = self.finish_step(launched)
                if self.inputs.val and cfg.trainer.val_every and self.step % cfg.trainer.val_every == 0:
                    metrics.update(self.validate())
                if self.step == cfg.trainer.total_steps and self.inputs.val and "val/reward_mean" not in metrics:
                    metrics.update(self.validate())
                if "val/reward_mean" in metrics:
                    self.history.val_last = metrics["val/reward_mean"]
                logger.log(self.step, metrics)
                if self.saves_at(self.step):
                    last_ckpt = self.save_checkpoint()
                if self.stop is not None and self.stop.requested and self.step < cfg.trainer.total_steps:
                    self.stop.checkpoint_and_stop(self, last_ckpt)  # SIGTERM: this step saved, then stop
            self.rollouts.settle()  # the last push reached every engine
        finally:
            logger.close()
        return self.finish(last_ckpt)

    # ------------------------------------------------------------------------------------------
    def ppo_step(self, prompts: list[PromptRecord]) -> Launched:
        """One step up to sending its updates and new weights; `finish_step` collects the results."""
        import ray

        cfg, roles, timer = self.cfg, self.roles, Timer()
        n = cfg.rollout.n
        kl_coef = self.kl_ctl.value
        started = time.perf_counter()
        # ---- 1. Rollout: n samples per prompt, grouped per prompt. With rollout.policy_lag=1
        #      they were started during the previous step, and the next step's start now, after
        #      the weights the previous step pushed.
        with timer("rollout"):
            got = self.rollouts.take(self.step, prompts, self.sampling(self.step))
            self.start_next_rollout()
            completions = got.completions
            records = [p for p in prompts for _ in range(n)]
            batch = build_batch(
                [r.prompt_ids for r in records],
                [c.token_ids for c in completions],
                self.tokenizer.pad_token_id,
                [c.logprobs for c in completions],
                [c.loss_mask for c in completions],
            )
            if cfg.rollout.sleep_between_rollouts:
                ray.get([e.sleep.remote() for e in roles.rollout.workers])

        # ---- 2. Rewards (scored by the reward workers as the engines finished, or here).
        with timer("reward"):
            scores = self.score(got, records)
        print_sample(self.step, records[0].prompt_text, self.tokenizer, completions[0].token_ids, float(scores[0]))

        # ---- 3. Log-probs of the sampling policy, the reference, and the critic's values.
        mask = batch["response_mask"]
        model_inputs = batch.only("input_ids", "attention_mask", "response_mask")
        on_policy = self.on_policy()
        with timer("ref"):
            if not on_policy:
                parts = split_batch(model_inputs, roles.actor.world_size)
                batch["old_logprobs"] = torch.cat(
                    ray.get([w.logprobs.remote(part) for w, part in zip(roles.actor.workers, parts) if part.size])
                )
            if cfg.uses_reference:
                group = roles.reference or roles.actor  # the reference lives in the actor by default
                parts = split_batch(model_inputs, group.world_size)
                batch["ref_logprobs"] = torch.cat(
                    ray.get([w.ref_logprobs.remote(part) for w, part in zip(group.workers, parts) if part.size])
                )
        with timer("values"):
            if cfg.uses_critic:
                parts = split_batch(model_inputs, roles.critic.world_size)
                batch["values"] = torch.cat(
                    ray.get([w.values.remote(part) for w, part in zip(roles.critic.workers, parts) if part.size])
                )

        # ---- 4. Advantages (pure torch, ppo_math).
        with timer("adv"):
            metrics = compute_advantages(cfg, batch, scores, kl_coef)

        # ---- 5. Update actor and critic (in parallel; each is data-parallel over its workers).
        #      Sent here; `finish_step` collects the results.
        sent = time.perf_counter()
        if "loss_mask" in batch:  # multi-turn: no policy, KL or value loss on observation tokens
            batch["response_mask"] = batch.pop("loss_mask")
        actor_keys = ["input_ids", "attention_mask", "response_mask", "advantages"]
        actor_keys += [k for k in ("old_logprobs", "ref_logprobs", "is_weights", "engine_logprobs") if k in batch]
        shards, norms = update_shards(batch.only(*actor_keys), roles.actor.world_size, cfg.actor, self.update_seed)
        actor_refs = [w.update.remote(shard, norms, kl_coef) for w, shard in zip(roles.actor.workers, shards)]
        critic_refs = []
        if cfg.uses_critic:
            shards, norms = update_shards(
                batch.only("input_ids", "attention_mask", "response_mask", "values", "returns"),
                roles.critic.world_size,
                cfg.critic,
                self.update_seed,
            )
            critic_refs = [w.update.remote(shard, norms) for w, shard in zip(roles.critic.workers, shards)]

        # ---- 6. Push the new policy weights to every engine (no disk round trip): each loads them
        #      after the update and after the batch it is generating; the next push checks they did.
        with timer("sync"):
            metrics.update(self.sync_weights(after=actor_refs))

        # ---- 7. The step's metrics, but for the update's (finish_step).
        self.kl_ctl.update(metrics.get("actor/kl_seq", 0.0), batch.size)
        reward_mean = float(scores.mean())
        self.history.first_reward = self.history.first_reward if self.history.first_reward is not None else reward_mean
        self.history.last_reward = reward_mean
        metrics.update(
            {
                "timing/rollout_wait": got.waited_s,
                "rollout/reward_mean": reward_mean,
                "rollout/reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
                "rollout/response_length": float(mask.sum(-1).mean()),
                "rollout/truncated": sum(c.finish_reason == "length" for c in completions) / len(completions),
                "rollout/policy_lag": got.lag,
                "actor/kl_coef": kl_coef,
                "trainer/restarts": self.restarts,
            }
        )
        metrics.update(turn_metrics(completions))
        return Launched(self.step, metrics, timer, started, sent, actor_refs, critic_refs, float(mask.sum()))

    def finish_step(self, s: Launched) -> dict:
        """Step `s`'s metrics, once its updates are done (and, in turn, the engines have the new weights).
        `timing/step` is the time since the previous step was finished, or since this one started."""
        import ray

        metrics, timer = s.metrics, s.timer
        metrics.update(combine([r.stats for r in ray.get(s.actor_refs)]))
        metrics["timing/update_actor"] = time.perf_counter() - s.update_sent
        if s.critic_refs:
            metrics.update(combine([r.stats for r in ray.get(s.critic_refs)]))
            metrics["timing/update_critic"] = time.perf_counter() - s.update_sent
        timer.add("update", time.perf_counter() - s.update_sent)
        if not self.cfg.rollout.policy_lag:
            with timer("sync"):
                metrics.update(self.rollouts.settle())
        now = time.perf_counter()
        metrics.update(timer.times)
        metrics["timing/step"] = now - max(s.started, self.last_step_end)
        metrics["perf/tokens_per_s"] = s.tokens / metrics["timing/step"]
        self.last_step_end = now
        return metrics

    def runs_ahead(self) -> bool:
        """With rollout.policy_lag=1 the next step starts before this one's update is done, unless
        something must see this step's weights first: a validation, a checkpoint, a stop, the end."""
        cfg = self.cfg
        validates = self.inputs.val and cfg.trainer.val_every and self.step % cfg.trainer.val_every == 0
        stopping = self.stop is not None and self.stop.requested
        return bool(cfg.rollout.policy_lag) and not (validates or stopping or self.saves_at(self.step))

    # ------------------------------------------------------------------------------------------
    @property
    def update_seed(self) -> int:
        return self.cfg.trainer.seed * 7919 + self.step

    def on_policy(self) -> bool:
        """One epoch over one mini-batch: the loss compares against the policy as it is before the
        update, so those log-probs come from the update's own forward pass instead of an extra pass
        (and so do the importance weights against the sampler's log-probs, workers.PolicyWorker)."""
        cfg = self.cfg
        needs_old = cfg.uses_reference and cfg.algorithm.kl_mode == "reward"
        return cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size == cfg.rollout_batch_size and not needs_old

    def sampling(self, step: int) -> SamplingSettings:
        return SamplingSettings.from_config(self.cfg.rollout, seed=self.cfg.trainer.seed * 100_003 + step)

    def start_next_rollout(self) -> None:
        """With rollout.policy_lag=1, the next step's prompts start generating now, with the weights
        before this step's update. Not when this step ends in a checkpoint: the step after it starts
        from the saved weights, exactly as a run resumed from that checkpoint does."""
        cfg = self.cfg
        if cfg.rollout.policy_lag and self.step < cfg.trainer.total_steps and not self.saves_at(self.step):
            self.rollouts.start(self.step + 1, self.loader.peek_batch(), self.sampling(self.step + 1))

    def saves_at(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return bool(every and step % every == 0) or step == self.cfg.trainer.total_steps

    def score(self, got: Rollouts, records: list[PromptRecord]) -> torch.Tensor:
        """Rewards [N] for `got`, one record per sample: the reward workers' (started as the engines
        finished, rollout_queue.py), or with reward.in_driver rule-based rewards scored right here."""
        if self.reward_fn is None:
            return got.scores()
        responses = [c.token_ids for c in got.completions]
        _texts, values = score_responses(self.reward_fn, self.tokenizer, responses, records, self.cfg.reward.function)
        return torch.tensor(values, dtype=torch.float32)

    def open_gpu_weight_sync(self) -> bool:
        """vLLM engines on GPUs get weights over NCCL (or CUDA IPC when colocated) instead of the
        object store. Only where the actor really computes on CUDA: a rehearsal on logical GPUs
        keeps the object store. Not yet run on a GPU (its protocol is tested against vLLM's classes)."""
        import ray

        cfg, actor = self.cfg, self.roles.actor
        engines_on_gpu = (
            cfg.rollout.gpus_per_engine > 0 or cfg.rollout.tensor_parallel_size > 1 or cfg.placement.colocate_all
        )
        on_cuda = actor.where()[0]["device"].startswith("cuda")
        if not (cfg.rollout.engine == "vllm" and cfg.actor.gpus_per_node > 0 and engines_on_gpu and on_cuda):
            return False
        addr, port = ray.get(actor.workers[0].master_address.remote())
        get_all(
            [w.open_weight_sync.remote(self.roles.rollout.workers, addr, port) for w in actor.workers],
            actor.labels(),
            cfg.trainer.worker_timeout_s,
            f"opening the weight sync with the engines at {addr}:{port}",
        )
        return True

    def sync_weights(self, after: list = ()) -> dict[str, float]:
        """New weights to the engines once the update calls `after` are done. Rank 0's go into the
        object store once and every engine reads them from there, without the driver waiting (the
        engine timings returned are the previous push's: rollout_queue.py). On GPUs with vLLM they are
        broadcast over NCCL (or shared through CUDA IPC) instead, and engines that sleep between
        rollouts are woken around the load: both wait here. With the rollout inside the actor the
        engines already use the trained weights."""
        import ray

        if self.roles.rollout_in_actor:
            return {}
        rollout, actor = self.roles.rollout, self.roles.actor
        timeout = self.cfg.trainer.worker_timeout_s
        asleep = self.cfg.rollout.sleep_between_rollouts
        if self.gpu_weight_sync or asleep:
            ray.wait(list(after), num_returns=len(after))  # the update first: its failure raises in finish_step
        if asleep:  # weights first; the KV cache only once the new weights are in
            get_all([e.wake_weights.remote() for e in rollout.workers], rollout.labels(), timeout, "waking the engines")
        if self.gpu_weight_sync:  # the actor drives the engines' side, each after its batch in flight
            self.rollouts.pushed_by_actor()
            get_all([w.push_weights.remote() for w in actor.workers], actor.labels(), timeout, "the weight sync")
            return {}
        weights = [w.weights.remote() for w in actor.workers]
        timings = self.rollouts.push(weights[0], weights[1:], actor.labels()[1:])
        if asleep:
            timings = self.rollouts.settle()
            get_all(
                [e.wake_kv_cache.remote() for e in rollout.workers],
                rollout.labels(),
                timeout,
                "allocating the engines' KV cache",
            )
        return timings

    def validate(self) -> dict:
        records = self.inputs.val
        settings = SamplingSettings.from_config(self.cfg.rollout, seed=0, greedy=True)
        scores, size = [], self.cfg.data.val_batch_size
        for start in range(0, len(records), size):
            chunk = records[start : start + size]
            scores.append(self.score(self.rollouts.generate(chunk, settings), chunk))
        return {"val/reward_mean": float(torch.cat(scores).mean())}

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Every rank writes its own shards (shards.py); the driver adds its own state, atomically."""
        state = {
            "step": self.step,
            "data": self.loader.state_dict(),
            "kl": self.kl_ctl.state_dict(),
            "history": self.history.__dict__,
        }
        path = checkpoint.save(
            self.cfg.trainer.run_dir,
            self.step,
            {},
            state,
            self.cfg.to_yaml(),
            self.cfg.trainer.keep_last,
            write_shards=lambda tmp: save_roles(self.roles, tmp, self.cfg.trainer.worker_timeout_s),
        )
        return upload_if_configured(path, self.cfg.trainer)  # trainer.checkpoint_uri: a copy off the instance

    def maybe_resume(self) -> None:
        if (ckpt := self.inputs.resume) is None:
            return
        load_roles(self.roles, ckpt, self.cfg.trainer.worker_timeout_s)
        checkpoint.set_rng_state(ckpt.rng)
        self.step = ckpt.state["step"]
        self.loader.load_state_dict(ckpt.state["data"])
        self.kl_ctl.load_state_dict(ckpt.state["kl"])
        self.history = History(**ckpt.state["history"])
        self.history.resumed_from = self.step
        self.sync_weights()
        print(f"resumed from {ckpt.path} at step {self.step}", flush=True)

    def finish(self, last_ckpt: Path | None) -> dict:
        import ray

        cfg, h, run_dir = self.cfg, self.history, Path(self.cfg.trainer.run_dir).resolve()
        export = str(run_dir / "hf_model") if cfg.trainer.export_hf else None
        if export:
            ray.get([w.export_hf.remote(export) for w in self.roles.actor.workers])
        summary = {
            "steps": self.step,
            "resumed_from": h.resumed_from,
            "val_reward_before_rl": h.val_before,
            "val_reward_after_rl": h.val_last,
            "rollout_reward_first": h.first_reward,
            "rollout_reward_last": h.last_reward,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "exported_model": export,
            "metrics": str(run_dir / "metrics.jsonl"),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(format_summary(summary), flush=True)
        return summary

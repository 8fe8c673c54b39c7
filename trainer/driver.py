"""The training loop. One PPO step reads top to bottom in `Trainer.step`:

    rollout -> rewards (-> with dynamic sampling, more rounds until the batch is informative)
    -> log-probs and values -> advantages -> update actor and critic
    -> push the new weights to the rollout engines -> the step's metrics

`Trainer.fit` runs the steps, and once per finished step validates, logs, saves and stops.
`Trainer.evaluate` (trainer.eval_only) scores a checkpoint or model on the validation sets instead.
`train(cfg)` runs the whole job around the loop (job.py: the cluster, the inputs, the roles, restarts).

What is simplified, on purpose:
1. Generation runs at most `rollout.max_staleness` steps ahead: with k >= 1 the next k batches generate (with
   the weights they find) while this step's update runs (rollout/queue.py and rollout/in_flight.py hold the two
   halves); a step that must see its updated weights (a validation, a checkpoint) is not generated ahead of.
2. The driver holds the whole batch: rewards, advantages and batch splitting run here, in one process.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .algo.advantages import compute_advantages, gap_problem, kl_controller
from .algo.batch import Batch, build_batch, split_batch, update_shards
from .algo.evaluation import length_metrics, sampled_metrics
from .algo.step_stats import Timer
from .config import Config
from .errors import EngineMismatch
from .hangs import WATCH
from .inputs.data import PromptLoader, PromptRecord
from .job import run_job
from .metrics import MetricsLogger, format_eval_table, format_summary, print_sample
from .recovery import leave_preempted_node, preemption_notice
from .rollout.dynamic_sampling import Round, refill
from .rollout.engines import SamplingSettings
from .rollout.environment import FailureReport
from .rollout.in_flight import SentStep, StepsInFlight
from .rollout.partial import segment_tokens
from .rollout.queue import RolloutQueue, Rollouts
from .rollout.weight_sync import WeightPush
from .state import checkpoint, timeline
from .state.shards import export_policy, load_roles, save_run

if TYPE_CHECKING:
    from .inputs.prepare import Inputs


def train(cfg: Config) -> dict:
    """Run the whole training job (job.py: cluster, inputs, roles, restarts) and return its summary
    (with trainer.eval_only, the evaluation's result)."""
    return run_job(cfg, Trainer)


@dataclass
class History:
    """Rewards worth reporting at the end; saved with checkpoints so a resumed run reports them too."""

    val_before: float | None = None
    val_last: float | None = None
    first_reward: float | None = None
    last_reward: float | None = None
    resumed_from: int | None = None


@dataclass
class Sampled:
    """A step's samples as the update sees them, and what was generated to get them."""

    rollouts: Rollouts
    records: list[PromptRecord]
    """One per sample."""
    scores: torch.Tensor
    """The samples' rewards [N]."""
    generated: torch.Tensor
    """The rewards of every sample generated this step (dynamic sampling drops some): rollout/reward_mean."""
    metrics: dict
    """Dynamic sampling's (rollout/sampling_rounds, ...); {} without it."""


class Trainer:
    def __init__(self, cfg: Config, roles, inputs: Inputs, restarts: int = 0, stop=None):
        """`restarts`: restarts after a lost worker or node so far (logged as trainer/restarts); `stop`:
        the StopRequest that SIGTERM sets (recovery.py), or None."""
        self.cfg = cfg
        self.roles = roles
        self.inputs = inputs
        self.restarts = restarts
        self.stop = stop
        self.tokenizer = inputs.tokenizer
        self.loader = None
        if not cfg.trainer.eval_only:
            self.loader = PromptLoader(inputs.train, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
        self.val_sets = {"": inputs.val} if inputs.val else {}
        """Validation prompts by name ("" is data.val_files' set)."""
        self.val_sets.update(inputs.val_sets)
        self.kl_ctl = kl_controller(cfg)
        self.history = History()
        self.global_step = 0
        """The step being run (or the last finished one between steps)."""
        self.notice: tuple[str, str] | None = None
        """A node holding roles that has a preemption notice, seen as this step began (recovery.py)."""
        self.rollouts = RolloutQueue(
            roles.rollout.workers,
            roles.rollout.labels(),
            cfg.trainer.worker_timeout_s,
            None if cfg.reward.in_driver else roles.reward.workers,
            samples=bool(cfg.rollout.environment),
            score_here=inputs.score_here(cfg.reward) if cfg.reward.in_driver else None,
            scorer_labels=[] if cfg.reward.in_driver else roles.reward.labels(),
        )
        critic_labels = roles.critic.labels() if cfg.uses_critic else []
        self.in_flight = StepsInFlight(
            self.rollouts, not cfg.rollout.max_staleness, roles.actor.labels(), critic_labels
        )
        self.push_weights = WeightPush(cfg, roles, self.rollouts)
        if self.push_weights.engines_replaceable:  # a lost engine costs no restart (docs/recovery.md)
            self.rollouts.engines.replace_lost(roles.rollout)
        if cfg.rollout.elastic:
            print(self.elastic_engines(), flush=True)
        print(self.push_weights.describe(cfg), flush=True)
        if cfg.rollout.partial:
            print(self.partial_rollouts(), flush=True)
        self.env_failures = FailureReport()
        """rollout.environment's failures: the first of each kind printed, a batch that all failed stops the run."""
        self.gap_checked = cfg.trainer.gap_check == "off" or cfg.rollout.top_p < 1 or cfg.rollout.top_k > 0
        """trainer.gap_check is done for this start (or not to be done: off, or sampling truncated)."""

    def elastic_engines(self) -> str:
        """rollout.elastic: engines are added where the weights reach them from the queue; the line that says so."""
        r = self.cfg.rollout
        if not self.push_weights.engines_replaceable:
            return (
                f"rollout.elastic: no engine is added in this run: {self.push_weights.describe(self.cfg)}, and "
                f"an NCCL group cannot grow; the run keeps its {r.num_engines} engine(s)"
            )
        self.rollouts.engines.grow_to(r.max_engines)
        return (
            f"rollout.elastic: up to {r.max_engines} engines; one more starts wherever the cluster has room for "
            f"one engine (a node that joins) and generates from the next weight push after it has started"
        )

    def partial_rollouts(self) -> str:
        """rollout.partial: batches in flight take new weights between segments where the weights reach the
        engines from the queue; the line that says so."""
        if self.push_weights.mode != "object_store":
            return (
                f"rollout.partial: whole generations in this run: {self.push_weights.describe(self.cfg)}, which an "
                f"engine cannot take in the middle of a batch; new weights are loaded between batches"
            )
        self.rollouts.take_weights_mid_batch()
        return (
            f"rollout.partial: batches generated ahead take the weights pushed meanwhile every "
            f"{segment_tokens(self.cfg.rollout)} tokens and continue their unfinished samples with them"
        )

    # ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        self.maybe_resume()
        logger = MetricsLogger(cfg, cfg.trainer.run_dir, self.global_step)
        try:
            if self.global_step == 0 and self.val_sets:
                self.history.val_before = self.validate()["val/reward_mean"]
                self.history.val_last = self.history.val_before
                logger.log(0, {"val/reward_mean": self.history.val_before})
            last_ckpt = timeline.latest(cfg.trainer.run_dir)
            while self.global_step < cfg.trainer.total_steps:
                self.global_step += 1
                self.notice = preemption_notice(self.roles)  # a node to leave: this step is not overlapped
                for step, metrics in self.step(self.loader.next_batch()):
                    if self.validates_at(step):
                        metrics.update(self.validate())
                        self.history.val_last = metrics["val/reward_mean"]
                    logger.log(step, metrics)
                    if self.saves_at(step):
                        last_ckpt = self.save_checkpoint()
                    last = step == cfg.trainer.total_steps
                    if self.stop_requested() and step == self.global_step and not last:
                        self.stop.checkpoint_and_stop(self, last_ckpt)  # SIGTERM: this step saved, then stop
                    if self.notice and step == self.global_step and not last:
                        leave_preempted_node(self, last_ckpt, self.notice)  # this step saved, then a restart
            self.rollouts.settle()  # the last push reached every engine
        finally:
            logger.close()
        return self.finish(last_ckpt)

    # ------------------------------------------------------------------------------------------
    def step(self, prompts: list[PromptRecord]) -> list[tuple[int, dict]]:
        """One PPO step on `prompts`, up to sending its update and new weights. Returns the steps whose
        updates were collected now, with their metrics: this one, or with rollout.max_staleness=1 the one
        before it, while this one's update still runs (`StepsInFlight`)."""
        cfg = self.cfg
        timer = Timer()
        started = time.perf_counter()
        kl_coef = self.kl_ctl.value
        sees_weights = self.must_see_weights(self.global_step)

        # ---- 1. Rollout: n samples per prompt, grouped per prompt. With rollout.max_staleness=k they
        #      were started during an earlier step, and the next steps' start now (up to k ahead).
        with timer("rollout"):
            got = self.rollout(prompts, sees_weights)
        records = [p for p in prompts for _ in range(cfg.rollout.n)]

        # ---- 2. Rewards (scored by the reward workers as the engines finished, or here). With
        #      algorithm.dynamic_sampling the prompts whose samples all score the same are dropped and
        #      more are sampled until the batch is full again (`refill`).
        with timer("reward"):
            scores = self.score(got)
        sampled = Sampled(got, records, scores, scores, {})
        if cfg.algorithm.dynamic_sampling:
            with timer("refill"):
                sampled = self.refill(sampled, prompts, sees_weights)
        got, records, scores = sampled.rollouts, sampled.records, sampled.scores
        batch = self.to_batch(records, got.completions)
        response_mask = batch["response_mask"]
        first = got.completions[0]
        print_sample(
            self.global_step,
            cfg.trainer.sample_every,
            records[0].prompt_text,
            self.tokenizer,
            first.token_ids,
            float(scores[0]),
            first.loss_mask,
        )

        # ---- 3. Log-probs of the sampling policy and the reference, and the critic's values.
        self.logprobs_and_values(batch, timer)

        # ---- 4. Advantages (pure torch, algo/).
        with timer("adv"):
            metrics = compute_advantages(cfg, batch, scores, kl_coef)

        # ---- 5. Update actor and critic, in parallel; each is data-parallel over its workers.
        update_sent = time.perf_counter()
        actor_refs, critic_refs = self.update(batch, kl_coef)

        # ---- 6. The new policy weights to every engine, after the update (rollout/weight_sync.py).
        with timer("sync"):
            metrics.update(self.push_weights(after=actor_refs))

        # ---- 7. The step's metrics; the update's join them once it is collected.
        self.kl_ctl.update(metrics.get("actor/kl_seq", 0.0), batch.size)
        metrics.update(got.metrics(response_mask))
        metrics.update(self.reward_metrics(sampled.generated))
        metrics.update(sampled.metrics)
        metrics["actor/kl_coef"] = kl_coef
        metrics["trainer/restarts"] = self.restarts
        metrics.update(WATCH.stragglers.metrics())
        tokens = float(response_mask.sum())
        sent = SentStep(self.global_step, metrics, timer, started, update_sent, actor_refs, critic_refs, tokens)
        hold = bool(cfg.rollout.max_staleness) and not self.must_see_weights(self.global_step)
        return self.in_flight.add(sent, hold=hold)

    # ------------------------------------------------------------------------------------------
    def rollout(self, prompts: list[PromptRecord], sees_weights: bool) -> Rollouts:
        """This step's samples (taken from the batches in flight, or generated now) and, with
        rollout.max_staleness=k, the batches of the next k steps started. With dynamic sampling the next batch
        starts in `refill` instead, once this step has drawn all the prompts it needs."""
        step = self.global_step
        then = [] if sees_weights or self.cfg.algorithm.dynamic_sampling else self.next_rollouts()
        got = self.rollouts.take(step, prompts, self.sampling(step), then=then)
        if not self.cfg.algorithm.dynamic_sampling:
            self.push_weights.release_engines()
        return got

    def refill(self, sampled: Sampled, prompts: list[PromptRecord], sees_weights: bool) -> Sampled:
        """Dynamic sampling (rollout/dynamic_sampling.py `refill`): keep the prompts whose samples score differently,
        generating rounds of new prompts from the loader (with the weights pushed last) until
        data.train_batch_size are kept or algorithm.max_sampling_rounds rounds ran. Only then does the next
        step's batch start (rollout.max_staleness=1), from where the loader now stands: the loader state a
        checkpoint saves is where the next step begins, as without dynamic sampling."""
        cfg = self.cfg
        n = cfg.rollout.n
        generated = [sampled.scores]

        def more() -> Round:
            prompts = self.loader.next_batch()
            settings = self.sampling(self.global_step)
            settings.seed += 7 * len(generated)  # each round samples afresh, reproducibly
            t0 = time.perf_counter()
            got = self.rollouts.generate(prompts, settings, what=f"generating step {self.global_step}'s extra samples")
            waited = time.perf_counter() - t0
            generated.append(self.score(got))
            return Round(prompts, got.completions, generated[-1], waited)

        first = Round(prompts, sampled.rollouts.completions, sampled.scores, sampled.rollouts.waited_s)
        kept, metrics = refill(first, more, cfg.data.train_batch_size, n, cfg.algorithm.max_sampling_rounds)
        for ahead in [] if sees_weights else self.next_rollouts():  # with dynamic sampling: max_staleness <= 1
            self.rollouts.start(self.rollouts.started_through(self.global_step) + 1, *ahead)
        self.push_weights.release_engines()
        return Sampled(
            # the first round's generation speed (engines.generation_throughput)
            Rollouts(
                kept.completions, sampled.rollouts.lag, kept.waited_s, None, generation=sampled.rollouts.generation
            ),
            [p for p in kept.prompts for _ in range(n)],
            kept.scores,
            torch.cat(generated),
            metrics,
        )

    def to_batch(self, records: list[PromptRecord], completions: list) -> Batch:
        """Prompts left-padded, responses right-padded, with the engines' log-probs and loss masks."""
        return build_batch(
            [r.prompt_ids for r in records],
            [c.token_ids for c in completions],
            self.tokenizer.pad_token_id,
            [c.logprobs for c in completions],
            [c.loss_mask for c in completions],
            [c.finish_reason for c in completions],
        )

    def score(self, got: Rollouts, batch: str = "the batch") -> torch.Tensor:
        """Rewards [N] for `got`: the reward workers' (started as the engines finished, rollout/queue.py),
        or with reward.in_driver scored right here, plus the environment's rewards. Its environment failures
        are reported first (`FailureReport`; `batch` names it there)."""
        for line in self.env_failures.check(got.completions, self.global_step, batch):
            print(f"warning: {line}", file=sys.stderr, flush=True)
        return got.scores(self.cfg.reward.function, self.cfg.reward.timeout_s)

    def logprobs_and_values(self, batch: Batch, timer: Timer) -> None:
        """Fill `batch` with the log-probs of the policy before the update (unless the update's own
        forward pass gives them, `on_policy`), the reference's, and the critic's values. The critic's
        forward passes run beside the actor's (`timing/ref` is the wait for the actor's and the
        reference's, `timing/values` what is left of the critic's after them), except where the critic
        shares the actor's GPUs (placement.colocate_all): there they start once the actor's are in."""
        cfg = self.cfg
        roles = self.roles
        model_inputs = batch.only("input_ids", "attention_mask", "response_mask")

        def send(group, method: str) -> Callable[[], torch.Tensor]:
            """Every rank's `method` on its shard, sent now; returns what collects them."""
            parts = split_batch(model_inputs, group.world_size)
            sent = [(w, label, part) for w, label, part in zip(group.workers, group.labels(), parts) if part.size]
            calls = [getattr(w, method).remote(part) for w, _, part in sent]
            labels = [label for _, label, _ in sent]
            what = f"step {self.global_step}: the {group.name}'s {method}"
            started = time.monotonic()
            return lambda: torch.cat(WATCH.wait(f"{group.name} {method}", calls, labels, what, started=started))

        values = send(roles.critic, "values") if cfg.uses_critic and not cfg.critic_after_actor else None
        checks_gap = not self.gap_checked and "engine_logprobs" in batch
        with timer("ref"):
            old = send(roles.actor, "logprobs") if not self.on_policy() or checks_gap else None
            reference = roles.reference or roles.actor  # the reference lives in the actor by default
            ref = send(reference, "ref_logprobs") if cfg.uses_reference else None
            if old is not None:
                old_logprobs = old()
                if checks_gap:
                    self.check_gap(batch, old_logprobs)
                if not self.on_policy():  # on-policy, the update's own forward pass gives them
                    batch["old_logprobs"] = old_logprobs
            if ref is not None:
                batch["ref_logprobs"] = ref()
        with timer("values"):
            if cfg.uses_critic:
                batch["values"] = (values or send(roles.critic, "values"))()

    def check_gap(self, batch: Batch, old_logprobs: torch.Tensor) -> None:
        """trainer.gap_check, once per start, on the first step's samples before anything trains: the
        engines' log-probs against the trainer's (`gap_problem`); one line, or the run stops with it."""
        self.gap_checked = True
        problem = gap_problem(self.cfg, batch, old_logprobs, self.global_step)
        if problem is None:
            return
        if self.cfg.trainer.gap_check == "fail":
            raise EngineMismatch(f"{problem}; trainer.gap_check=warn trains on regardless")
        print(f"warning: {problem}; trainer.gap_check=fail stops such a run", file=sys.stderr, flush=True)

    def update(self, batch: Batch, kl_coef: float) -> tuple[list, list]:
        """Send the actor's and the critic's updates (each rank its shard); returns their call refs. They
        run side by side, except where the critic shares the actor's GPUs (placement.colocate_all): there
        the critic's update ends before the actor's starts, so each GPU holds one update's activations at
        a time, and the weight push, which waits for the actor's, finds both done."""
        import ray

        cfg = self.cfg
        roles = self.roles
        if "loss_mask" in batch:  # multi-turn: no policy, KL or value loss on observation tokens
            batch["response_mask"] = batch.pop("loss_mask")
        critic_refs = []
        if cfg.uses_critic:
            critic_batch = batch.only("input_ids", "attention_mask", "response_mask", "values", "returns")
            shards, norms = update_shards(critic_batch, roles.critic.world_size, cfg.critic, self.update_seed)
            critic_refs = [w.update.remote(shard, norms) for w, shard in zip(roles.critic.workers, shards)]
            if cfg.critic_after_actor:  # a failure raises when collected
                ray.wait(critic_refs, num_returns=len(critic_refs), timeout=cfg.trainer.worker_timeout_s)
        actor_keys = ["input_ids", "attention_mask", "response_mask", "advantages"]
        actor_keys += [k for k in ("old_logprobs", "ref_logprobs", "is_weights", "engine_logprobs") if k in batch]
        shards, norms = update_shards(batch.only(*actor_keys), roles.actor.world_size, cfg.actor, self.update_seed)
        actor_refs = [w.update.remote(shard, norms, kl_coef) for w, shard in zip(roles.actor.workers, shards)]
        return actor_refs, critic_refs

    def reward_metrics(self, scores: torch.Tensor) -> dict:
        """The step's reward statistics; the first and last are kept for the summary."""
        reward_mean = float(scores.mean())
        if self.history.first_reward is None:
            self.history.first_reward = reward_mean
        self.history.last_reward = reward_mean
        return {
            "rollout/reward_mean": reward_mean,
            "rollout/reward_std": float(scores.std()) if scores.numel() > 1 else 0.0,
        }

    # ------------------------------------------------------------------------------------------
    def must_see_weights(self, step: int) -> bool:
        """Something needs `step`'s updated weights before the next step generates: a validation, a
        checkpoint (the next step then starts from the saved weights, exactly as a resumed run does), a
        stop, a node with a preemption notice to leave, the end. Such a step is neither overlapped with the next
        rollout nor held."""
        return self.validates_at(step) or self.saves_at(step) or self.stop_requested() or self.notice is not None

    def validates_at(self, step: int) -> bool:
        every = self.cfg.trainer.val_every
        return bool(self.val_sets) and (bool(every and step % every == 0) or step == self.cfg.trainer.total_steps)

    def saves_at(self, step: int) -> bool:
        every = self.cfg.trainer.save_every
        return bool(every and step % every == 0) or step == self.cfg.trainer.total_steps

    def stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    def next_rollouts(self) -> list[tuple]:
        """With rollout.max_staleness=k: the prompts and sampling settings of the steps up to k after this one
        whose batches are not in flight yet, to start now (the caller has checked that this step need not
        see its updated weights). Nothing beyond a later step that must (`must_see_weights`): the step after
        it generates with them, as a resumed run does."""
        step = self.global_step
        last = step + self.cfg.rollout.max_staleness
        batches = self.loader.peek_batches(last - step)  # batches[i]: step + 1 + i's prompts
        ahead = []
        for later in range(self.rollouts.started_through(step) + 1, last + 1):
            if later - 1 > step and self.must_see_weights(later - 1):  # earlier ones: checked when started
                break
            ahead.append((batches[later - step - 1], self.sampling(later)))
        return ahead

    @property
    def update_seed(self) -> int:
        return self.cfg.trainer.seed * 7919 + self.global_step

    def on_policy(self) -> bool:
        """One epoch over one mini-batch: the loss compares against the policy as it is before the
        update, so those log-probs come from the update's own forward pass instead of an extra pass
        (and so do the importance weights against the sampler's log-probs, roles/workers.PolicyWorker)."""
        cfg = self.cfg
        needs_old = cfg.uses_reference and cfg.algorithm.kl_mode == "reward"
        one_pass = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size == cfg.rollout_batch_size
        return one_pass and not needs_old

    def sampling(self, step: int) -> SamplingSettings:
        return SamplingSettings.from_config(self.cfg.rollout, seed=self.cfg.trainer.seed * 100_003 + step)

    def validate(self) -> dict:
        """Every validation set: greedy accuracy (`val/reward_mean`), with trainer.val_n > 1 also mean@n and
        pass@k of that many samples per prompt at trainer.val_temperature, and the response lengths and
        truncation rate. data.val_files' set reports as val/..., each of data.val_sets' as val/<name>/...;
        `val/reward_mean` is always there (without data.val_files, the first named set's)."""
        metrics = {}
        for name, records in self.val_sets.items():
            prefix = f"val/{name}/" if name else "val/"
            metrics.update({prefix + key: value for key, value in self.validate_set(records).items()})
        if "val/reward_mean" not in metrics and self.val_sets:
            metrics["val/reward_mean"] = metrics[f"val/{next(iter(self.val_sets))}/reward_mean"]
        return metrics

    def validate_set(self, records: list[PromptRecord]) -> dict:
        """One validation set's statistics (algo/evaluation.py), names without the val/ prefix."""
        tc = self.cfg.trainer
        greedy = SamplingSettings.from_config(self.cfg.rollout, seed=0, greedy=True)
        scores, completions = self.generate_and_score(records, greedy)
        metrics = {"reward_mean": sum(scores) / len(scores)}
        metrics.update(
            length_metrics([len(c.token_ids) for c in completions], [c.finish_reason == "length" for c in completions])
        )
        if tc.val_n > 1:
            sampled = SamplingSettings.from_config(self.cfg.rollout, seed=1)
            sampled.n, sampled.temperature = tc.val_n, tc.val_temperature
            scores, completions = self.generate_and_score(records, sampled)
            metrics.update(sampled_metrics(scores, tc.val_n))
            lengths = length_metrics(
                [len(c.token_ids) for c in completions], [c.finish_reason == "length" for c in completions]
            )
            metrics.update({f"sampled_{key}": value for key, value in lengths.items()})
        return metrics

    def generate_and_score(self, records: list[PromptRecord], settings: SamplingSettings) -> tuple[list[float], list]:
        """`settings.n` samples per prompt, in chunks of data.val_batch_size prompts, and their rewards."""
        size = self.cfg.data.val_batch_size
        scores: list[float] = []
        completions: list = []
        for start in range(0, len(records), size):
            chunk = records[start : start + size]
            got = self.rollouts.generate(chunk, settings, "validation", "generating validation samples")
            scores += self.score(got, "a validation batch").tolist()
            completions += got.completions
        return scores, completions

    def evaluate(self) -> dict:
        """trainer.eval_only: score the checkpoint `inputs.resume` (or, without one, model.path) on every
        validation set, print one table and write run_dir/eval.json. Nothing else in run_dir changes."""
        ckpt = self.inputs.resume
        if ckpt is not None:
            load_roles(self.roles, ckpt, self.cfg.trainer.worker_timeout_s)
            self.push_weights()
            self.rollouts.settle()
        model = str(ckpt.path) if ckpt is not None else self.cfg.model.path
        step = ckpt.state["step"] if ckpt is not None else 0
        metrics = self.validate()
        run_dir = Path(self.cfg.trainer.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        result = {"model": model, "step": step, "metrics": metrics}
        (run_dir / "eval.json").write_text(json.dumps(result, indent=1))
        print(format_eval_table(model, step, metrics), flush=True)
        print(f"metrics written to {run_dir.resolve() / 'eval.json'}", flush=True)
        return result

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Every rank writes its own shards; the driver adds its own state, atomically (state/shards.py)."""
        state = {
            "step": self.global_step,
            "data": self.loader.state_dict(),
            "kl": self.kl_ctl.state_dict(),
            "history": self.history.__dict__,
        }
        return save_run(self.roles, self.cfg, self.global_step, state)

    def maybe_resume(self) -> None:
        ckpt = self.inputs.resume
        if ckpt is None:
            return
        load_roles(self.roles, ckpt, self.cfg.trainer.worker_timeout_s)
        checkpoint.set_rng_state(ckpt.rng)
        self.global_step = ckpt.state["step"]
        self.loader.load_state_dict(ckpt.state["data"])
        self.kl_ctl.load_state_dict(ckpt.state["kl"])
        self.history = History(**ckpt.state["history"])
        self.history.resumed_from = self.global_step
        self.push_weights()
        print(f"resumed from {ckpt.path} at step {self.global_step}", flush=True)

    def finish(self, last_ckpt: Path | None) -> dict:
        cfg = self.cfg
        h = self.history
        run_dir = Path(cfg.trainer.run_dir).resolve()
        export = str(run_dir / "hf_model") if cfg.trainer.export_hf else None
        if export:  # on the driver's disk, where summary.json says, whichever node actor rank 0 is on
            export_policy(self.roles, Path(export), cfg.trainer.worker_timeout_s)
        summary = {
            "steps": self.global_step,
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

"""Rollout engines: the interface the trainer generates through, and the transformers engine.

An engine lives inside a `RolloutWorker` Ray actor (see workers.py). It takes token-id prompts and
returns, for each prompt, `n` sampled responses (token ids, their log-probs under the engine, and
why each stopped), grouped consecutively: prompt i's samples are results[i*n:(i+1)*n]. After every
policy update the trainer pushes the new weights with `load_weights` (with `rollout.max_staleness=1`
after the engine has finished the batch it generates meanwhile, see rollout/queue.py). With
`placement.rollout_in_actor` an `HFEngine` wraps the policy worker's own model instead, and there is
nothing to push.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import RolloutConfig


@dataclass
class SamplingSettings:
    """How an engine samples one batch: `from_config` takes rollout.*; the defaults are the same keys'."""

    n: int = RolloutConfig.n
    max_new_tokens: int = RolloutConfig.max_new_tokens
    temperature: float = RolloutConfig.temperature
    top_p: float = RolloutConfig.top_p
    top_k: int = RolloutConfig.top_k
    stop: list[str] = field(default_factory=list)
    greedy: bool = False
    seed: int = 0

    @classmethod
    def from_config(cls, rollout_cfg, seed: int, greedy: bool = False) -> SamplingSettings:
        return cls(
            n=1 if greedy else rollout_cfg.n,
            max_new_tokens=rollout_cfg.max_new_tokens,
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            stop=list(rollout_cfg.stop),
            greedy=greedy,
            seed=seed,
        )


@dataclass
class Completion:
    token_ids: list[int]
    """Generated tokens, including the end-of-sequence token when the model emitted one."""
    logprobs: list[float]
    """The engine's log-probability of each generated token (temperature applied)."""
    finish_reason: str
    """`stop` (end-of-sequence or a stop string) or `length`."""
    loss_mask: list[int] | None = None
    """Multi-turn rollouts (multiturn.py): 1 on generated tokens, 0 on the observation tokens the
    trainer inserted (their log-probs are 0). None: every token was generated."""
    turns: dict[str, int] | None = None
    """Multi-turn rollouts: this sample's counts (turns, searches, invalid_calls, observation_tokens)."""
    error: str | None = None
    """Multi-turn rollouts: the environment call that ended this episode by raising or returning the wrong
    type, as one line (`Class.method raised ValueError: ...`, environment.py); None: no such failure."""
    versions: list[int] | None = None
    """rollout.partial (partial.py): the weight version that generated each token. None: every token was
    generated with the weights the engine had when its batch started."""


class Completions(list):
    """A list of Completion that crosses process boundaries as three plain lists. Pickled one by one
    (as Ray does with a list of dataclasses), each sample costs a Python-level reducer call.

    The worker that generated them sets `seconds` (the generate call's wall time on the engine) and `gpus`
    (the engine's GPUs, 0 on a CPU) for the throughput metrics (`generation_throughput`)."""

    seconds: float | None = None
    gpus: float = 0.0

    def __reduce__(self):
        return _completions, (
            [c.token_ids for c in self],
            [c.logprobs for c in self],
            [c.finish_reason for c in self],
            [c.loss_mask for c in self],
            [c.turns for c in self],
            self.seconds,
            self.gpus,
            [c.error for c in self] if any(c.error for c in self) else None,  # None: no sample failed
            [c.versions for c in self] if any(c.versions for c in self) else None,  # None: whole generations
        )


def _completions(
    token_ids: list,
    logprobs: list,
    reasons: list,
    loss_masks: list | None = None,
    turns: list | None = None,
    seconds: float | None = None,
    gpus: float = 0.0,
    errors: list | None = None,
    versions: list | None = None,
) -> Completions:
    extra = zip(loss_masks, turns) if loss_masks is not None else ((None, None) for _ in token_ids)
    errors = errors or [None] * len(token_ids)
    versions = versions or [None] * len(token_ids)
    out = Completions(
        Completion(t, lp, r, m, n, e, v)
        for t, lp, r, (m, n), e, v in zip(token_ids, logprobs, reasons, extra, errors, versions)
    )
    out.seconds, out.gpus = seconds, gpus
    return out


def generated_tokens(completions: list) -> int:
    """Tokens the engine generated: every response token, less the observation tokens of multi-turn samples."""
    return sum(len(c.token_ids) if c.loss_mask is None else sum(c.loss_mask) for c in completions)


def generation_throughput(parts: list) -> dict[str, float]:
    """Generation speed of a batch from its engines' parts (one `Completions` each, timed by its worker):
    `perf/generation_tokens_per_s_per_gpu`, all generated tokens over the longest engine's time (the engines
    run side by side) and over the engines' GPUs (a CPU engine counts as one), and
    `perf/slowest_engine_tokens_per_s`, the lowest of the engines' own tokens/s. {} where no part was timed."""
    timed = [p for p in parts if getattr(p, "seconds", None)]
    if not timed:
        return {}
    tokens = [generated_tokens(p) for p in timed]
    devices = sum(p.gpus or 1.0 for p in timed)
    return {
        "perf/generation_tokens_per_s_per_gpu": sum(tokens) / max(p.seconds for p in timed) / devices,
        "perf/slowest_engine_tokens_per_s": min(n / p.seconds for n, p in zip(tokens, timed)),
    }


class PushedWeights(list):
    """The (name, tensor on the wire) pairs of an object-store weight push (`PolicyWorker.weights`), with the
    time actor rank 0 took to gather and convert them (`gather_s`) and their size in bytes (`nbytes`): the
    engine reports both with its load, for `object_store_push`."""

    gather_s: float = 0.0
    nbytes: int = 0

    def __reduce__(self):
        return _pushed_weights, (list(self), self.gather_s, self.nbytes)


def _pushed_weights(pairs: list, gather_s: float, nbytes: int) -> PushedWeights:
    out = PushedWeights(pairs)
    out.gather_s, out.nbytes = gather_s, nbytes
    return out


def object_store_push(loads: list[dict]) -> dict[str, float]:
    """The split of an object-store weight push from its engines' load results (`RolloutWorker.load_weights`):
    `timing/push_gather` (actor rank 0 gathering the full state dict) and `perf/push_gb_per_s` (the weights'
    bytes, one copy, over the gather and the longest engine load). {} where the push did not say its size."""
    nbytes = max(r.get("bytes", 0) for r in loads)
    if not nbytes:
        return {}
    gather = max(r.get("gather_s", 0.0) for r in loads)
    total = gather + max(r["load_s"] for r in loads)
    return {"timing/push_gather": gather, "perf/push_gb_per_s": nbytes / max(total, 1e-9) / 1e9}


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def wake_weights(self) -> None: ...

    def wake_kv_cache(self) -> None: ...


class SleepingEngine:
    """Sleep and wake of an engine that frees its GPU memory while the policy trains (vLLM's sleep mode,
    SGLang's memory saver), and the state that keeps it from generating on freed memory. An engine sets
    `name`, `can_sleep`, `_release()` (free weights and KV cache) and `_resume(step)` ("weights" or
    "kv_cache"), calls `check_awake()` before it generates and clears `stale` once new weights are in."""

    name = "rollout"
    can_sleep = False
    _sleeping: frozenset[str] | set[str] = frozenset()
    """The wake steps freed by sleep() and not woken yet."""
    stale = False
    """True after a sleep until new weights arrive: generating then would read freed memory."""

    def _release(self) -> None:
        raise NotImplementedError

    def _resume(self, step: str) -> None:
        raise NotImplementedError

    @property
    def asleep(self) -> bool:
        return bool(self._sleeping)

    def check_awake(self) -> None:
        if self.asleep or self.stale:
            raise RuntimeError(
                f"the {self.name} engine is asleep or has no weights since its last sleep: "
                "call wake() and then load_weights() before generate()"
            )

    def sleep(self) -> None:
        """Free the weights and the KV cache (the weights are not kept: new ones come after every update)."""
        if self.can_sleep and not self.asleep:
            self._release()
            self._sleeping = {"weights", "kv_cache"}
            self.stale = True

    def wake_weights(self) -> None:
        """Reallocate the weights only: the first step of the colocated order wake weights, push weights,
        wake KV cache."""
        self._wake("weights")

    def wake_kv_cache(self) -> None:
        """Reallocate the KV cache: the last step, once the new weights are in."""
        self._wake("kv_cache")

    def wake(self) -> None:
        """Reallocate weights and KV cache; load weights (or sync them) before generating."""
        self.wake_weights()
        self.wake_kv_cache()

    def _wake(self, step: str) -> None:
        if step in self._sleeping:
            self._resume(step)
            self._sleeping = self._sleeping - {step}


class HFEngine:
    """Generation with transformers' `generate`, on CPU or one GPU."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)

    @classmethod
    def load(
        cls, model_path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
    ) -> HFEngine:
        """An engine with its own copy of the model (a rollout worker's)."""
        from ..inputs.models import load_causal_lm, load_tokenizer

        model = load_causal_lm(model_path, dtype, trust_remote_code).to(device).eval()
        return cls(model, load_tokenizer(model_path, trust_remote_code), device)

    @torch.inference_mode()  # cheaper per op than no_grad, and generation needs no autograd at all
    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[Completion]:
        from transformers import GenerationConfig

        tok = self.tokenizer
        width = max(len(p) for p in prompts)
        pad = tok.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        gen = GenerationConfig(
            max_new_tokens=settings.max_new_tokens,
            do_sample=not settings.greedy,
            temperature=settings.temperature if not settings.greedy else None,
            top_p=settings.top_p if not settings.greedy and settings.top_p < 1 else None,
            top_k=settings.top_k if not settings.greedy and settings.top_k > 0 else 0,  # 0: off (None means 50)
            num_return_sequences=settings.n,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
            stop_strings=settings.stop or None,
            return_dict_in_generate=True,
            output_logits=True,
        )
        torch.manual_seed(settings.seed)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen,
            tokenizer=tok if settings.stop else None,
        )
        new_tokens = out.sequences[:, width:]
        # Log-probs of the sampled tokens from the raw logits at the sampling temperature.
        logits = torch.stack(out.logits, dim=1).float()
        if not settings.greedy:
            logits = logits / settings.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        results = []
        eos = tok.eos_token_id
        for row, lp in zip(new_tokens.tolist(), logprobs.tolist()):
            length, reason = len(row), "length"
            for i, t in enumerate(row):
                if t == eos:
                    length, reason = i + 1, "stop"
                    break
            if reason == "length" and settings.stop:
                text = tok.decode(row, skip_special_tokens=True)
                if any(s in text for s in settings.stop):
                    reason = "stop"
                    # generate already stopped this row at the stop string; the rest is padding
                    while length > 0 and row[length - 1] == pad:
                        length -= 1
            results.append(Completion(row[:length], lp[:length], reason))
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name, buffers.get(name))
                if target is None:
                    raise KeyError(f"rollout engine has no weight named {name!r}")
                target.copy_(tensor.to(target.device, target.dtype))

    def sleep(self) -> None:  # the HF engine keeps its weights; nothing to free on CPU
        pass

    def wake(self) -> None:
        pass

    def wake_weights(self) -> None:
        pass

    def wake_kv_cache(self) -> None:
        pass

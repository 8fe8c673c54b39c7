"""Dynamic sampling (DAPO, `algorithm.dynamic_sampling`): keep only the prompt groups whose samples score
differently, asking for more rounds until the batch is full, at most `algorithm.max_sampling_rounds`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TrainerError


class NothingInformative(TrainerError, RuntimeError):
    """Every round of dynamic sampling found only prompts whose samples all scored the same."""


@dataclass
class Round:
    """One round of generation: prompts, their n samples each (prompt i's at [i*n, (i+1)*n)) and rewards."""

    prompts: list
    completions: list
    scores: torch.Tensor
    """[len(prompts) * n] rewards."""
    waited_s: float = 0.0


def differing_groups(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[groups] bool: the prompt groups (n consecutive samples each) whose rewards are not all equal."""
    groups = scores.view(-1, n)
    return groups.amax(dim=1) != groups.amin(dim=1)


def refill(first: Round, more, size: int, n: int, max_rounds: int) -> tuple[Round, dict[str, float]]:
    """Dynamic sampling: the first `size` groups of `first` and of further rounds (`more()`: new prompts,
    generated and scored) whose rewards differ, at most `max_rounds` rounds in all. When the bound is
    hit with fewer groups kept, equal-score groups fill the batch (in the order generated) so its shape
    stays fixed; the `rollout/filled_uniform` metric says what share of the batch they are. Returns the
    batch (all rounds' `waited_s` summed) and the sampling metrics; raises `NothingInformative` when no
    round kept a single group."""
    kept: list[tuple[Round, int]] = []
    uniform: list[tuple[Round, int]] = []
    generated = 0
    rounds = 0
    waited = 0.0
    current = first
    while True:
        rounds += 1
        generated += len(current.prompts)
        waited += current.waited_s
        differ = differing_groups(current.scores, n).tolist()
        kept += [(current, i) for i, d in enumerate(differ) if d]
        uniform += [(current, i) for i, d in enumerate(differ) if not d]
        if len(kept) >= size or rounds >= max_rounds:
            break
        current = more()
    if not kept:
        raise NothingInformative(
            f"dynamic sampling: all {generated} prompts of {rounds} rounds (algorithm.max_sampling_rounds="
            f"{max_rounds}) had samples that all scored the same, so there is nothing to learn from: use an "
            f"easier task or a stronger starting model, raise rollout.n, or set algorithm.dynamic_sampling=false"
        )
    chosen = kept[:size] + uniform[: max(0, size - len(kept))]
    prompts, completions, scores = [], [], []
    for source, i in chosen:
        prompts.append(source.prompts[i])
        completions += source.completions[i * n : (i + 1) * n]
        scores.append(source.scores[i * n : (i + 1) * n])
    metrics = {
        "rollout/sampling_rounds": float(rounds),
        "rollout/kept_fraction": len(kept) / generated,
        "rollout/samples_per_kept": generated / min(len(kept), size),
        "rollout/filled_uniform": max(0, size - len(kept)) / size,
    }
    return Round(prompts, completions, torch.cat(scores), waited), metrics

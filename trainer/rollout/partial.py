"""Partial rollouts (`rollout.partial`): generations in flight take new weights as they arrive.

With `rollout.max_staleness` >= 1 the engines generate the next batches while the policy trains, and an engine
runs one call at a time: weights pushed meanwhile are loaded after the batches it is generating. With
rollout.partial an engine generates a batch in segments of `rollout.partial_segment_tokens` tokens; between
two segments it asks the queue's `WeightBoard` whether newer weights have been pushed and, once they are in the
object store, loads them and continues the unfinished samples from their prefixes (prompt + tokens so far) with
the new weights. Each token records the weight version that generated it, and its log-probability is the one of
those weights (the importance correction, `rollout.logprob_correction_mode`, works per token). A sample
finished in a segment (end-of-sequence or a stop string) is not continued.

    weights_board = board()                            # the queue's, one per run (a Ray actor)
    weights_board.post.remote(3, [weights_ref])        # at push 3, before the engines' ordered load
    completions = generate_in_segments(engine.generate, prompts, settings, 16, version, newer)  # on an engine

The engines' ordered `load_weights` of a push that an engine already took mid-generation is skipped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .engines import Completion


def segment_tokens(rollout_cfg) -> int:
    """The tokens an engine generates between two looks at the board: rollout.partial_segment_tokens, or with 0
    a quarter of rollout.max_new_tokens (at least one)."""
    if rollout_cfg.partial_segment_tokens:
        return rollout_cfg.partial_segment_tokens
    return max(1, rollout_cfg.max_new_tokens // 4)


def generate_in_segments(
    generate: Callable,
    prompts: list[list[int]],
    settings,
    segment: int,
    version: int,
    newer: Callable[[], int],
    stop_at: Callable[[list[int]], int | None] | None = None,
) -> list[Completion]:
    """`generate(prompts, settings)` (an engine's) in segments of `segment` tokens, with weights that may change
    between them: `version` is the engines' weights at the start, `newer()` loads newer ones if any are ready and
    returns the version now loaded. `stop_at(tokens)`: the length of the response up to the end of its first stop
    string, None without one (an engine sees a stop string only within one call, so one that a segment boundary
    splits is found here, and what was generated after it dropped); None without stop strings. Returns the
    completions in the order `generate` would (prompt i's n samples at i*n), each with `versions`."""
    total = settings.max_new_tokens
    first = generate(prompts, dataclasses.replace(settings, max_new_tokens=min(segment, total)))
    out = [
        Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, versions=[version] * len(c.token_ids))
        for c in first
    ]
    prompt_of = [prompts[i // settings.n] for i in range(len(out))]
    round_ = 1
    while True:
        open_ = [i for i, c in enumerate(out) if c.finish_reason == "length" and len(c.token_ids) < total]
        if not open_:
            return out
        version = newer()
        done = len(out[open_[0]].token_ids)  # every open sample filled each segment so far: the same length
        more = dataclasses.replace(
            settings, n=1, max_new_tokens=min(segment, total - done), seed=settings.seed + 7919 * round_
        )
        continued = generate([prompt_of[i] + out[i].token_ids for i in open_], more)
        for i, c in zip(open_, continued):
            sample = out[i]
            sample.token_ids += c.token_ids
            sample.logprobs += c.logprobs
            sample.versions += [version] * len(c.token_ids)
            sample.finish_reason = c.finish_reason
            end = stop_at(sample.token_ids) if stop_at is not None else None
            if end is not None:
                _cut(sample, end)
        round_ += 1


def _cut(sample: Completion, end: int) -> None:
    """`sample` ends at its stop string, which ends at token `end`."""
    del sample.token_ids[end:], sample.logprobs[end:], sample.versions[end:]
    sample.finish_reason = "stop"


class WeightBoard:
    """The latest pushed weights, where engines in the middle of a batch can see them (a Ray actor the queue
    makes with `board()`; no resources). Holds one push: an older one is of no use to any engine."""

    def __init__(self):
        self.version = 0
        self.weights: list = []
        """[the push's object ref] (in a list, so that Ray hands the ref itself and not its value)."""

    def post(self, version: int, weights: list) -> None:
        if version > self.version:
            self.version, self.weights = version, weights

    def newer_than(self, version: int) -> tuple[int, list] | None:
        """(version, [ref]) of a push newer than `version`; None when there is none."""
        return (self.version, self.weights) if self.version > version else None


def board():
    """A new WeightBoard actor (no CPU: it only holds a reference)."""
    import ray

    return ray.remote(num_cpus=0)(WeightBoard).remote()

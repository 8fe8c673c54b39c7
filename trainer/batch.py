"""The rollout batch that moves between roles: a dict of tensors sharing the first dimension.

Layout (N sequences, P prompt positions, R response positions):
    input_ids       [N, P+R]  left-padded prompt, then right-padded response
    attention_mask  [N, P+R]  1 on real tokens
    response_mask   [N, R]    1 on real response tokens
Roles add per-token tensors of shape [N, R] (logprobs, ref_logprobs, values, advantages, ...).
"""

from __future__ import annotations

from typing import Iterator

import torch


class Batch(dict):
    """`dict[str, Tensor]` whose tensors all have the same first dimension."""

    @property
    def size(self) -> int:
        return next(iter(self.values())).shape[0]

    @property
    def prompt_width(self) -> int:
        return self["input_ids"].shape[1] - self["response_mask"].shape[1]

    def select(self, index: torch.Tensor | list[int] | slice) -> "Batch":
        return Batch({k: v[index] for k, v in self.items()})

    def only(self, *keys: str) -> "Batch":
        return Batch({k: self[k] for k in keys if k in self})

    def chunks(self, size: int) -> Iterator["Batch"]:
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generation used them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                engine_logprobs: list[list[float]] | None = None) -> Batch:
    """Pack prompt and response token ids into the padded layout above."""
    width_p = max(len(p) for p in prompts)
    width_r = max(1, max(len(r) for r in responses))
    n = len(prompts)
    input_ids = torch.full((n, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width_p + width_r), dtype=torch.long)
    response_mask = torch.zeros((n, width_r), dtype=torch.float32)
    engine_lp = torch.zeros((n, width_r), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, width_p - len(p):width_p] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width_p - len(p):width_p] = 1
        if r:
            input_ids[i, width_p:width_p + len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width_p:width_p + len(r)] = 1
            response_mask[i, :len(r)] = 1
            if engine_logprobs is not None:
                engine_lp[i, :len(r)] = torch.tensor(engine_logprobs[i][:len(r)], dtype=torch.float32)
    batch = Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask)
    if engine_logprobs is not None:
        batch["engine_logprobs"] = engine_lp
    return batch

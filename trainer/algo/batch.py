"""The rollout batch that moves between roles: a dict of tensors sharing the first dimension.

Layout (N sequences, P prompt positions, R response positions):
    input_ids       [N, P+R]  left-padded prompt, then right-padded response
    attention_mask  [N, P+R]  1 on real tokens
    response_mask   [N, R]    1 on real response tokens
    loss_mask       [N, R]    multi-turn rollouts only: 1 on generated response tokens, 0 on the
                              observations the trainer inserted and on padding (see multiturn.py)
    truncated       [N]       bool, the response was cut off at the length limit (finish_reason
                              `length`); present when the finish reasons are given
Roles add per-token tensors of shape [N, R] (logprobs, ref_logprobs, values, advantages, ...).

Also how a step's batch is split between workers: `update_shards` (mini-batches per rank, with the
global token counts that normalise the loss), `split_batch` and `split_evenly` (contiguous parts).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from .ppo_math import loss_normalizer

# dtypes numpy holds as they are; bfloat16 travels as its int16 bit pattern.
_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


class _BFloat16Bits:
    """A bfloat16 tensor's bits as an int16 array (numpy has no bfloat16)."""

    def __init__(self, bits: np.ndarray):
        self.bits = bits


def to_wire(t: torch.Tensor):
    """A CPU tensor as a numpy array for Ray: pickle protocol 5 sends numpy buffers without copying
    them, while a pickled torch tensor goes through torch.save (about 0.3 ms each, even when tiny)."""
    if t.device.type != "cpu":
        return t
    t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return t.contiguous().resolve_conj().resolve_neg().numpy()
    if t.dtype == torch.bfloat16:
        return _BFloat16Bits(t.contiguous().view(torch.int16).numpy())
    return t


def from_wire(x) -> torch.Tensor:
    """The inverse of `to_wire`. Ray hands out read-only buffers, which torch must not write: copy those."""
    if isinstance(x, _BFloat16Bits):
        return from_wire(x.bits).view(torch.bfloat16)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x if x.flags.writeable else x.copy())
    return x


def _rebuild_batch(items: dict) -> Batch:
    return Batch({k: from_wire(v) for k, v in items.items()})


FULL_WIDTH = ("input_ids", "attention_mask")
"""The [N, P+R] tensors of a Batch; every other per-token tensor is [N, R]."""


class Batch(dict):
    """`dict[str, Tensor]` whose tensors all have the same first dimension."""

    def __reduce__(self):  # how a Batch crosses between Ray workers: see to_wire
        return _rebuild_batch, ({k: to_wire(v) for k, v in self.items()},)

    @property
    def size(self) -> int:
        return next(iter(self.values())).shape[0]

    @property
    def prompt_width(self) -> int:
        return self["input_ids"].shape[1] - self["response_mask"].shape[1]

    def select(self, index: torch.Tensor | list[int] | slice) -> Batch:
        return Batch({k: v[index] for k, v in self.items()})

    def columns(self) -> tuple[list[int], list[int], list[int]]:
        """Per row, read back at once: its real tokens, its first real prompt column (the prompt width if it
        has none) and one past its last real response column (0 for an empty response)."""
        mask = self["attention_mask"].bool()
        width = self.prompt_width
        prompt, response = mask[:, :width], mask[:, width:]
        first = torch.where(
            prompt.any(1), prompt.int().argmax(1), torch.full_like(prompt[:, 0], width, dtype=torch.long)
        )
        positions = torch.arange(1, response.shape[1] + 1, device=mask.device)
        end = (response * positions).amax(1) if response.shape[1] else torch.zeros_like(first)
        real, first, end = torch.stack([mask.sum(1), first, end]).tolist()
        return real, first, end

    def cut(self, first: int, keep: int) -> Batch:
        """The same sequences from prompt column `first` on and with `keep` response positions: the columns
        every row pads dropped (Batch.columns says which). The real tokens keep their positions
        (`position_ids` counts from each row's first real token)."""
        width, responses = self.prompt_width, self["response_mask"].shape[1]
        if first == 0 and keep == responses:
            return self
        out = {}
        for key, value in self.items():
            if key in FULL_WIDTH:
                out[key] = value[:, first : width + keep]
            elif value.dim() >= 2 and value.shape[1] == responses:
                out[key] = value[:, :keep]
            else:
                out[key] = value
        return Batch(out)

    def only(self, *keys: str) -> Batch:
        return Batch({k: self[k] for k in keys if k in self})

    def chunks(self, size: int) -> Iterator[Batch]:
        for start in range(0, self.size, size):
            yield self.select(slice(start, start + size))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generation used them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    engine_logprobs: list[list[float]] | None = None,
    loss_masks: list[list[int] | None] | None = None,
    finish_reasons: list[str] | None = None,
) -> Batch:
    """Pack prompt and response token ids into the padded layout above. `loss_masks` (a Completion's
    `loss_mask` each; None for an all-generated response) adds `loss_mask` when any is given;
    `finish_reasons` (a Completion's each) adds `truncated`."""
    width_p = max(len(p) for p in prompts)
    width_r = max(1, max(len(r) for r in responses))
    input_ids = torch.tensor(
        [[pad_id] * (width_p - len(p)) + p + r + [pad_id] * (width_r - len(r)) for p, r in zip(prompts, responses)],
        dtype=torch.long,
    )
    prompt_len = torch.tensor([len(p) for p in prompts])
    response_len = torch.tensor([len(r) for r in responses])
    positions = torch.arange(width_p + width_r)
    attention_mask = (
        (positions >= width_p - prompt_len[:, None]) & (positions < width_p + response_len[:, None])
    ).long()
    response_mask = (torch.arange(width_r) < response_len[:, None]).float()
    batch = Batch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask)
    if engine_logprobs is not None:
        batch["engine_logprobs"] = torch.tensor(
            [lp[: len(r)] + [0.0] * (width_r - len(r)) for lp, r in zip(engine_logprobs, responses)],
            dtype=torch.float32,
        )
    if loss_masks is not None and any(m is not None for m in loss_masks):
        batch["loss_mask"] = torch.tensor(
            [(m if m is not None else [1] * len(r)) + [0] * (width_r - len(r)) for m, r in zip(loss_masks, responses)],
            dtype=torch.float32,
        )
    if finish_reasons is not None:
        batch["truncated"] = torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
    return batch


def update_shards(batch: Batch, world: int, role_cfg, seed: int) -> tuple[list[Batch], list[float]]:
    """Split a step's sequences into mini-batches (shuffled per epoch) and give each rank its
    contiguous part of every mini-batch. Returns the per-rank batches and each mini-batch's global
    loss normaliser, which makes W ranks and their micro-batches add up to one big batch: its count of
    response tokens, or of non-empty responses when `role_cfg.loss_agg_mode` (the actor's) averages
    over sequences (ppo_math.loss_normalizer). With a token budget (`max_tokens_per_micro_batch`) each
    rank still gets as many sequences, chosen so that the ranks' token counts are close (`by_tokens`)."""
    mode = getattr(role_cfg, "loss_agg_mode", "token-mean")
    n = batch.size
    mini = role_cfg.mini_batch_size
    gen = torch.Generator().manual_seed(seed)
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    normalizers: list[float] = []
    balance = world > 1 and getattr(role_cfg, "max_tokens_per_micro_batch", 0) > 0
    tokens = batch["attention_mask"].sum(1) if balance else None
    for _ in range(role_cfg.ppo_epochs):
        order = torch.randperm(n, generator=gen) if n > mini else torch.arange(n)
        for start in range(0, n, mini):
            idx = order[start : start + mini]
            normalizers.append(loss_normalizer(batch["response_mask"][idx], mode))
            for rank, chunk in enumerate(by_tokens(idx, tokens[idx], world) if balance else idx.chunk(world)):
                parts[rank].append(chunk)
    return [batch.select(torch.cat(p)) for p in parts], normalizers


def by_tokens(idx: torch.Tensor, tokens: torch.Tensor, world: int) -> list[torch.Tensor]:
    """`idx` dealt to `world` ranks, the same number each (len(idx) divides by world), longest first to
    the rank with the fewest tokens so far that still takes sequences. Which rank trains a sequence
    changes no result: the loss normaliser is the whole mini-batch's."""
    share = len(idx) // world
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in torch.argsort(tokens, descending=True, stable=True).tolist():
        rank = min((r for r in range(world) if len(ranks[r]) < share), key=lambda r: load[r])
        ranks[rank].append(int(idx[i]))
        load[rank] += int(tokens[i])
    return [torch.tensor(sorted(r), dtype=idx.dtype) for r in ranks]


def token_groups(lengths: list[int], budget: int, at_least: int = 1) -> list[list[int]]:
    """Indices of sequences of `lengths` tokens grouped into micro-batches of at most `budget` tokens each
    (first fit, longest first; a sequence longer than the budget goes alone), and at least `at_least` groups
    (at most one per sequence): the largest groups are halved until there are (sharded ranks must run the
    same number of forward passes). Each group's indices ascend. The loss normalisers are global
    (`update_shards`), so the grouping changes no result."""
    groups: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for g, tokens in enumerate(used):
            if tokens + lengths[i] <= budget:
                groups[g].append(i)
                used[g] += lengths[i]
                break
        else:
            groups.append([i])
            used.append(lengths[i])
    while len(groups) < min(at_least, len(lengths)):
        g = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: used[g])
        half = groups[g][len(groups[g]) // 2 :]
        groups[g] = groups[g][: len(groups[g]) // 2]
        used[g] -= sum(lengths[i] for i in half)
        groups.append(half)
        used.append(sum(lengths[i] for i in half))
    return [sorted(g) for g in groups]


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Contiguous, near-equal parts of a batch, one per worker. A part is empty only when the batch is
    smaller than the group: never for actor and critic, whose batches the config keeps at least as large
    as their rank count (under FSDP every rank must take part in each call)."""
    return [batch.select(idx) for idx in torch.arange(batch.size).tensor_split(parts)]


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal parts, one per worker (so each prompt's samples stay together)."""
    return [[items[i] for i in idx.tolist()] for idx in torch.arange(len(items)).tensor_split(parts)]

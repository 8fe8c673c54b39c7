"""Packed sequences and token-budget micro-batches for the roles' forward passes.

Padded, a micro-batch of n sequences runs as [n, P+R] (algo/batch.py): the longest sequence sets the
work of every row. Packed (`model.pack_sequences`), the sequences' real tokens run as one row [1, L]:
position ids restart at 0 for each sequence and no attention mask is passed, from which transformers
confines attention to each sequence (a block-diagonal causal mask under sdpa and eager,
flash-attention's varlen kernel under flash_attention_2). The per-token results go back into the
padded [n, R] layout, so everything after the forward pass (the losses) is the same code.

A token budget (`<role>.max_tokens_per_micro_batch`) groups a worker's sequences into micro-batches of
at most that many tokens instead of a fixed count (algo/batch.token_groups). The losses divide by the
mini-batch's global token or sequence count, never by a micro-batch's, so the grouping changes no result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algo.batch import Batch, token_groups
from ..errors import ConfigError, first_line


@dataclass
class Packed:
    """A micro-batch's sequences as one row, and where each response token's output goes back."""

    input_ids: torch.Tensor
    """[1, L] every sequence's real tokens (prompt, then response), one sequence after the other."""
    position_ids: torch.Tensor
    """[1, L] 0, 1, ... within each sequence."""
    predict_at: torch.Tensor
    """[K] the packed positions whose outputs predict (or value) the K real response tokens."""
    targets: torch.Tensor
    """[K] those response tokens."""
    select: torch.Tensor
    """[n, R] bool: where the K outputs go in the padded layout (row by row)."""

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[n, R] from K per-token values (zeros elsewhere); keeps the autograd graph."""
        return values.new_zeros(self.select.shape).masked_scatter(self.select, values.reshape(-1))


def pack(batch: Batch) -> Packed:
    """The packed form of a padded micro-batch (left-padded prompts, right-padded responses)."""
    mask = batch["attention_mask"].bool()
    lengths = mask.sum(1)
    starts = lengths.cumsum(0) - lengths
    ids = batch["input_ids"][mask]  # row by row, each row's real tokens in order
    positions = torch.arange(ids.numel(), device=ids.device) - starts.repeat_interleave(lengths)
    select = mask[:, batch.prompt_width :]
    prompt_lengths = lengths - select.sum(1)
    rows, cols = select.nonzero(as_tuple=True)  # row-major, the order masked_scatter fills
    at = starts[rows] + prompt_lengths[rows] + cols
    return Packed(ids[None], positions[None], at - 1, ids[at], select)


def sequence_tokens(batch: Batch, packed: bool) -> list[int]:
    """What each sequence costs a forward pass: its real tokens packed, the batch's width padded."""
    if packed:
        return batch["attention_mask"].sum(1).tolist()
    return [batch["input_ids"].shape[1]] * batch.size


def micro_batches(
    batch: Batch, count: int, budget: int, packed: bool, agree_on: torch.device | None = None
) -> list[tuple[slice | torch.Tensor, Batch]]:
    """The micro-batches to run `batch` in, each with its rows in `batch`: `count` sequences each in order,
    or, with a token `budget` > 0, as many as fit it. `agree_on`: the device of a sharded role's process
    group, whose ranks must run the same number of forward passes (each gathers the shards): every rank
    takes the largest rank's number of groups."""
    if budget <= 0:
        return [
            (slice(start, start + count), batch.select(slice(start, start + count)))
            for start in range(0, batch.size, count)
        ]
    lengths = sequence_tokens(batch, packed)
    groups = token_groups(lengths, budget)
    if agree_on is not None:
        import torch.distributed as dist

        most = torch.tensor([len(groups)], device=agree_on)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        groups = token_groups(lengths, budget, at_least=int(most.item()))
    return [(rows, batch.select(rows)) for rows in (torch.tensor(g) for g in groups)]


def in_batch_order(parts: list[tuple[slice | torch.Tensor, torch.Tensor]], size: int) -> torch.Tensor:
    """[size, ...] from each micro-batch's result and its rows (from `micro_batches`)."""
    first = parts[0][1]
    out = first.new_zeros((size, *first.shape[1:]))
    for rows, values in parts:
        out[rows] = values
    return out


def use_attention(model: torch.nn.Module, implementation: str) -> None:
    """Make `model` attend with `implementation` (model.attn_implementation) from its next forward pass; a
    no-op once it does. Without CUDA (logical GPUs rehearsed on CPU) flash attention becomes sdpa, which
    computes the same. What the installed transformers or flash-attn cannot run ends with one line."""
    if implementation.startswith("flash_attention") and not torch.cuda.is_available():
        implementation = "sdpa"
    if getattr(model.config, "_attn_implementation", None) == implementation:
        return
    try:
        model.set_attn_implementation(implementation)
    except (ImportError, ValueError) as exc:
        fix = "install the flash-attn package on the GPU nodes" if "flash" in implementation else "choose another"
        raise ConfigError(
            f"model.attn_implementation={implementation} cannot run here ({first_line(exc)[:200]}): {fix}, "
            f"or set model.attn_implementation=sdpa"
        ) from None

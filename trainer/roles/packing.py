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
    """The micro-batches to run `batch` in, each with its rows in `batch`: `count` sequences each, or, with a
    token `budget` > 0, as many as fit it. Padded, the rows go longest first (sequences of similar length
    share a micro-batch) and each micro-batch is cut to its own widest prompt and response (Batch.cut),
    so a forward pass computes its own padding, not the whole batch's. `agree_on`: the device of a sharded
    role's process group, whose ranks must run the same number of forward passes (each gathers the shards):
    every rank takes the largest rank's number of groups."""
    if budget <= 0:
        if packed:
            return [
                (slice(start, start + count), batch.select(slice(start, start + count)))
                for start in range(0, batch.size, count)
            ]
        real, first, end = batch.columns()  # one read-back for every micro-batch
        order = sorted(range(batch.size), key=lambda i: -real[i])
        groups = [sorted(order[start : start + count]) for start in range(0, batch.size, count)]
    else:
        lengths = sequence_tokens(batch, packed)
        groups = token_groups(lengths, budget)
        if agree_on is not None:
            import torch.distributed as dist

            most = torch.tensor([len(groups)], device=agree_on)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            groups = token_groups(lengths, budget, at_least=int(most.item()))
        if not packed:
            _, first, end = batch.columns()
    out = []
    for group in groups:
        micro = batch.select(torch.tensor(group))
        if not packed:  # each padded micro-batch at its own widest prompt and response
            micro = micro.cut(min(first[i] for i in group), max(1, max(end[i] for i in group)))
        out.append((torch.tensor(group), micro))
    return out


def in_batch_order(parts: list[tuple[slice | torch.Tensor, torch.Tensor]], size: int, width: int) -> torch.Tensor:
    """[size, width, ...] from each micro-batch's result [n, w <= width, ...] and its rows (from `micro_batches`):
    a cut micro-batch's results fill its first w response positions, zeros the rest."""
    first = parts[0][1]
    out = first.new_zeros((size, width, *first.shape[2:]))
    for rows, values in parts:
        out[rows, : values.shape[1]] = values
    return out


PACKING_TOLERANCE = {torch.float32: 1e-3}
"""The largest |log-prob| gap between packed and padded passes that counts as agreement: float32's here, and
PACKING_TOLERANCE_16BIT for bfloat16/float16 compute, whose rounding alone moves log-probs by ~1e-2."""
PACKING_TOLERANCE_16BIT = 0.1


def packing_check_batch(vocab_size: int) -> Batch:
    """Three short sequences of different lengths (random token ids, seeded) for the packing self-check."""
    from ..algo.batch import build_batch

    gen = torch.Generator().manual_seed(0)
    high = max(2, min(vocab_size, 4096))

    def ids(n: int) -> list[int]:
        return torch.randint(0, high, (n,), generator=gen).tolist()

    return build_batch([ids(7), ids(12), ids(3)], [ids(6), ids(3), ids(9)], pad_id=0)


def packing_gap(run, vocab_size: int) -> float:
    """The largest |log-prob| difference between one packed and one padded pass of `run(batch, packed)`
    over packing_check_batch's sequences. Packing is exact only where transformers confines attention to
    each sequence from the restarting position ids (its packed-sequence detection, transformers >= 4.53,
    and only for attention kernels and model classes that use it): elsewhere the later sequences attend to
    the earlier ones and the gap is that leak."""
    batch = packing_check_batch(vocab_size)
    mask = batch["response_mask"].bool()
    padded = run(batch, False).float()
    packed = run(batch, True).float()
    return float((padded - packed).abs()[mask].max())


def refuse_inexact_packing(gap: float, compute_dtype: torch.dtype, attention: str) -> None:
    """One line, and the fixes, when packing_gap found the packed pass differing from the padded one."""
    tolerance = PACKING_TOLERANCE.get(compute_dtype, PACKING_TOLERANCE_16BIT)
    if gap <= tolerance:
        return
    import transformers

    raise ConfigError(
        f"model.pack_sequences=true: a packed forward pass of this model differs from a padded one by up to "
        f"{gap:.3g} in log-prob (tolerance {tolerance:g}), so packed sequences would attend to each other "
        f"(transformers {transformers.__version__}, attention {attention}): set model.pack_sequences=false, or "
        f"use a model class and attention kernel whose transformers confines attention by position ids "
        f"(transformers >= 4.53 with sdpa or flash_attention_2, no trust_remote_code model)"
    )


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

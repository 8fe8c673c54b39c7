"""Exact-math checks of float model outputs computed two ways (packed and padded, sharded and not, merged and
adapted): equal up to the rounding of the dtype at the values' own scale."""

from __future__ import annotations

import torch

# Float summation order differs between CPU kernels (and between batch shapes of one kernel): the same math lands
# a few ulps of the largest value apart, more through a deep network's layers; 64 ulps leaves room for that.
ULPS = 64


def assert_same_math(
    actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None, computed_in: torch.dtype | None = None
) -> None:
    """`actual` equals `expected` to ULPS units of the dtype's precision at max|expected|, with no relative
    slack: a computation that mixed in other tokens (a leak between packed sequences, a wrong shard) moves values
    by their own scale, thousands of times more. `computed_in`: the dtype the values were computed in, when
    coarser than the one they are held in (bf16 autocast into float32 results): one of its ulps instead."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    atol = ULPS * torch.finfo(expected.dtype).eps * scale
    if computed_in is not None and torch.finfo(computed_in).eps > torch.finfo(expected.dtype).eps:
        atol = torch.finfo(computed_in).eps * scale
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=msg)

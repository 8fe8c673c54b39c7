"""Random [B, T] batches for the loss tests: every row a different response length (one empty, one full),
and garbage on the padding, so a function that reads a padded position fails its naive-loop comparison."""

from __future__ import annotations

import torch

SEEDS = [0, 1, 2]
GARBAGE = 1e6


def make_batch(seed, B=8, T=7):
    """Random lengths (one 0, one T), float64 mask [B, T] and a generator for more data."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g).tolist()
    lengths[0], lengths[1] = 0, T
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths], dtype=torch.float64)
    return lengths, mask, g


def rand(g, mask, scale=1.0):
    """[B, T] normal values on valid tokens, GARBAGE on padding."""
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64) * scale
    return torch.where(mask.bool(), x, GARBAGE)

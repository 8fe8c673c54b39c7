"""Real models' shapes as transformers configs, without weights: what the memory plan and `cloudrl plan` read."""

from __future__ import annotations

from transformers import Qwen2Config

QWEN_7B = Qwen2Config(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    tie_word_embeddings=False,
)
"""Qwen2.5-7B's shape."""

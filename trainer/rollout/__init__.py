"""Generation: the HF and vLLM engines, the rollout queue, weight sync, multi-turn turns."""

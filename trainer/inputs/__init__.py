"""What a run reads: prompts, hub datasets, the built-in demo task, reward functions, models."""

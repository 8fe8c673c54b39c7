"""The PPO math, advantages and batch layout: pure torch, no Ray."""

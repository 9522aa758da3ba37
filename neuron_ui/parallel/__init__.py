"""Tensor parallelism under torchrun: group set-up, health, the lockstep leader and its followers."""

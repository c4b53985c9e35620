"""Gradients and the optimizer step: gradient buckets and their reduction (replicated at stage 1, sharded at 2 and
3), the step window each optimizer steps in, paged steps, loss scaling and loss weights, the optimizer probe."""

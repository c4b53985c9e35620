"""Stage 3: gather units, the scheduler that gathers and frees them around forward and backward (prefetch, the
backward plan, the divergence check), what a backward passes over, and activation checkpointing of units."""

"""Checkpoint files: sharded directories (save, load at any world size and stage) and consolidation.

Uses ``core`` only, never Lightning (see docs/design.md: dependencies point one way).
"""

from lightning_zero.checkpoint.consolidate import consolidate, full_checkpoint
from lightning_zero.checkpoint.metadata import FORMAT_VERSION, CheckpointError
from lightning_zero.checkpoint.saving import remove_sharded, save_sharded
from lightning_zero.checkpoint.sharded import ShardedCheckpoint, load_sharded_optimizers, load_sharded_params

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "ShardedCheckpoint",
    "consolidate",
    "full_checkpoint",
    "load_sharded_optimizers",
    "load_sharded_params",
    "remove_sharded",
    "save_sharded",
]

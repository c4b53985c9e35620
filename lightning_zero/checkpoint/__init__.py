"""Checkpoint files: sharded directories (save, load at any world size and stage), consolidation, and DCP in and out.

Uses ``core`` only, never Lightning (see docs/design.md: dependencies point one way).
"""

from lightning_zero.checkpoint.consolidate import consolidate, full_checkpoint
from lightning_zero.checkpoint.convert import convert
from lightning_zero.checkpoint.dcp_layout import is_dcp_checkpoint
from lightning_zero.checkpoint.dcp_read import DcpCheckpoint
from lightning_zero.checkpoint.metadata import FORMAT_VERSION, CheckpointError
from lightning_zero.checkpoint.opening import open_checkpoint
from lightning_zero.checkpoint.saving import remove_sharded, save_sharded
from lightning_zero.checkpoint.sharded import ShardedCheckpoint, load_sharded_optimizers, load_sharded_params

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "DcpCheckpoint",
    "ShardedCheckpoint",
    "consolidate",
    "convert",
    "full_checkpoint",
    "is_dcp_checkpoint",
    "load_sharded_optimizers",
    "load_sharded_params",
    "open_checkpoint",
    "remove_sharded",
    "save_sharded",
]

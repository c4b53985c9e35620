"""Open a checkpoint directory, a lightning_zero sharded one or a ``torch.distributed.checkpoint`` (DCP) one."""

from __future__ import annotations

import os

from lightning_zero.checkpoint.dcp_layout import is_dcp_checkpoint
from lightning_zero.checkpoint.dcp_read import DcpCheckpoint
from lightning_zero.checkpoint.sharded import ShardedCheckpoint
from lightning_zero.core.comm import Communicator


def open_checkpoint(path: str | os.PathLike, comm: Communicator | None = None) -> ShardedCheckpoint:
    """``path`` opened for reading: a DCP directory (it has ``.metadata``) as a :class:`DcpCheckpoint`, any other as
    a verified :class:`ShardedCheckpoint` (``comm``: the ranks that share its checksums, collective)."""
    if is_dcp_checkpoint(path):
        return DcpCheckpoint(path)
    return ShardedCheckpoint(path, comm=comm)

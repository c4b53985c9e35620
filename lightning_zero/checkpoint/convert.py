"""``convert(sharded_dir, out_dir, to=...)``: a sharded checkpoint in another system's format."""

from __future__ import annotations

import os
from collections.abc import Callable

from lightning_zero.checkpoint.dcp_write import write_dcp

FORMATS = ("dcp",)


def convert(
    sharded_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    to: str = "dcp",
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write the sharded checkpoint ``sharded_dir`` in format ``to``.

    ``to="dcp"``: a ``torch.distributed.checkpoint`` directory that FSDP2 (``fully_shard``, at any world size),
    Lightning's ``ModelParallelStrategy`` and plain models load: ``model.<key>`` and ``optim.*`` as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` names them, the same tensors under Lightning's
    ``state_dict.<key>`` and ``optimizer_<n>.*``, and Lightning's loop state in ``meta.pt`` (see docs/checkpoints.md,
    "DCP bridge"). Tensors are read and written one at a time.

    Example::

        lightning_zero.convert("ckpts/epoch=3.ckpt", "ckpts/epoch=3-dcp", to="dcp")

    Args:
        sharded_dir: the directory ``trainer.save_checkpoint`` wrote with ``state_dict_type="sharded"``.
        out_dir: the directory to write; it must not exist or be empty (written under a temporary name, then
            renamed).
        to: the output format; ``"dcp"``.
        progress: called as ``progress(bytes_written, total_bytes)`` after each tensor.

    Raises:
        CheckpointError: if the checkpoint is incomplete, corrupt or of an unsupported format version, or if
            ``out_dir`` exists and is not empty.
        ValueError: for an unknown ``to``, or an ``out_dir`` inside ``sharded_dir``.
    """
    if to not in FORMATS:
        raise ValueError(f"convert(to={to!r}) is not a known format: choose one of {list(FORMATS)}.")
    write_dcp(sharded_dir, out_dir, progress)

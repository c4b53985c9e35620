"""Where a model's and its optimizers' state lie in a ``torch.distributed.checkpoint`` (DCP) directory.

[Note: the DCP layout]
DCP flattens a nested state dict into keys joined by dots and keeps each key's path in ``Metadata.planner_data``.
Two layouts are in use, and a directory that ``lightning_zero.convert`` writes has both, over the same bytes:

- torch's (``dcp.save({"model": model_sd, "optim": optim_sd})`` with ``get_state_dict(model, optimizers)``):
  ``model.<key>`` for every key of the module's ``state_dict``; ``optim.state.<parameter name>.<state key>``
  (``exp_avg``, ``exp_avg_sq``, ``step``) and ``optim.param_groups.<i>.<hyper-parameter>``, where ``params`` lists
  parameter names. Several optimizers are merged into one ``optim``, as ``get_state_dict`` merges them.
- Lightning's ``ModelParallelStrategy`` (and ``FSDPStrategy`` with sharded checkpoints): ``state_dict.<key>``,
  ``optimizer_<n>.state...`` and ``optimizer_<n>.param_groups...`` per optimizer, and the rest of the Lightning
  checkpoint (epoch, global_step, loops, callbacks, LR schedulers, hyper-parameters) pickled in ``meta.pt``.

The converted directory writes each tensor once: its Lightning keys are aliases, entries of the metadata that
point at the bytes of the torch keys, so either reader loads it and the directory is no larger than one layout.
"""

from __future__ import annotations

import re
from pathlib import Path

DCP_METADATA_FILE = ".metadata"  # what torch.distributed.checkpoint writes last, and how a DCP directory is told
LIGHTNING_META_FILE = "meta.pt"  # Lightning's non-tensor checkpoint entries beside a DCP checkpoint
TORCH_MODEL, TORCH_OPTIM = "model", "optim"
LIGHTNING_MODEL = "state_dict"
_LIGHTNING_OPTIMIZER = re.compile(r"optimizer_(\d+)")


def lightning_optimizer(index: int) -> str:
    return f"optimizer_{index}"


def is_dcp_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory that ``torch.distributed.checkpoint.save`` wrote."""
    return (Path(path) / DCP_METADATA_FILE).is_file()


def lightning_optimizer_index(top: str) -> int | None:
    """``n`` of a top-level key ``optimizer_<n>`` (Lightning's layout), else ``None``."""
    match = _LIGHTNING_OPTIMIZER.fullmatch(top)
    return int(match.group(1)) if match else None

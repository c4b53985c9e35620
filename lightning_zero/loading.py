"""``load_from_checkpoint``: a LightningModule from a checkpoint, sharded directory or ordinary file, in one line."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH
from lightning.pytorch.core.saving import _load_state

from lightning_zero.checkpoint import open_checkpoint

Module = TypeVar("Module", bound=pl.LightningModule)


def load_from_checkpoint(
    cls: type[Module],
    path: _PATH,
    *,
    map_location: _MAP_LOCATION_TYPE = None,
    strict: bool = True,
    **kwargs: Any,
) -> Module:
    """``cls.load_from_checkpoint(path)`` that also opens the sharded directories ZeroStrategy writes and
    ``torch.distributed.checkpoint`` directories (FSDP2, ``ModelParallelStrategy``; see docs/checkpoints.md).

    The module is built from the checkpoint's hyper-parameters (``self.save_hyperparameters()``), updated by
    ``kwargs``, and its weights are read from the shard files one tensor at a time (the fp32 masters of a 16-bit
    run). No process group is needed. An ordinary ``.ckpt`` file is handed to ``cls.load_from_checkpoint``.

    Example::

        model = lightning_zero.load_from_checkpoint(MyModel, trainer.checkpoint_callback.best_model_path)

    Args:
        cls: the LightningModule class the checkpoint was trained with.
        path: a sharded or DCP checkpoint directory, or an ordinary checkpoint file.
        map_location: where to put the weights (a device, or as ``torch.load`` takes it); default: the CPU.
        strict: whether the checkpoint's keys must match the module's exactly.
        kwargs: hyper-parameters that override the saved ones.

    Raises:
        lightning_zero.checkpoint.CheckpointError: for a damaged, incomplete or foreign sharded checkpoint.
    """
    if not os.path.isdir(path):
        return cls.load_from_checkpoint(path, map_location=map_location, strict=strict, **kwargs)
    sharded = open_checkpoint(path)
    checkpoint = sharded.lightning_state()
    checkpoint["state_dict"] = sharded.full_state_dict()
    sharded.release()
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    assert isinstance(model, cls)
    if isinstance(map_location, str | torch.device):
        model = model.to(map_location)
    return model

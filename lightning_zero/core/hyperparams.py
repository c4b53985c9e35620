"""Every rank steps with the same hyper-parameters: one small collective per step says so, or names what differs.

[Note: agreeing on hyper-parameters]
Each rank updates only what it owns, with its own copy of the optimizer's param groups. A learning-rate scheduler
stepped on one rank only, or a ``group["lr"]`` set from rank-local data, would make the ranks update their shards
with different values: a model no single optimizer could have produced, and nothing would fail. So before each
step the ranks agree on a fingerprint (CRC-32 of the ``repr`` of every group's hyper-parameters: learning rate
after the schedulers, betas, weight decay, ...): one all-reduce of two integers (the maximum of ``h`` and of
``-h``). Where they differ, every rank gathers every rank's values and raises the same error, naming the
optimizer, the group, the key and each rank's value.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator

_NOT_HYPERPARAMETERS = ("params", "param_names")


def describe(optimizer: Optimizer) -> list[list[tuple[str, Any]]]:
    """Per param group, its hyper-parameters as sorted ``(key, value)`` pairs of plain values."""
    return [
        sorted((key, _plain(value)) for key, value in group.items() if key not in _NOT_HYPERPARAMETERS)
        for group in optimizer.param_groups
    ]


def _plain(value: Any) -> Any:
    """A value every rank can compare: numbers, strings and their tuples as they are; other objects (a function,
    whose ``repr`` holds a per-process address) by their type."""
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


class HyperparameterAgreement:
    """Checks, once per step of ``optimizer``, that every rank has its hyper-parameters. See the note above."""

    def __init__(self, comm: Communicator, device: torch.device, label: str) -> None:
        self.comm = comm
        self.device = device
        self.label = label  # names the optimizer in the error, e.g. "optimizer 0 (Muon)"

    def check(self, optimizer: Optimizer) -> None:
        """Raise the same ``RuntimeError`` on every rank unless all ranks hold equal hyper-parameters (collective)."""
        mine = describe(optimizer)
        fingerprint = zlib.crc32(repr(mine).encode())
        extremes = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=self.device)
        self.comm.all_reduce(extremes, op="max")
        if int(extremes[0]) == -int(extremes[1]):  # max == min: every rank has the same fingerprint
            return
        everyone = self.comm.all_gather_object(mine)
        raise RuntimeError(self._difference(everyone))

    def _difference(self, everyone: list[list[list[tuple[str, Any]]]]) -> str:
        fix = (
            "Every rank must step every optimizer with the same hyper-parameters: step learning-rate schedulers on "
            "every rank (Lightning does), and set group values from data every rank has."
        )
        reference = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            for group_index, (ours, other) in enumerate(zip(reference, theirs, strict=False)):
                ours_dict, other_dict = dict(ours), dict(other)
                for key in sorted(set(ours_dict) | set(other_dict)):
                    if ours_dict.get(key, "<missing>") != other_dict.get(key, "<missing>"):
                        return (
                            f"ranks disagree on the hyper-parameters of {self.label} param group {group_index}: rank 0 "
                            f"has {key}={ours_dict.get(key, '<missing>')!r}, rank {rank} has "
                            f"{key}={other_dict.get(key, '<missing>')!r}. {fix}"
                        )
            if len(theirs) != len(reference):
                return (
                    f"ranks disagree on {self.label}: rank 0 has {len(reference)} param groups, rank {rank} has "
                    f"{len(theirs)}. {fix}"
                )
        return f"ranks disagree on the hyper-parameters of {self.label} (their fingerprints differ). {fix}"

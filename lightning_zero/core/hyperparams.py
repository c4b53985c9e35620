"""Every rank steps with the same hyper-parameters: one small collective per step says so, or names what differs.

[Note: agreeing on hyper-parameters]
Each rank updates only what it owns, with its own copy of the optimizer's param groups. A learning-rate scheduler
stepped on one rank only, or a ``group["lr"]`` set from rank-local data, would make the ranks update their shards
with different values: a model no single optimizer could have produced, and nothing would fail. So before each
step the ranks agree on a fingerprint (CRC-32 of the ``repr`` of every group's hyper-parameters: learning rate
after the schedulers, betas, weight decay, ...): one all-reduce of two integers (the maximum of ``h`` and of
``-h``). Where they differ, every rank gathers every rank's values and raises the same error, naming the
optimizer and every key of every group that differs, with each rank's value (a scheduler created or stepped on one
rank changes ``initial_lr`` and ``lr`` at once; the error names both).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
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
        raise RuntimeError(describe_difference(self.label, everyone))


_FIX = (
    "Every rank must step every optimizer with the same hyper-parameters: step learning-rate schedulers on every "
    "rank (Lightning does), and set group values from data every rank has."
)


class _Missing:
    """A key one rank's group lacks (e.g. ``initial_lr``, which a scheduler adds): shown as ``<missing>``."""

    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def describe_difference(label: str, everyone: list[list[list[tuple[str, Any]]]]) -> str:
    """The error for ranks whose descriptions (``everyone[rank]``, from :func:`describe`) differ: every differing
    key of every param group, with the value of every rank (ranks that agree listed together). A pure function of
    ``everyone``, so every rank builds the same message."""
    parts = []
    counts = [len(groups) for groups in everyone]
    if len(set(counts)) > 1:
        parts.append(f"param groups: {_by_rank(counts, _group_count)}")
    for group_index in range(min(counts)):
        groups = [dict(groups[group_index]) for groups in everyone]
        keys = sorted(set().union(*groups))
        differing = [key for key in keys if len({repr(group.get(key, _MISSING)) for group in groups}) > 1]
        if differing:
            listed = "; ".join(_by_rank([g.get(key, _MISSING) for g in groups], _assignment(key)) for key in differing)
            parts.append(f"param group {group_index}: {listed}")
    if not parts:  # equal values with another fingerprint cannot happen; say so rather than claim a difference
        parts.append("their fingerprints differ")
    return f"ranks disagree on the hyper-parameters of {label}: {'. '.join(parts)}. {_FIX}"


def _group_count(count: int) -> str:
    return f"{count} param group{'s' * (count != 1)}"


def _assignment(key: str) -> Callable[[Any], str]:
    return lambda value: f"{key}={value!r}"


def _by_rank(values: list[Any], show: Callable[[Any], str]) -> str:
    """``"rank 0 has lr=0.1, ranks 1-3, 5 have lr=0.05"``: each distinct value (by ``repr``, as the fingerprint
    compares them) once, with the ranks that hold it, in the order of their first rank."""
    ranks: dict[str, list[int]] = {}
    shown: dict[str, str] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value), []).append(rank)
        shown.setdefault(repr(value), show(value))
    return ", ".join(
        f"rank {held[0]} has {shown[key]}" if len(held) == 1 else f"ranks {_ranges(held)} have {shown[key]}"
        for key, held in ranks.items()
    )


def _ranges(ranks: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)

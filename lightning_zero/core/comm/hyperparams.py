"""Every rank steps with the same hyper-parameters: the agreement at the end of each backward says so, or names what
differs.

[Note: agreeing on hyper-parameters]
Each rank updates only what it owns, with its own copy of the optimizer's param groups. A learning-rate scheduler
stepped on one rank only, or a ``group["lr"]`` set from rank-local data, would make the ranks update their shards
with different values: a model no single optimizer could have produced, and nothing would fail. So the ranks agree
on a fingerprint (CRC-32 of the ``repr`` of every optimizer's groups' hyper-parameters: learning rate after the
schedulers, betas, weight decay, ...) in the agreement every reducing backward already makes (which parameters got
a gradient, see [Note: bucket order]): its four bytes and their complements ride in that all-reduce of the maximum
(equal maxima of ``b`` and ``255 - b`` mean every rank has ``b``), 16 bytes more and no collective of its own. That
is after ``training_step`` and the loop's ``optimizer_step`` (where Lightning's warm-up recipes set ``lr``) and
before the step; values changed after the last backward (``on_before_optimizer_step``) are compared at the next.
Where they differ, every rank gathers every rank's values and raises the same error, naming the optimizer and every
key of every group that differs, with each rank's value (a scheduler created or stepped on one rank changes
``initial_lr`` and ``lr`` at once; the error names both).

The fingerprint also covers how many steps each optimizer has ended and how many reducing backwards its held
gradients took in since its last ``zero_grad``: a rank that skips ``optimizer.step()`` (manual optimization under a
rank-local condition) would leave its shards a step behind the others', one that skips ``zero_grad`` would add two
steps' gradients into the shard it owns: models no run of the optimizer produces, silently at stage 3, whose step
has no collective (and at stage 2 for ``zero_grad``). The next backward's agreement names it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.core.comm.communicator import Communicator

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
    """Rides on the end-of-backward agreement: :meth:`payload` before it, :meth:`verify` after. See the note above.

    Args:
        comm: the ranks that step together.
        optimizers: every optimizer the engine steps, in order (their param groups are read at each agreement).
    """

    PAYLOAD = 8  # bytes riding in the agreement: the fingerprint's four, then their complements

    def __init__(
        self,
        comm: Communicator,
        optimizers: Sequence[Optimizer],
        counts: Callable[[], Mapping[int, tuple[int, int]]] = dict,
    ) -> None:
        self.comm = comm
        self.optimizers = list(optimizers)
        self.counts = counts  # by id(optimizer): the steps it ended, the reductions it holds since its zero_grad

    def _described(self) -> tuple[list[Any], list[tuple[int, int]]]:
        counts = self.counts()
        return [describe(o) for o in self.optimizers], [tuple(counts.get(id(o), (0, 0))) for o in self.optimizers]

    def payload(self) -> list[int]:
        """This rank's fingerprint as values for an all-reduce of the maximum of bytes."""
        fingerprint = zlib.crc32(repr(self._described()).encode())
        high = list(fingerprint.to_bytes(4, "little"))
        return high + [255 - byte for byte in high]

    def verify(self, merged: Sequence[int]) -> None:
        """After the all-reduce: raise the same ``RuntimeError`` on every rank unless all sent equal fingerprints
        (collective then, on every rank: each sees the same maxima)."""
        if list(merged[:4]) == [255 - byte for byte in merged[4:]]:  # max == min for every byte
            return
        gathered = self.comm.all_gather_object(self._described())
        everyone, steps = [groups for groups, _ in gathered], [counts for _, counts in gathered]
        labels = [f"optimizer {index} ({type(optimizer).__name__})" for index, optimizer in enumerate(self.optimizers)]
        messages = [
            describe_difference(label, [ours[index] for ours in everyone])
            for index, label in enumerate(labels)
            if any(ours[index] != everyone[0][index] for ours in everyone)
        ]
        for index, label in enumerate(labels):
            taken, held = ([ours[index][k] for ours in steps] for k in (0, 1))
            if len(set(taken)) > 1:
                messages.append(f"ranks disagree on the steps {label} has taken: {_by_rank(taken, str)}. {_STEP_FIX}")
            elif len(set(held)) > 1:
                messages.append(
                    f"ranks disagree on the backward passes whose gradients {label} holds since its zero_grad: "
                    f"{_by_rank(held, str)}. {_ZERO_GRAD_FIX}"
                )
        raise RuntimeError(" ".join(messages) or describe_difference("the optimizers", [[] for _ in everyone]))


_FIX = (
    "Every rank must step every optimizer with the same hyper-parameters: step learning-rate schedulers on every "
    "rank (Lightning does), and set group values from data every rank has."
)

_STEP_FIX = (
    "Every rank must call optimizer.step() together (each rank steps only the shard it owns): skip a step on every "
    "rank or on none, and give every rank the same number of batches and the same accumulate_grad_batches."
)

_ZERO_GRAD_FIX = (
    "Every rank must call zero_grad() together: a rank that skips it adds the next gradients to the ones it holds, "
    "in the shard only it steps."
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

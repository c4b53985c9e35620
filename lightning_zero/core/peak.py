"""The peak of a training step by kind: what the core allocates beyond the model states, and when it is most.

[Note: step peak ledger]
Model states (parameters, gradient shards, optimizer state and masters) are measured from the tensors a rank holds
(core/memory.py). The core also allocates buffers that live for part of a step only: stage 3's gathered units
(``gathered``: full unit buffers, prefetched ones included), gradient buckets (``buckets``: full-size staging
buffers and reduce-scatter outputs), the step's own temporaries (``temporaries``: the wide step gradients of a
master copy, made by ``prepare`` and freed after the step) and, with ``secondary_shard_size``, the slices units keep
from forward to backward (``secondary``, see [Note: secondary shards]). Each reports to one :class:`PeakLedger` where
it is allocated and freed, as the bytes an owner holds now under a key; the ledger keeps the bytes held per kind and the
per-kind snapshot at the moment their sum was highest since :meth:`PeakLedger.reset` (``ZeroEngine.begin_iteration``).
A report is integer arithmetic and a dict look-up, cheap enough to be always on. Buffer attributes report through
:class:`Tracked`, so any assignment of such an attribute (a new staging buffer, ``None`` when it is freed) is
counted, wherever the code assigns it.

Activations are not the core's allocations; on CUDA the allocator's peak of the step is reported next to the
ledger's parts (see :class:`~lightning_zero.core.memory.StepPeak`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, overload

from torch import Tensor

KINDS = ("gathered", "buckets", "temporaries")  # every engine's; "secondary" appears once a unit holds slices


class PeakLedger:
    """Bytes of the core's transient buffers held now, per kind, and the per-kind snapshot at their highest sum."""

    def __init__(self) -> None:
        self._held: dict[object, tuple[str, int]] = {}  # key -> (kind, bytes held under it now)
        self.current = dict.fromkeys(KINDS, 0)
        self._sum = 0
        self.peak = dict(self.current)
        self._peak_sum = 0

    def hold(self, kind: str, key: object, nbytes: int) -> None:
        """The owner of ``key`` now holds ``nbytes`` of ``kind`` under it (0: it freed them); replaces what it held."""
        old = self._held.pop(key, None)
        if nbytes:
            self._held[key] = (kind, nbytes)
        if old is not None:
            self.current[old[0]] -= old[1]
            self._sum -= old[1]
        self.current[kind] = self.current.get(kind, 0) + nbytes
        self._sum += nbytes
        if self._sum > self._peak_sum:
            self._peak_sum = self._sum
            self.peak = dict(self.current)

    def release(self, key: object) -> None:
        """The owner of ``key`` freed what it held under it (a no-op when it holds nothing)."""
        old = self._held.pop(key, None)
        if old is not None:
            self.current[old[0]] -= old[1]
            self._sum -= old[1]

    def reset(self) -> None:
        """Start a new step: its peak begins with what is held now."""
        self.peak = dict(self.current)
        self._peak_sum = self._sum

    @contextmanager
    def not_counted(self) -> Iterator[None]:
        """What the block holds is not the step's: the peak after it is the peak before it (the whole model
        gathered for an export must not read as the last step's peak)."""
        peak, peak_sum = self.peak, self._peak_sum
        try:
            yield
        finally:
            self.peak, self._peak_sum = peak, peak_sum


class DetachedLedger(PeakLedger):
    """The ledger of a buffer that no engine reads (before the engine attaches its own): records nothing."""

    def hold(self, kind: str, key: object, nbytes: int) -> None:
        return

    def release(self, key: object) -> None:
        return


DETACHED = DetachedLedger()

Owner = TypeVar("Owner")
Value = TypeVar("Value")


class Tracked(Generic[Value]):
    """An attribute whose value's bytes the owner's ``ledger`` counts under ``kind`` (see [Note: step peak ledger]).

    Args:
        kind: one of :data:`KINDS`.
        measure: bytes of a value held in the attribute (default: a tensor's elements; 0 for ``None``); it may
            look at the owner (e.g. 0 for a tensor that is a model state, not a copy).
    """

    def __init__(self, kind: str, measure: Callable[[Any, Any], int] | None = None) -> None:
        self.kind = kind
        self.measure = measure or _tensor_bytes
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Tracked[Value]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> Value: ...

    def __get__(self, instance: object | None, owner: type) -> Any:
        if instance is None:
            return self
        return instance.__dict__.get(self.name)

    def __set__(self, instance: object, value: Value) -> None:
        instance.__dict__[self.name] = value
        ledger: PeakLedger = getattr(instance, "ledger", DETACHED)
        ledger.hold(self.kind, (id(instance), self.name), self.measure(instance, value))


def _tensor_bytes(owner: object, value: object) -> int:
    return value.numel() * value.element_size() if isinstance(value, Tensor) else 0

"""Per-rank byte counts of model states, as measured from the tensors a rank holds, and the peak of a step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from torch import Tensor


@dataclass(frozen=True, slots=True)
class StepPeak:
    """A rank's highest memory in the last training step, by kind (see [Note: step peak ledger] in core/peak.py).

    ``model_states``: the device-resident model states held now (parameters, gradient shards, optimizer state and
    masters; the optimizer state of a first step appears during it). ``gathered``, ``buckets`` and ``temporaries``:
    the core's transient buffers (stage-3 gathered units, gradient staging buffers and reduce-scatter outputs, the
    wide step gradients of a master copy) at the moment their sum was highest since the step began; ``secondary``
    (``secondary_shard_size``; in ``by_kind`` where non-zero): the units' secondary slices then. ``allocated``
    (CUDA with ``ZeroEngine.allocator_peak``, which ``ZeroMonitor`` sets; else ``None``):
    ``torch.cuda.max_memory_allocated`` since the step began; ``activations`` (likewise) is what it holds beyond the
    other kinds: activations, autograd's temporaries, the batch.
    """

    model_states: int = 0
    gathered: int = 0
    buckets: int = 0
    temporaries: int = 0
    secondary: int = 0
    activations: int | None = None
    allocated: int | None = None

    @classmethod
    def of(cls, model_states: int, transient: Mapping[str, int], allocated: int | None = None) -> StepPeak:
        """From the model states, the ledger's per-kind peak and, on CUDA, the allocator's peak."""
        ours = model_states + sum(transient.values())
        activations = None if allocated is None else max(0, allocated - ours)
        return cls(model_states, **transient, activations=activations, allocated=allocated)

    @property
    def by_kind(self) -> dict[str, int]:
        """Bytes per kind at the peak (``activations`` only where measured)."""
        kinds = {"model_states": self.model_states, "gathered": self.gathered, "buckets": self.buckets}
        kinds["temporaries"] = self.temporaries
        if self.secondary:
            kinds["secondary"] = self.secondary
        if self.activations is not None:
            kinds["activations"] = self.activations
        return kinds

    @property
    def total(self) -> int:
        """The step's peak: the sum of :attr:`by_kind`."""
        return sum(self.by_kind.values())


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes of model states held by one rank; ``offloaded`` ones live on CPU/NVMe, the rest on the device.
    ``step_peak``: the last training step's peak by kind (``None`` in an estimate)."""

    params: int
    gradients: int
    optimizer_states: int
    offloaded: int = 0
    # Elements of trained tensors whose optimizer state the most / least loaded rank keeps (its state is
    # proportional): equal up to padding with flat shards, the balance of the owners with partition="parameter".
    owned_max: int = 0
    owned_min: int = 0
    step_peak: StepPeak | None = None

    @property
    def total(self) -> int:
        """Device-resident bytes: parameters + gradients + optimizer states."""
        return self.params + self.gradients + self.optimizer_states

    def as_dict(self) -> dict[str, int]:
        """The byte counts by name, ``total`` too; with a step peak also ``peak`` (its total) and ``peak_<kind>``."""
        out = {field.name: getattr(self, field.name) for field in fields(self) if field.name != "step_peak"}
        out["total"] = self.total
        if self.step_peak is not None:
            out["peak"] = self.step_peak.total
            out.update({f"peak_{kind}": nbytes for kind, nbytes in self.step_peak.by_kind.items()})
        return out


def tensor_nbytes(tensor: object) -> int:
    """Bytes of a tensor's elements; 0 for anything that is not a tensor (``None``, ints, ...)."""
    return tensor.numel() * tensor.element_size() if isinstance(tensor, Tensor) else 0

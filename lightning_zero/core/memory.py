"""Per-rank byte counts of model states, as measured from the tensors a rank holds."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """Bytes of model states held by one rank; ``offloaded`` ones live on CPU/NVMe, the rest on the device."""

    params: int
    gradients: int
    optimizer_states: int
    offloaded: int = 0
    # Elements of trained tensors whose optimizer state the most / least loaded rank keeps (its state is
    # proportional): equal up to padding with flat shards, the balance of the owners with partition="parameter".
    owned_max: int = 0
    owned_min: int = 0

    @property
    def total(self) -> int:
        """Device-resident bytes: parameters + gradients + optimizer states."""
        return self.params + self.gradients + self.optimizer_states

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def tensor_nbytes(tensor: object) -> int:
    """Bytes of a tensor's elements; 0 for anything that is not a tensor (``None``, ints, ...)."""
    return tensor.numel() * tensor.element_size() if isinstance(tensor, Tensor) else 0

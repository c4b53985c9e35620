"""EngineOptions: what the sharding core needs to know of the user's choices, and nothing Lightning-side.

``lightning_zero.config.ZeroConfig`` checks every option once and builds these; the core never sees the options
that only the glue uses (``state_dict_type``, ``timeout``, the launcher's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

WrapPolicy = set[type[nn.Module]] | Callable[[nn.Module], bool] | None

STAGES = (1, 2, 3)
PARTITIONS = ("flat", "parameter")
# Tensor sizes are int64 byte counts: a bucket larger than that cannot exist (and inf would not convert to one).
MAX_BUCKET_CAP_MB = (2**63 - 1) // 2**20


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How :class:`~lightning_zero.core.engine.ZeroEngine` shards a module.

    Attributes:
        stage: 1 shards optimizer state; 2 also gradients; 3 also parameters.
        bucket_cap_mb: size of the gradient buckets (stages 1 and 2).
        overlap_comm: reduce buckets while backward still runs; at stage 3 also prefetch the next unit.
        wrap_policy: stage-3 gather units (module classes or a ``callable(module) -> bool``; ``None``: default).
        offload_optimizer: ``"cpu"`` or ``"nvme"``: the fp32 master and optimizer state live (and step) off the
            device; ``False``: on it.
        offload_params: ``"cpu"`` / ``"nvme"``: stage-3 parameter shards rest in host memory / the swap file
            between uses.
        nvme_path: the directory of each rank's swap file (``offload_optimizer="nvme"``).
        partition: ``"flat"``: element ranges of flat buffers per rank; ``"parameter"``: each trained tensor owned
            whole by one rank (see [Note: owner layout]).
    """

    stage: int = 2
    bucket_cap_mb: float = 25
    overlap_comm: bool = True
    wrap_policy: Any = None
    offload_optimizer: str | bool = False
    offload_params: str | bool = False
    nvme_path: str | None = None
    partition: str = "flat"

    def __post_init__(self) -> None:
        if self.stage not in STAGES or isinstance(self.stage, bool):
            raise ValueError(f"stage={self.stage!r} is not supported; choose one of {list(STAGES)}.")
        check_bucket_cap_mb(self.bucket_cap_mb)
        self._check_offload()
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition={self.partition!r}: choose one of {list(PARTITIONS)}.")

    def _check_offload(self) -> None:
        if self.offload_optimizer not in (False, "cpu", "nvme"):
            raise ValueError(f"offload_optimizer={self.offload_optimizer!r}: choose False, 'cpu' or 'nvme'.")
        if self.offload_params not in (False, "cpu", "nvme"):
            raise ValueError(f"offload_params={self.offload_params!r}: choose False, 'cpu' or 'nvme'.")
        if self.offload_params and not self.offload_optimizer:
            raise ValueError("offload_params needs offload_optimizer='cpu' or 'nvme': the optimizer steps there.")
        if self.offload_params and self.stage != 3:
            raise ValueError(f"offload_params={self.offload_params!r} needs stage=3, got stage={self.stage}.")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path, a directory on a fast local disk.")

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    def describe(self) -> dict[str, Any]:
        """Plain values every rank must agree on (for :meth:`Communicator.agree`)."""
        return {
            "stage": self.stage,
            "bucket_cap_mb": self.bucket_cap_mb,
            "overlap_comm": self.overlap_comm,
            "wrap_policy": describe_policy(self.wrap_policy),
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "partition": self.partition,
        }


def check_bucket_cap_mb(value: Any) -> None:
    """Raise a ``ValueError`` naming ``bucket_cap_mb`` unless it is a number of megabytes in (0, MAX_BUCKET_CAP_MB];
    ``nan``, ``inf`` and values whose byte count overflows int64 included."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"bucket_cap_mb must be a number of megabytes, got {value!r}.")
    if not value > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {value}. The default is 25.")
    if not value <= MAX_BUCKET_CAP_MB:
        raise ValueError(
            f"bucket_cap_mb must be at most {MAX_BUCKET_CAP_MB} (2**63 - 1 bytes, the largest tensor size), got "
            f"{_shortened(value)}. For one bucket per dtype pass any size above the model's, e.g. bucket_cap_mb=1e6."
        )


def _shortened(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def describe_policy(policy: Any) -> Any:
    """A rank-independent description: sets have no stable order across processes, so sort class names."""
    if policy is None:
        return None
    if isinstance(policy, set | frozenset | list | tuple):
        return sorted(_qualified_name(item) for item in policy)
    return _qualified_name(policy)


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"

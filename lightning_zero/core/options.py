"""EngineOptions: what the sharding core needs to know of the user's choices, and nothing Lightning-side.

Each of these options is declared and checked here, once: ``lightning_zero.config.ZeroConfig`` (the Lightning
side) holds an ``EngineOptions`` next to the options that only the glue uses (``state_dict_type``, ``timeout``,
the launcher's), so the core never sees those. The errors name the option, the value and a fix, and read the same
to a ``ZeroStrategy`` user and to a caller of the core.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

WrapPolicy = set[type[nn.Module]] | Callable[[nn.Module], bool] | None
OffloadTarget = Literal[False, "cpu", "nvme"]

STAGES = (1, 2, 3)
OFFLOAD_TARGETS = (False, "cpu", "nvme")
PARTITIONS = ("flat", "parameter")
# Tensor sizes are int64 byte counts: a bucket larger than that cannot exist (and inf would not convert to one).
MAX_BUCKET_CAP_MB = (2**63 - 1) // 2**20


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How :class:`~lightning_zero.core.engine.ZeroEngine` shards a module; checked at construction.

    Attributes:
        stage: 1 shards optimizer state; 2 also gradients; 3 also parameters.
        bucket_cap_mb: size of the gradient buckets (stages 1 and 2).
        overlap_comm: reduce buckets while backward still runs; at stage 3 also prefetch the next unit.
        wrap_policy: stage-3 gather units (module classes, their import paths, or a ``callable(module) -> bool``;
            ``None``: default); import paths are replaced by the classes.
        offload_optimizer: ``"cpu"`` or ``"nvme"``: the fp32 master and optimizer state live (and step) off the
            device; ``False``: on it.
        offload_params: ``"cpu"`` / ``"nvme"``: stage-3 parameter shards rest in host memory / the swap file
            between uses.
        nvme_path: the directory of each rank's swap file (``offload_optimizer="nvme"``).
        partition: ``"flat"``: element ranges of flat buffers per rank; ``"parameter"``: each trained tensor owned
            whole by one rank (see [Note: owner layout]).
        shard_size: hybrid sharding: shard inside groups of this many consecutive ranks (e.g. one node's) and
            replicate across the groups; ``None``: shard over every rank (see [Note: hybrid sharding]).
        secondary_shard_size: stage 3 (ZeRO++ hpZ): after a unit's forward each rank keeps its part of the unit's
            full buffer within a group of this many consecutive ranks (inside one node), from which backward gathers
            the unit; ``None``: backward gathers over the whole gather group (see [Note: secondary shards]).
        quantize_gradients: gradients are reduced inside each node first and cross nodes as int8 with block scales,
            rounded to nearest with error feedback, so what rounding misses is sent with the next reduction (see
            [Note: quantized gradient reduction] and [Note: error feedback]); on one node it changes nothing.
        quantize_weights: stage 3 with ``partition="flat"``: the forward and backward parameter gathers send int8
            values with block scales; shards, masters and checkpoints stay exact (see [Note: quantized all-gather]).
        free_gradients_after_step: each ``optimizer.step()`` empties the gradients of the parameters only it steps,
            as ``zero_grad(set_to_none=True)`` would, so they do not live through the next forward (see [Note: freeing
            gradients after the step]); ``False``: they are kept until ``zero_grad``, as torch's contract says.
    """

    stage: int = 2
    bucket_cap_mb: float = 25
    overlap_comm: bool = True
    wrap_policy: Any = None
    offload_optimizer: OffloadTarget = False
    offload_params: OffloadTarget = False
    nvme_path: str | None = None
    partition: str = "flat"
    shard_size: int | None = None
    quantize_weights: bool = False
    quantize_gradients: bool = False
    secondary_shard_size: int | None = None
    free_gradients_after_step: bool = False

    def __post_init__(self) -> None:
        check_choice("stage", self.stage, STAGES, "stage=2")
        self._check_offload()
        check_choice("partition", self.partition, PARTITIONS, "partition='flat'")
        check_bucket_cap_mb(self.bucket_cap_mb)
        check_bool("overlap_comm", self.overlap_comm)
        check_shard_size(self.shard_size)
        check_secondary_shard_size(self.secondary_shard_size, self.stage)
        check_bool("quantize_gradients", self.quantize_gradients)
        check_bool("free_gradients_after_step", self.free_gradients_after_step)
        if self.quantize_gradients and self.partition == "parameter":
            raise ValueError(
                "quantize_gradients=True needs partition='flat', got partition='parameter': whole-tensor owners hold "
                "uneven parts, which the hierarchical quantized reduction does not split. Use partition='flat' or "
                "quantize_gradients=False."
            )
        self._check_quantize_weights()
        object.__setattr__(self, "wrap_policy", resolve_policy("wrap_policy", self.wrap_policy))

    def _check_offload(self) -> None:
        check_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_TARGETS, "offload_optimizer='cpu'")
        check_choice("offload_params", self.offload_params, OFFLOAD_TARGETS, "offload_params='cpu'")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3, got stage={self.stage}. "
                "Use stage=3 or offload_params=False."
            )
        if self.offload_params and not self.offload_optimizer:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs offload_optimizer='cpu' or 'nvme': the optimizer steps "
                "the shards where they rest. Pass offload_optimizer='cpu' too (as \"zero_3_offload\" does)."
            )
        if self.nvme_path is not None and not isinstance(self.nvme_path, str | os.PathLike):
            raise ValueError(f"nvme_path must be a directory path (a str), got {self.nvme_path!r}.")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ValueError(
                f"offload to 'nvme' needs nvme_path, got nvme_path={self.nvme_path!r}. "
                "Pass nvme_path='/path/to/fast/disk'."
            )

    def _check_quantize_weights(self) -> None:
        check_bool("quantize_weights", self.quantize_weights)
        if self.quantize_weights and self.stage != 3:
            raise ValueError(
                f"quantize_weights=True needs stage=3 (it quantizes the stage-3 parameter all-gathers), got "
                f"stage={self.stage}. Use stage=3 or quantize_weights=False."
            )
        if self.quantize_weights and self.partition != "flat":
            raise ValueError(
                f"quantize_weights=True is not supported with partition={self.partition!r}: its parameter gathers "
                "have uneven parts per rank. Use partition='flat' (the default) or quantize_weights=False."
            )

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    def describe(self) -> dict[str, Any]:
        """Plain values every rank must agree on (for :meth:`Communicator.agree`); not ``nvme_path``, which may
        differ between ranks."""
        return {
            "stage": self.stage,
            "bucket_cap_mb": self.bucket_cap_mb,
            "overlap_comm": self.overlap_comm,
            "wrap_policy": describe_policy(self.wrap_policy),
            "offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "partition": self.partition,
            "shard_size": self.shard_size,
            "quantize_weights": self.quantize_weights,
            "quantize_gradients": self.quantize_gradients,
            "secondary_shard_size": self.secondary_shard_size,
            "free_gradients_after_step": self.free_gradients_after_step,
        }


def check_shard_size(value: Any, world_size: int | None = None) -> None:
    """Raise a ``ValueError`` unless ``value`` is ``None`` or a positive int (dividing ``world_size`` where given)."""
    if value is None:
        return
    where = f"world_size={world_size}" if world_size is not None else "the world size"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"shard_size={value!r} is not supported; choose a positive int that divides {where} (e.g. the number "
            "of processes per node), or None to shard over all ranks."
        )
    if world_size is not None and world_size % value:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        shown = ", ".join(map(str, divisors[:8])) + (", ..." if len(divisors) > 8 else "")
        raise ValueError(
            f"shard_size={value} does not divide world_size={world_size}: pick a divisor of {world_size} ({shown}) "
            "such as the number of processes per node."
        )


def check_secondary_shard_size(value: Any, stage: int, group_size: int | None = None) -> None:
    """Raise a ``ValueError`` unless ``value`` is ``None`` or, at stage 3, a positive int (dividing ``group_size``,
    the stage-3 gather group's size, where given)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"secondary_shard_size={value!r} is not supported; choose a positive int that divides the number of "
            "processes per node (e.g. that number), or None."
        )
    if stage != 3:
        raise ValueError(
            f"secondary_shard_size={value} needs stage=3, got stage={stage}: only stage 3 frees parameters after "
            "forward. Use stage=3 or secondary_shard_size=None."
        )
    if group_size is not None and group_size % value:
        raise ValueError(
            f"secondary_shard_size={value} does not divide the stage-3 gather group's {group_size} ranks (the world "
            "size, or shard_size with hybrid sharding): pick a divisor of it, typically the processes per node."
        )


def check_choice(name: str, value: Any, allowed: tuple[Any, ...], example: str | None = None) -> None:
    """Raise a ``ValueError`` naming ``name`` (and ``example``, a valid setting) unless ``value`` is one of
    ``allowed``, of the same type: ``True == 1``, so ``stage=True`` must not pass as ``stage=1``."""
    if not any(value == choice and type(value) is type(choice) for choice in allowed):
        fix = f", e.g. {example}" if example else ""
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(allowed)}{fix}.")


def check_bool(name: str, value: Any) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``value`` is ``True`` or ``False`` (not ``0`` or ``"yes"``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")


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


def resolve_policy(name: str, policy: Any) -> Any:
    """A module-class policy with import paths (``"my_pkg.model.Block"``, as YAML configs give them) replaced by
    the classes; ``None`` and callables pass through. Anything else raises a ``ValueError`` naming the option."""
    if policy is None or (callable(policy) and not isinstance(policy, str)):
        return policy
    items = [policy] if isinstance(policy, str) else policy
    if not isinstance(items, set | frozenset | list | tuple):
        raise ValueError(
            f"{name}={policy!r} is not supported: pass a set of nn.Module classes (or their import paths, e.g. "
            f"['my_package.model.Block'] in YAML), or a callable(module) -> bool."
        )
    classes = [_import_class(name, item) if isinstance(item, str) else item for item in items]
    wrong = [item for item in classes if not isinstance(item, type)]
    if wrong:
        raise ValueError(f"{name} must hold nn.Module classes, got {wrong[0]!r}; e.g. {name}={{Block}}.")
    return set(classes)


def _import_class(name: str, path: str) -> type:
    module_name, _, class_name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError):
        found = None
    if not isinstance(found, type):
        raise ValueError(
            f"{name}: cannot import the class {path!r}; give its full import path, e.g. 'my_package.model.Block'."
        )
    return found

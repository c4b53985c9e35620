"""ZeroConfig: every ZeroStrategy option in one frozen dataclass, checked once at construction.

The Lightning glue reads all of it; the sharding core gets only :meth:`ZeroConfig.engine_options`, so it never
sees the options that are the glue's alone (``state_dict_type``, ``timeout``, ...).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Literal

from lightning_zero.core.options import EngineOptions, check_bucket_cap_mb, describe_policy

Offload = Literal[False, "cpu", "nvme"]

STAGES = (1, 2, 3)
OFFLOAD_TARGETS = (False, "cpu", "nvme")
PARTITIONS = ("flat", "parameter")
STATE_DICT_TYPES = ("sharded", "full")
START_METHODS = ("popen", "spawn", "fork")
BACKENDS = ("nccl", "gloo")

# Options that the contract names and the core does not implement yet; each maps to the issue that
# builds it, so the error can say so instead of silently ignoring the option.
_NOT_YET_BUILT = {
    "shard_size": ("the hybrid sharding issue", "Use shard_size=None for now."),
}


@dataclass(frozen=True, slots=True)
class ZeroConfig:
    """The options of :class:`~lightning_zero.ZeroStrategy` that shape sharding (see CONTRACT.md)."""

    stage: int = 2
    offload_optimizer: Offload = False
    offload_params: Offload = False
    nvme_path: str | None = None
    partition: str = "flat"
    bucket_cap_mb: float = 25
    overlap_comm: bool = True
    shard_size: int | None = None
    wrap_policy: Any = None
    activation_checkpointing: Any = None
    state_dict_type: str = "sharded"
    process_group_backend: str | None = None
    timeout: timedelta = field(default_factory=lambda: timedelta(minutes=30))
    weighted_loss: bool = False

    def __post_init__(self) -> None:
        _check_choice("stage", self.stage, STAGES, "ZeroStrategy(stage=2)")
        _check_choice("offload_optimizer", self.offload_optimizer, OFFLOAD_TARGETS, "offload_optimizer='cpu'")
        _check_choice("offload_params", self.offload_params, OFFLOAD_TARGETS, "offload_params='cpu'")
        self._check_offload()
        _check_choice("partition", self.partition, PARTITIONS, "partition='flat'")
        _check_choice("state_dict_type", self.state_dict_type, STATE_DICT_TYPES, "state_dict_type='full'")
        if self.process_group_backend is not None:
            _check_choice("process_group_backend", self.process_group_backend, BACKENDS, "process_group_backend=None")
        check_bucket_cap_mb(self.bucket_cap_mb)
        for name in ("overlap_comm", "weighted_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.shard_size is not None and (
            isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1
        ):
            raise ValueError(f"shard_size must be a positive int or None, got {self.shard_size!r}.")
        if not isinstance(self.timeout, timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta, got {self.timeout!r}.")
        if self.timeout <= timedelta(0):
            raise ValueError(
                f"timeout must be positive, got {self.timeout!r}: every collective would fail at once. The default "
                "is timedelta(minutes=30)."
            )
        for name in ("wrap_policy", "activation_checkpointing"):
            object.__setattr__(self, name, _resolve_policy(name, getattr(self, name)))
        self._check_built()

    def _check_offload(self) -> None:
        if self.offload_params and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3, got stage={self.stage}. "
                "Use ZeroStrategy(stage=3) or offload_params=False."
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
                "offload to 'nvme' needs nvme_path, got nvme_path=None. Pass nvme_path='/path/to/fast/disk'."
            )

    def _check_built(self) -> None:
        requested = {
            "shard_size": self.shard_size is not None,
        }
        for option, asked in requested.items():
            if asked:
                tracked, instead = _NOT_YET_BUILT[option]
                raise NotImplementedError(
                    f"ZeroStrategy({option}) is part of the contract but not built yet (tracked in {tracked}). "
                    f"{instead}"
                )

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    def engine_options(self) -> EngineOptions:
        """What the sharding core needs of these options."""
        return EngineOptions(
            self.stage,
            self.bucket_cap_mb,
            self.overlap_comm,
            self.wrap_policy,
            offload_optimizer=self.offload_optimizer,
            offload_params=self.offload_params,
            nvme_path=self.nvme_path,
            partition=self.partition,
        )

    def describe(self) -> dict[str, Any]:
        """The options that every rank must agree on, as plain values (for the rank-agreement check)."""
        values = asdict(self)
        values["timeout"] = self.timeout.total_seconds()
        values["wrap_policy"] = describe_policy(self.wrap_policy)
        values["activation_checkpointing"] = describe_policy(self.activation_checkpointing)
        return values


def _resolve_policy(name: str, policy: Any) -> Any:
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


def _check_choice(name: str, value: Any, allowed: tuple[Any, ...], example: str) -> None:
    # `True == 1`, so compare types too: stage=True must not pass as stage=1.
    if not any(value == choice and type(value) is type(choice) for choice in allowed):
        raise ValueError(f"{name}={value!r} is not supported; choose one of {list(allowed)}, e.g. {example}.")

"""ZeroConfig: every ZeroStrategy option in one frozen dataclass, checked once at construction.

[Note: two option records]
The options that shape sharding (``stage``, ``offload_*``, ``bucket_cap_mb``, ...) are the core's: they are
declared and checked once, in :class:`~lightning_zero.core.options.EngineOptions`, which ``ZeroConfig.engine``
holds. ``ZeroConfig`` declares only the options that are the Lightning glue's alone (``state_dict_type``,
``timeout``, ...), so the core never sees them and no check is written twice. ``ZeroStrategy(...)`` keeps its flat
keyword arguments and builds both records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from lightning_zero.core.options import (
    EngineOptions,
    OffloadTarget,
    check_bool,
    check_choice,
    describe_policy,
    resolve_policy,
)

STATE_DICT_TYPES = ("sharded", "full")
START_METHODS = ("popen", "spawn", "fork")
BACKENDS = ("nccl", "gloo")

# The strategy names registered for ``Trainer(strategy="zero_2")`` and the like: their options and description.
PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "zero_1": ({"stage": 1}, "ZeRO stage 1: optimizer state sharded"),
    "zero_2": ({"stage": 2}, "ZeRO stage 2: optimizer state and gradients sharded"),
    "zero_3": ({"stage": 3}, "ZeRO stage 3: optimizer state, gradients and parameters sharded"),
    # As Lightning's deepspeed_stage_2_offload / deepspeed_stage_3_offload.
    "zero_2_offload": ({"stage": 2, "offload_optimizer": "cpu"}, "ZeRO stage 2, optimizer state on the CPU"),
    "zero_3_offload": (
        {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        "ZeRO stage 3, optimizer state and parameters on the CPU",
    ),
}


@dataclass(frozen=True, slots=True)
class ZeroConfig:
    """The options of :class:`~lightning_zero.ZeroStrategy` (see CONTRACT.md): the core's in ``engine``, the
    Lightning side's here."""

    engine: EngineOptions = field(default_factory=EngineOptions)
    activation_checkpointing: Any = None
    state_dict_type: str = "sharded"
    process_group_backend: str | None = None
    timeout: timedelta = field(default_factory=lambda: timedelta(minutes=30))
    weighted_loss: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineOptions):
            raise ValueError(f"engine must be an EngineOptions, got {self.engine!r}.")
        check_choice("state_dict_type", self.state_dict_type, STATE_DICT_TYPES, "state_dict_type='full'")
        if self.process_group_backend is not None:
            check_choice("process_group_backend", self.process_group_backend, BACKENDS, "process_group_backend=None")
        check_bool("weighted_loss", self.weighted_loss)
        self._check_timeout()
        policy = resolve_policy("activation_checkpointing", self.activation_checkpointing)
        object.__setattr__(self, "activation_checkpointing", policy)

    def _check_timeout(self) -> None:
        if not isinstance(self.timeout, timedelta):
            raise ValueError(f"timeout must be a datetime.timedelta, got {self.timeout!r}.")
        if self.timeout <= timedelta(0):
            raise ValueError(
                f"timeout must be positive, got {self.timeout!r}: every collective would fail at once. The default "
                "is timedelta(minutes=30)."
            )

    def describe(self) -> dict[str, Any]:
        """Every option that every rank must agree on, as plain values, by its ``ZeroStrategy`` keyword (for the
        rank-agreement check): the engine's, its ``nvme_path`` too, and the Lightning side's."""
        values = {**self.engine.describe(), "nvme_path": self.engine.nvme_path}
        values.update({f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"})
        values["timeout"] = self.timeout.total_seconds()
        values["activation_checkpointing"] = describe_policy(self.activation_checkpointing)
        return values


def zero_config(
    *,
    stage: int,
    offload_optimizer: OffloadTarget,
    offload_params: OffloadTarget,
    nvme_path: str | None,
    partition: str,
    bucket_cap_mb: float,
    overlap_comm: bool,
    shard_size: int | None,
    wrap_policy: Any,
    activation_checkpointing: Any,
    state_dict_type: str,
    process_group_backend: str | None,
    timeout: timedelta,
    weighted_loss: bool,
    quantize_weights: bool,
    quantize_gradients: bool,
    secondary_shard_size: int | None,
    free_gradients_after_step: bool,
) -> ZeroConfig:
    """The configuration of the keyword arguments that ``ZeroStrategy`` and ``ZeroFabricStrategy`` both take."""
    engine = EngineOptions(
        stage=stage,
        bucket_cap_mb=bucket_cap_mb,
        overlap_comm=overlap_comm,
        wrap_policy=wrap_policy,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        nvme_path=nvme_path,
        partition=partition,
        shard_size=shard_size,
        quantize_weights=quantize_weights,
        quantize_gradients=quantize_gradients,
        secondary_shard_size=secondary_shard_size,
        free_gradients_after_step=free_gradients_after_step,
    )
    return ZeroConfig(
        engine,
        activation_checkpointing=activation_checkpointing,
        state_dict_type=state_dict_type,
        process_group_backend=process_group_backend,
        timeout=timeout,
        weighted_loss=weighted_loss,
    )

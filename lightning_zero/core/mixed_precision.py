"""Mixed precision for the sharding core: which dtypes the engine holds, and the agreed dynamic loss scale.

[Note: mixed-precision model states]
Following the ZeRO paper (section 3.1), a 16-bit run holds per parameter: the parameter in the compute
dtype (2 bytes), its gradient in the compute dtype (2 bytes), and with the optimizer an fp32 master copy
(4 bytes) plus the optimizer's own state (Adam: 8 bytes), each divided as the stage divides it. The
master lives in a ``MasterStore`` (core/store/stores.py). Between steps the held gradient is the 16-bit reduced
one (so ``zero_grad`` empties it); for the step (from ``ZeroEngine.prepare_step``, which ``optimizer.step()``
runs if nobody did, to the end of ``optimizer.step()``) the store makes an fp32 copy of it, unscaled,
which the optimizer sees as its parameter's ``grad`` next to the master piece as its ``data`` (see [Note:
the step window]) and which is freed after the step. The updated masters are then rounded into the 16-bit
shard, which is gathered.

Gradients are reduced in ``reduce_dtype`` (fp32 by default): the local gradients of a bucket are summed
into an fp32 staging buffer and reduce-scattered in fp32, so a sum over many ranks neither overflows
fp16 nor loses bf16's 8 bits of mantissa; only the averaged result is rounded into the held gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """The dtypes the engine holds. ``None`` everywhere is plain training in the parameters' own dtype.

    Attributes:
        param_dtype: cast floating-point parameters to this dtype for compute (``None``: keep theirs).
        reduce_dtype: dtype in which gradients are summed across ranks (``None``: the gradients' own).
        master_dtype: the optimizer updates a copy of the shard in this dtype (``None``: the shard itself).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None

    def describe(self) -> dict[str, str | None]:
        """Plain values for the rank-agreement check, e.g. ``{"precision.param_dtype": "bfloat16", ...}``."""
        return {
            f"precision.{name}": None if dtype is None else str(dtype).removeprefix("torch.")
            for name, dtype in (
                ("param_dtype", self.param_dtype),
                ("reduce_dtype", self.reduce_dtype),
                ("master_dtype", self.master_dtype),
            )
        }


class LossScaleError(RuntimeError):
    """Gradients overflowed although the loss scale is already at its minimum: training diverged."""


class DynamicLossScaler:
    """fp16 loss scaling whose decisions every rank takes together (the caller agrees on overflow first).

    The loss is multiplied by :attr:`scale` before backward. A step whose gradients hold an inf or NaN on any
    rank is skipped and the scale multiplied by ``backoff_factor``; after ``growth_interval`` clean steps in
    a row it is multiplied by ``growth_factor``. An overflow at ``min_scale`` raises :class:`LossScaleError`
    instead of skipping steps forever. Defaults are torch's ``GradScaler``'s, with DeepSpeed's minimum of 1.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        checks = {
            "init_scale": (init_scale, init_scale > 0 and math.isfinite(init_scale)),
            "growth_factor": (growth_factor, growth_factor > 1),
            "backoff_factor": (backoff_factor, 0 < backoff_factor < 1),
            "growth_interval": (
                growth_interval,
                isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval >= 1,
            ),
            "min_scale": (min_scale, 0 < min_scale <= init_scale),
        }
        for name, (value, ok) in checks.items():
            if not ok:
                raise ValueError(
                    f"loss scaling option {name}={value!r} is invalid: need init_scale > 0, growth_factor > 1, "
                    "0 < backoff_factor < 1, an int growth_interval >= 1 and 0 < min_scale <= init_scale."
                )
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.clean_steps = 0  # steps without overflow since the scale last changed
        self.skipped_steps = 0  # steps skipped for overflow in the whole run

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; ``found_inf`` must already be agreed by all ranks."""
        if found_inf:
            if self.scale <= self.min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed (inf/NaN) although the loss scale is at its minimum {self.min_scale:g} "
                    f"after {self.skipped_steps} skipped steps: the run diverged. Lower the learning rate, enable "
                    "gradient clipping, check the data for inf/NaN, or train with precision='bf16-mixed'."
                )
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

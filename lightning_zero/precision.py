"""ZeroPrecision: the precision plugin ZeroStrategy installs; it runs the step around the sharded gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.engine import ZeroEngine

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
BUILT = ("32-true",)


class ZeroPrecision(Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroStrategy`.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.

    Raises:
        ValueError: for any other precision.
    """

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r}; `precision` must be one of: "
                f"{', '.join(repr(p) for p in SUPPORTED)}."
            )
        if precision not in BUILT:
            raise NotImplementedError(
                f"precision={precision!r} is part of the contract but not built yet (tracked in #4); "
                f"use one of {list(BUILT)} for now."
            )
        self.precision = precision
        self._engine: ZeroEngine | None = None

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZeroPrecision:
        """Translate the plugin Lightning chose for the Trainer's ``precision`` flag."""
        if isinstance(plugin, ZeroPrecision):
            return plugin
        return cls(str(getattr(plugin, "precision", "32-true")))

    def attach(self, engine: ZeroEngine | None) -> None:
        """Route clipping and the optimizer step through ``engine`` (``None`` detaches)."""
        self._engine = engine

    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # Run forward and backward first, like Lightning's AMP plugin, so that clipping sees the reduced
        # gradients and the updated shards are gathered right after the step.
        closure_result = closure()
        self._after_closure(model, optimizer)
        optimizer.step(**kwargs)
        self._require_engine().finish_step(optimizer)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._require_engine().clip_grad_norm_(unwrap_optimizer(optimizer), clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._require_engine().clip_grad_value_(unwrap_optimizer(optimizer), clip_val)

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision has no engine: the optimizer step runs only inside Trainer.fit.")
        return self._engine


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

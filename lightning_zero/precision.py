"""ZeroPrecision: the precision plugin ZeroStrategy installs; it drives the engine from Lightning's hooks.

What each precision does to the module, its inputs, its forward and its backward is shared with Fabric's plugin
(``precision_settings.py``); this plugin adds Lightning's hooks: it routes clipping to the engine and runs
``optimizer.step()`` after the closure, as Lightning's AMP plugin does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.precision_settings import SUPPORTED, ZeroPrecisionSettings, retains_graph

__all__ = ["SUPPORTED", "ZeroPrecision", "unwrap_optimizer"]


class ZeroPrecision(ZeroPrecisionSettings, Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroStrategy`; ``Trainer(precision=...)`` selects it.

    In ``"bf16-mixed"``, ``"16-mixed"`` and ``"bf16-true"`` the parameters and gradients are held in 16 bits and
    each rank's optimizer updates an fp32 master copy of its shard. The mixed modes run forward under
    ``torch.autocast``; ``"bf16-true"`` casts the module and the inputs to bf16. ``"16-mixed"`` scales the loss
    dynamically and every rank skips a step together when any gradient overflowed. Pass an instance to
    ``Trainer(plugins=[...])`` (or ``ZeroStrategy(precision_plugin=...)``) to change the options below.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.
        reduce_dtype: dtype in which gradients are summed across ranks: ``"float32"`` (default: no overflow of
            fp16 sums, no loss of bf16 mantissa; costs twice the bytes on the wire) or the 16-bit compute dtype
            (``"bfloat16"`` / ``"float16"``) to halve gradient traffic.
        init_scale: ``"16-mixed"``: the first loss scale.
        growth_factor: ``"16-mixed"``: the scale is multiplied by it after ``growth_interval`` clean steps.
        backoff_factor: ``"16-mixed"``: the scale is multiplied by it when a step overflowed (and is skipped).
        growth_interval: ``"16-mixed"``: clean steps in a row before the scale grows.
        min_scale: ``"16-mixed"``: an overflow at this scale stops the run with an error.

    Raises:
        ValueError: for any other precision, or an invalid option.
    """

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZeroPrecision:
        """Translate the plugin Lightning chose for the Trainer's ``precision`` flag (or ``plugins``)."""
        return plugin if isinstance(plugin, ZeroPrecision) else cls(**cls.options_of(plugin))

    # convert_module, convert_input, forward_context, state_dict and load_state_dict: precision_settings.py's.

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self.scale_loss(tensor), module)

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if retains_graph(args, kwargs):  # manual_backward(loss, retain_graph=True)
            self.retain_announced_graph()
        super().backward(tensor, model, optimizer, *args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        self.finish_backward()
        return super().post_backward(tensor, module)

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # Run forward and backward first, like Lightning's AMP plugin, so that clipping sees the reduced (and
        # unscaled) gradients; optimizer.step() then runs inside the engine's step window (see [Note: the step
        # window] in core/step/optimizer_step.py).
        closure_result = closure()
        engine, inner = self._engine, unwrap_optimizer(optimizer)
        if engine is None or not engine.model.manages(inner):
            self._after_closure(model, optimizer)
            return optimizer.step(**kwargs)
        if closure_result is None and model.automatic_optimization:  # training_step returned None: no step
            self._after_closure(model, optimizer)
            engine.step_of(inner).skip()
            return closure_result
        # The step's gradients (fp32, unscaled) exist before on_before_optimizer_step and clipping, as Lightning's
        # AMP plugin unscales before them.
        engine.step_of(inner).prepare()
        self._after_closure(model, optimizer)
        optimizer.step(**kwargs)
        return closure_result

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._require_engine().step_of(unwrap_optimizer(optimizer)).clip_grad_norm_(clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._require_engine().step_of(unwrap_optimizer(optimizer)).clip_grad_value_(clip_val)

    def _require_engine(self) -> ZeroEngine:
        return self.require_engine("inside Trainer.fit")


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

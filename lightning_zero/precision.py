"""ZeroPrecision: the precision plugin ZeroStrategy installs; it drives the engine from Lightning's hooks.

The dtypes themselves are held by the engine (see [Note: mixed-precision model states] in
``core/mixed_precision.py``) and so is every piece of step state (see [Note: the step window] in
``core/step/optimizer_step.py``): this plugin picks the dtypes from the Trainer's ``precision``, enters autocast for
the mixed modes, has the engine scale the fp16 loss, tells it when a backward is over, routes clipping to it and runs
``optimizer.step()`` after the closure, as Lightning's AMP plugin does.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
                   "bf16-true": torch.bfloat16}  # fmt: skip
_STATE_KEY = "loss_scaler"


class ZeroPrecision(Precision):
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

    def __init__(
        self,
        precision: Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"] = "32-true",
        reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if precision not in SUPPORTED:
            raise ValueError(
                f"ZeroStrategy does not support precision={precision!r}; `precision` must be one of: "
                f"{', '.join(repr(p) for p in SUPPORTED)}."
            )
        compute = _COMPUTE_DTYPES[precision]
        allowed = sorted({"float32", str(compute).removeprefix("torch.")})
        if isinstance(reduce_dtype, torch.dtype):  # as FSDP's MixedPrecisionPolicy takes it
            reduce_dtype = str(reduce_dtype).removeprefix("torch.")  # type: ignore[assignment]
        if reduce_dtype not in allowed:
            raise ValueError(
                f"reduce_dtype={reduce_dtype!r} does not fit precision={precision!r}; choose one of {allowed} "
                "(a string, or the torch.dtype)."
            )
        self.precision = precision
        self.compute_dtype = compute
        self.reduce_dtype = getattr(torch, reduce_dtype)
        self.scaler = (
            DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
            if precision == "16-mixed"
            else None
        )
        self.device = "cpu"  # the accelerator type, as Lightning's MixedPrecision has it; the strategy sets it
        self._engine: ZeroEngine | None = None

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZeroPrecision:
        """Translate the plugin Lightning chose for the Trainer's ``precision`` flag (or ``plugins``)."""
        if isinstance(plugin, ZeroPrecision):
            return plugin
        options: dict[str, Any] = {}
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:  # a MixedPrecision("16-mixed", ...) plugin: keep its GradScaler's settings
            options = {
                "init_scale": scaler._init_scale,
                "growth_factor": scaler._growth_factor,
                "backoff_factor": scaler._backoff_factor,
                "growth_interval": scaler._growth_interval,
                "min_scale": min(1.0, scaler._init_scale),
            }
        return cls(str(getattr(plugin, "precision", "32-true")), **options)

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def policy(self) -> PrecisionPolicy:
        """The dtypes the engine holds: 16-bit parameters and gradients with fp32 masters, or plain fp32."""
        if self.compute_dtype == torch.float32:
            return PrecisionPolicy()
        return PrecisionPolicy(self.compute_dtype, self.reduce_dtype, torch.float32)

    def attach(self, engine: ZeroEngine | None) -> None:
        """Drive ``engine`` from Lightning's precision hooks (``None`` detaches); it scales the loss with this plugin's
        scaler. The engine holds every piece of step state; this plugin keeps none of its own."""
        self._engine = engine
        if engine is not None:
            engine.scaling.scaler = self.scaler

    # ------------------------------------------------------------------ forward
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # "true": the model is bf16 (masters are then taken from bf16 values, as Lightning's DeepSpeed does). The
        # mixed modes leave it in fp32: the engine keeps fp32 masters of the original values and casts the rest.
        return module.to(dtype=self.compute_dtype) if self.precision == "bf16-true" else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.mixed:
            with torch.autocast(self.device, dtype=self.compute_dtype, cache_enabled=False):
                yield
        elif self.precision == "bf16-true":
            with _DtypeContextManager(self.compute_dtype):
                yield
        else:
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._engine is not None:
            tensor = self._engine.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._engine is not None:
            # A rank whose loss reached no trainable parameter ran no hook: it joins the end of backward here.
            self._engine.finish_backward()
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

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {_STATE_KEY: self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and _STATE_KEY in state_dict:
            self.scaler.load_state_dict(state_dict[_STATE_KEY])

    def _require_engine(self) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision has no engine: the optimizer step runs only inside Trainer.fit.")
        return self._engine


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

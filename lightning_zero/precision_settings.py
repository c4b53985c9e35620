"""The precisions ZeroStrategy and ZeroFabricStrategy support, and what each does to a module, its inputs and its
forward, shared by the Trainer's plugin (precision.py) and Fabric's (fabric_precision.py). Imports no
``lightning.pytorch``.

The dtypes themselves are held by the engine (see [Note: mixed-precision model states] in
``core/mixed_precision.py``) and so is every piece of step state (see [Note: the step window] in
``core/step/optimizer_step.py``): a plugin picks the dtypes from the ``precision`` flag, enters autocast for the
mixed modes, has the engine scale the fp16 loss and tells it when a backward is over.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
                   "bf16-true": torch.bfloat16}  # fmt: skip
SCALER_STATE_KEY = "loss_scaler"


class ZeroPrecisionSettings:
    """The dtypes and fp16 loss scaling of one supported precision, and the engine a plugin drives (a mixin of the
    Trainer's and Fabric's precision plugins; the arguments are documented on :class:`~lightning_zero.ZeroPrecision`).

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
    def options_of(cls, plugin: Any) -> dict[str, Any]:
        """The arguments that make a plugin of this class equal to ``plugin``, one Lightning or Fabric chose for the
        ``precision`` flag: its precision, and a ``GradScaler``'s settings for fp16."""
        options: dict[str, Any] = {"precision": str(getattr(plugin, "precision", "32-true"))}
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):  # MixedPrecision("16-mixed")
            options.update(
                init_scale=scaler._init_scale,
                growth_factor=scaler._growth_factor,
                backoff_factor=scaler._backoff_factor,
                growth_interval=scaler._growth_interval,
                min_scale=min(1.0, scaler._init_scale),
            )
        return options

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def policy(self) -> PrecisionPolicy:
        """The dtypes the engine holds: 16-bit parameters and gradients with fp32 masters, or plain fp32."""
        if self.compute_dtype == torch.float32:
            return PrecisionPolicy()
        return PrecisionPolicy(self.compute_dtype, self.reduce_dtype, torch.float32)

    def attach(self, engine: ZeroEngine | None) -> None:
        """Drive ``engine`` (``None`` detaches); it scales the loss with this plugin's scaler. The engine holds every
        piece of step state; the plugin keeps none of its own."""
        self._engine = engine
        if engine is not None:
            engine.scaling.scaler = self.scaler

    # ------------------------------------------------------------------ forward
    def convert_module(self, module: nn.Module) -> nn.Module:
        # "true": the model is bf16 (masters are then taken from bf16 values, as Lightning's DeepSpeed does). The
        # mixed modes leave it in fp32: the engine keeps fp32 masters of the original values and casts the rest.
        return module.to(dtype=self.compute_dtype) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=self.compute_dtype)

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

    # ------------------------------------------------------------------ backward
    def scale_loss(self, tensor: Tensor, retain_graph: bool = False) -> Tensor:
        """The loss to call backward on (fp16: scaled by the engine's scaler); ``retain_graph``: that backward keeps
        its graph (see [Note: a retained graph])."""
        return self._engine.scale_loss(tensor, retain_graph) if self._engine is not None else tensor

    def retain_announced_graph(self) -> None:
        """The backward announced by :meth:`scale_loss` keeps its graph (see [Note: a retained graph])."""
        if self._engine is not None:
            self._engine.backward.retain_announced()

    def finish_backward(self) -> None:
        """After every backward: a rank whose loss reached no trainable parameter ran no hook and joins the end of
        backward here."""
        if self._engine is not None:
            self._engine.finish_backward()

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {SCALER_STATE_KEY: self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and SCALER_STATE_KEY in state_dict:
            self.scaler.load_state_dict(state_dict[SCALER_STATE_KEY])

    def require_engine(self, where: str) -> ZeroEngine:
        if self._engine is None:
            raise RuntimeError(f"{type(self).__name__} has no engine: the optimizer step runs only {where}.")
        return self._engine


_BACKWARD_ARGS = ("gradient", "retain_graph", "create_graph", "inputs")


def retains_graph(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``Tensor.backward(*args, **kwargs)`` keeps its graph (``retain_graph``, which defaults to
    ``create_graph``)."""
    given = dict(zip(_BACKWARD_ARGS, args, strict=False)) | kwargs
    retain = given.get("retain_graph")
    return bool(given.get("create_graph", False)) if retain is None else bool(retain)

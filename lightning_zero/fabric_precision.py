"""ZeroFabricPrecision: the precision plugin ZeroFabricStrategy installs; it drives the engine from Fabric's calls.

What each precision does (dtypes, autocast, fp16 loss scaling) is ``precision_settings.py``'s, shared with the
Trainer's :class:`~lightning_zero.ZeroPrecision`; this plugin adds Fabric's side: the loss scaled before
``fabric.backward``, the end of backward after it, and outputs given back in the default dtype as Fabric's own
plugins do. Imports no ``lightning.pytorch``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.precision_settings import ZeroPrecisionSettings, retains_graph


class ZeroFabricPrecision(ZeroPrecisionSettings, Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroFabricStrategy`; ``Fabric(precision=...)`` selects it.

    The same precisions and options as :class:`~lightning_zero.ZeroPrecision` (``"32-true"``, ``"bf16-mixed"``,
    ``"16-mixed"``, ``"bf16-true"``; ``reduce_dtype`` and the fp16 loss scaler's settings). Pass an instance to
    ``Fabric(plugins=[...])`` to change them. Fabric turns ``precision="16-mixed"`` into ``"bf16-mixed"`` on the CPU;
    ``plugins=[ZeroFabricPrecision("16-mixed")]`` keeps fp16.
    """

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZeroFabricPrecision:
        """Translate the plugin Fabric chose for its ``precision`` flag (or ``plugins``)."""
        return plugin if isinstance(plugin, ZeroFabricPrecision) else cls(**cls.options_of(plugin))

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.compute_dtype) if self.precision == "bf16-true" else nullcontext()

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # Here, not in pre_backward: Fabric's strategy drops what pre_backward returns (its own AMP plugin scales here
        # too). The engine scales an fp16 loss and, at stage 3, announces the backward (see [Note: stage-3 backward
        # plan]).
        self.scale_loss(tensor, retains_graph(args, kwargs)).backward(*args, **kwargs)

    @override
    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        self.finish_backward()
        return tensor

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        # The engine's step hooks make the step gradients (fp32, unscaled) and skip an fp16 step that overflowed
        # (see [Note: the step window] in core/step/optimizer_step.py).
        return optimizer.step(**kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Nothing to do: the engine unscales when it makes the step gradients."""

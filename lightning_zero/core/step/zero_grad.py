"""``zero_grad`` of the module and of the optimizer: both empty the gradient shards the steps hold.

Between steps a managed parameter holds no ``grad``: its reduced gradient is held by the step (see [Note: the step
window] in optimizer_step.py), so ``optimizer.zero_grad()`` and ``module.zero_grad()`` are made to empty those.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence
from typing import Any, Protocol

from torch import nn
from torch.optim import Optimizer


class HeldGradients(Protocol):
    """What the ``zero_grad`` hooks call: an optimizer step's emptying of its held gradients."""

    def zero_grad(self, set_to_none: bool, only: set[int] | None = None) -> None: ...


class ModuleGradShards:
    """The optimizer steps whose held gradients ``module.zero_grad()`` empties too (installed on the module by
    :func:`install_module_zero_grad`). A copy of the module (``copy.deepcopy``, pickling) holds none."""

    def __init__(self, steps: Sequence[HeldGradients]) -> None:
        self.steps = list(steps)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModuleGradShards:
        return ModuleGradShards([])

    def __reduce__(self) -> tuple[Any, tuple]:
        return ModuleGradShards, ([],)


def install_module_zero_grad(root: nn.Module, steps: Sequence[HeldGradients]) -> None:
    """Make ``module.zero_grad()`` of ``root`` and of each of its submodules (``self.generator.zero_grad()``) empty
    the held gradient shards of its parameters, as ``optimizer.zero_grad()`` does (Lightning calls the root's
    before each validation loop): without it, the parameters hold no ``grad`` to empty."""
    holder = ModuleGradShards(steps)
    for module in root.modules():
        module._zero_grad_shards = holder  # type: ignore[assignment]
        module.zero_grad = types.MethodType(_module_zero_grad, module)  # type: ignore[method-assign]


def uninstall_module_zero_grad(root: nn.Module) -> None:
    for module in root.modules():
        module.__dict__.pop("zero_grad", None)
        module.__dict__.pop("_zero_grad_shards", None)


def _module_zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    holder = module.__dict__.get("_zero_grad_shards")
    if holder is not None and holder.steps:
        params = {id(p) for p in module.parameters()}
        for step in holder.steps:
            step.zero_grad(set_to_none, only=params)
    type(module).zero_grad(module, set_to_none)


# Pickle stores a bound method as getattr(module, name): a pickled module then gets its class's zero_grad back.
_module_zero_grad.__name__ = _module_zero_grad.__qualname__ = "zero_grad"


@functools.cache
def clearing_class(base: type[Optimizer]) -> type[Optimizer]:
    """``base`` whose ``zero_grad`` first empties the held gradient shards. See [Note: the step window]."""

    def zero_grad(self: Optimizer, set_to_none: bool = True) -> None:
        # getattr, not __dict__: Lightning's LightningOptimizer subclasses this class and forwards attributes.
        step: HeldGradients | None = getattr(self, "_zero_step", None)
        if step is not None:
            step.zero_grad(set_to_none)
        base.zero_grad(self, set_to_none)

    attributes: dict[str, Any] = {
        "zero_grad": zero_grad,
        "_zero_grad_clears_shards": True,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    return type(base.__name__, (base,), attributes)

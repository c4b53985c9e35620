"""``grad_norm``: Lightning's per-parameter gradient norms, for a module whose gradients ZeRO holds sharded."""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
import torch
from lightning.fabric.wrappers import _FabricModule, _unwrap_objects
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.step.optimizer_step import OptimizerStep, StepState
from lightning_zero.fabric_strategy import ZeroFabricStrategy
from lightning_zero.strategy import ZeroStrategy


def grad_norm(
    module: nn.Module,
    norm_type: float | int | str,
    group_separator: str = "/",
    optimizer: Optimizer | None = None,
) -> dict[str, Tensor]:
    """Each parameter's gradient norm and their overall norm, as ``lightning.pytorch.utilities.grad_norm`` gives them
    (same keys and values as under DDP), for a module trained with :class:`~lightning_zero.ZeroStrategy` or
    :class:`~lightning_zero.ZeroFabricStrategy`.

    Under ZeRO the parameters have no ``.grad``: between backward and the step each rank holds its shard of the
    reduced gradients, so Lightning's ``grad_norm`` finds none and returns ``{}``. This one reads the shards of the
    optimizer about to step (unscaled, before clipping) and sums each parameter's parts over the ranks: a
    collective, so call it on every rank, between the backward and ``optimizer.step()``. Under the Trainer, in
    ``on_before_optimizer_step``::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_zero.grad_norm(self, norm_type=2))

    Under Fabric, after ``fabric.backward(loss)`` (of the last micro-batch) and before ``optimizer.step()``, with the
    module ``fabric.setup`` returned; with several optimizers, name the one about to step::

        norms = lightning_zero.grad_norm(model, 2, optimizer=optimizer)

    ``optimizer`` limits the norms to its parameters (under any strategy). Names are those of the module the user
    wrote (a Fabric-wrapped module's own). Under another strategy it is Lightning's ``grad_norm``.

    Raises:
        ValueError: ``norm_type`` is not positive.
        RuntimeError: no optimizer is about to step (under the Trainer: called outside ``on_before_optimizer_step``),
            or under Fabric several could and ``optimizer`` names none.
    """
    strategy = _strategy_of(module)
    user_module = module.module if isinstance(module, _FabricModule) else module  # Fabric's DDP wraps it too
    named = list(user_module.named_parameters())
    if optimizer is not None:
        optimizer = _unwrap_objects(optimizer)
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        named = [(name, param) for name, param in named if id(param) in stepped]
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    by_param: dict[int, Tensor] = {}
    if isinstance(strategy, ZeroStrategy | ZeroFabricStrategy):
        fabric = isinstance(strategy, ZeroFabricStrategy)
        for step in _steps_about_to_step(strategy.session.engine, optimizer, fabric):
            by_param.update(step.grad_norms(norm_type))
    else:  # the parameters hold their gradients: Lightning's grad_norm reads them so
        by_param = {id(p): p.grad.detach().norm(norm_type) for _, p in named if p.grad is not None}
    return _named_norms(named, by_param, norm_type, group_separator)


def _named_norms(
    named: list[tuple[str, nn.Parameter]], by_param: dict[int, Tensor], norm_type: float, group_separator: str
) -> dict[str, Tensor]:
    """Lightning's keys: each named parameter's norm (those in ``by_param``, by ``id``) and their total."""
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": by_param[id(param)].cpu()
        for name, param in named
        if id(param) in by_param
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


def _strategy_of(module: nn.Module) -> object | None:
    """The strategy training ``module``: a Fabric-wrapped module's, a LightningModule's Fabric's or Trainer's."""
    if isinstance(module, _FabricModule):
        return module._strategy
    if isinstance(module, pl.LightningModule):
        if module._fabric is not None:
            return module._fabric.strategy
        if module._trainer is not None:
            return module._trainer.strategy
    return None


def _steps_about_to_step(engine: ZeroEngine, optimizer: Optimizer | None, fabric: bool) -> Iterable[OptimizerStep]:
    """The steps whose gradients to read: those prepared (clipped, or the Trainer's about to step); under Fabric the
    one optimizer's (or ``optimizer``'s), whose step gradients :meth:`OptimizerStep.grad_norms` makes now."""
    steps = [engine.step_of(optimizer)] if optimizer is not None else engine.model.steps
    prepared = [step for step in steps if step.state is StepState.PREPARED]
    if prepared:
        return prepared
    if fabric and len(steps) == 1:
        return steps
    if fabric:
        raise RuntimeError(
            "lightning_zero.grad_norm: the model has several optimizers and none is about to step (clipped): pass the "
            "one about to step, `grad_norm(model, norm_type, optimizer=optimizer)`, after `fabric.backward`."
        )
    raise RuntimeError(
        "lightning_zero.grad_norm reads the gradients of the optimizer about to step, which exist only between "
        "the end of its backward and its step: call it in on_before_optimizer_step (on every rank)."
    )

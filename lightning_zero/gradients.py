"""``grad_norm``: Lightning's per-parameter gradient norms, for a module whose gradients ZeroStrategy holds sharded."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import Tensor

from lightning_zero.core.step.optimizer_step import StepState
from lightning_zero.strategy import ZeroStrategy


def grad_norm(
    module: pl.LightningModule, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, Tensor]:
    """Each parameter's gradient norm and their overall norm, as ``lightning.pytorch.utilities.grad_norm`` gives them
    (same keys and values as under DDP), for a module trained with :class:`~lightning_zero.ZeroStrategy`.

    Under ZeroStrategy the parameters have no ``.grad``: between backward and the step each rank holds its shard of
    the reduced gradients, so Lightning's ``grad_norm`` finds none and returns ``{}``. This one reads the shards of the
    optimizer about to step (unscaled, before clipping) and sums each parameter's parts over the ranks: a
    collective, so call it on every rank, in ``on_before_optimizer_step``::

        def on_before_optimizer_step(self, optimizer):
            self.log_dict(lightning_zero.grad_norm(self, norm_type=2))

    Under another strategy it is Lightning's ``grad_norm``.

    Raises:
        ValueError: ``norm_type`` is not positive.
        RuntimeError: no optimizer is about to step (called outside ``on_before_optimizer_step``).
    """
    strategy = module.trainer.strategy
    if not isinstance(strategy, ZeroStrategy):
        return lightning_grad_norm(module, norm_type, group_separator)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    engine = strategy.session.engine
    stepping = [step for step in engine.model.steps if step.state is StepState.PREPARED]
    if not stepping:
        raise RuntimeError(
            "lightning_zero.grad_norm reads the gradients of the optimizer about to step, which exist only between "
            "the end of its backward and its step: call it in on_before_optimizer_step (on every rank)."
        )
    by_param: dict[int, Tensor] = {}
    for step in stepping:
        by_param.update(step.grad_norms(norm_type))
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": by_param[id(param)].cpu()
        for name, param in module.named_parameters()
        if id(param) in by_param
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms

"""Lightning's side of a loss weighted by tokens (see [Note: weighted loss] in core/step/loss_weight.py): where the
weight of each backward comes from (the dict ``training_step`` returns, or ``manual_backward(..., loss_weight=n)``), and
the errors for a module and an option that do not fit together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.step.loss_weight import check_loss_weight

WEIGHT_KEY = "loss_weight"
_RETURN = '{"loss": loss_sum, "loss_weight": n_tokens}'


def take_training_step_output(engine: ZeroEngine, enabled: bool, output: Any, automatic: bool, step: int) -> None:
    """Check what ``training_step`` returned against ``ZeroStrategy(weighted_loss=enabled)``; in automatic
    optimization give its weight and loss to the engine. ``None`` (skip the step) passes."""
    returned_weight = isinstance(output, Mapping) and WEIGHT_KEY in output
    where = f"training_step at global step {step}"
    if not automatic:
        if returned_weight:
            raise ValueError(
                f"{where} returned 'loss_weight' in manual optimization: pass it to the backward instead, "
                "self.manual_backward(loss_sum, loss_weight=n_tokens)."
            )
        return
    if not enabled:
        if returned_weight:
            raise ValueError(
                f"{where} returned 'loss_weight', but ZeroStrategy(weighted_loss=False) would ignore it. Pass "
                "ZeroStrategy(weighted_loss=True) to train on the mean over all ranks' tokens, or drop the key."
            )
        return
    if output is None:
        return
    if not returned_weight or not isinstance(output.get("loss"), Tensor):
        raise ValueError(
            f"{where}: ZeroStrategy(weighted_loss=True) needs training_step to return {_RETURN} (the sum of the "
            f"per-token losses and how many tokens it summed), got {_describe(output)}."
        )
    weight = check_loss_weight(output[WEIGHT_KEY], where)
    engine.loss_weights.add(weight, float(output["loss"].detach()))


def take_manual_backward(
    engine: ZeroEngine,
    enabled: bool,
    loss: Tensor,
    weight: Any,
    step: int,
    call: str = "self.manual_backward",
    strategy: str = "ZeroStrategy",
) -> None:
    """``manual_backward(loss, loss_weight=weight)`` (or ``call``, e.g. ``fabric.backward``): check it against the
    option and give it to the engine."""
    where = f"{call.removeprefix('self.')} at global step {step}"
    if weight is None:
        if enabled:
            raise ValueError(
                f"{where}: {strategy}(weighted_loss=True) needs {call}(loss_sum, loss_weight=n_tokens), the sum of "
                "the per-token losses and how many tokens it summed."
            )
        return
    if not enabled:
        raise ValueError(
            f"{where} got loss_weight, but {strategy}(weighted_loss=False) would ignore it. Pass "
            f"{strategy}(weighted_loss=True) to train on the mean over all ranks' tokens."
        )
    engine.loss_weights.add(check_loss_weight(weight, where), float(loss.detach()))


def _describe(output: Any) -> str:
    if isinstance(output, Mapping):
        return f"a dict with keys {sorted(output)}"
    return f"a {type(output).__name__}"

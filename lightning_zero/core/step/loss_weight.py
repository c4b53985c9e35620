"""Loss weighted by tokens: the gradient of the global mean over every rank's and micro-batch's tokens.

[Note: weighted loss]
Data parallelism averages each rank's mean loss, and gradient accumulation averages the micro-batches' means, so a
token of a short batch weighs more than a token of a long one. With weighting on, each backward's loss is a *sum*
over its tokens and comes with its weight (the number of tokens it summed). The held, reduced gradient is then
``(1/N) sum_r sum_m c * grad(loss_sum[r, m])`` (N ranks; ``c`` the factor the training loop applied to the loss,
``1/k`` for Lightning's ``accumulate_grad_batches=k``), and the gradient of the global mean is that times
``N / (c W)``, W the sum of all weights of the step. :class:`LossWeights` sums the local weights (and losses,
for the global mean loss), agrees on W with one all-reduce of two numbers before the step, and gives the step
the divisor ``c W / N``; the stores divide the step gradients by it as they divide by the loss scale, before
clipping. A step whose W is 0 (every token masked on every rank) is skipped on every rank.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from lightning_zero.core.comm import Communicator


class LossWeights:
    """The weights of the backward passes since the last agreement, and the agreed weight of the step.

    Args:
        comm: the ranks that share the step.
        device: where the agreement's two numbers live (NCCL needs the GPU).
    """

    def __init__(self, comm: Communicator, device: torch.device) -> None:
        self.comm = comm
        self.device = device
        self.enabled = False
        self.loss_factor = 1.0  # c: what the loop multiplied each loss by (1/k for Lightning's accumulation)
        self._weight = 0.0
        self._loss = 0.0
        self.agreed: tuple[float, float] | None = None  # (global weight, global loss sum) of the last step

    def add(self, weight: float, loss: float) -> None:
        """A backward pass of ``loss`` (a sum over ``weight`` tokens); the first after a step starts a new sum."""
        if self.agreed is not None:
            self._weight = self._loss = 0.0
            self.agreed = None
        self._weight += weight
        self._loss += loss

    def agree(self) -> None:
        """Sum the weights (and losses) of every rank, once per step (collective; a no-op when agreed)."""
        if not self.enabled or self.agreed is not None:
            return
        totals = torch.tensor([self._weight, self._loss], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(totals, op="sum")
        weight, loss = (float(v) for v in totals.tolist())
        self.agreed = (weight, loss)
        if weight == 0:
            warnings.warn(
                "weighted_loss: the global loss weight of this step is 0 (every token masked on every rank): the "
                "optimizer step is skipped on every rank.",
                stacklevel=2,
            )

    @property
    def divisor(self) -> float | None:
        """What the step gradients are divided by (``c W / N``); ``None`` without weighting or agreement."""
        if not self.enabled or self.agreed is None or self.agreed[0] == 0:
            return None
        return self.loss_factor * self.agreed[0] / self.comm.world_size

    @property
    def skips(self) -> bool:
        """The agreed weight is 0: the step changes nothing."""
        return self.enabled and self.agreed is not None and self.agreed[0] == 0

    @property
    def global_weight(self) -> float | None:
        return self.agreed[0] if self.agreed is not None else None

    @property
    def global_mean_loss(self) -> float | None:
        """The summed loss of every rank and micro-batch over the global weight (``nan`` for a weight of 0)."""
        if self.agreed is None:
            return None
        weight, loss = self.agreed
        return loss / weight if weight else math.nan


def check_loss_weight(weight: object, where: str) -> float:
    """``weight`` as a float, or a ``ValueError`` naming ``where`` (e.g. the step) and what is wrong."""
    if isinstance(weight, Tensor):
        if weight.numel() != 1:
            raise ValueError(
                f"{where}: loss_weight must be a scalar (the number of tokens summed into the loss), got a tensor of "
                f"shape {tuple(weight.shape)}."
            )
        value = float(weight.detach().item())
    elif isinstance(weight, int | float) and not isinstance(weight, bool):
        value = float(weight)
    else:
        raise ValueError(f"{where}: loss_weight must be a number or a one-element tensor, got {type(weight).__name__}.")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: loss_weight must be finite and >= 0 (a count of tokens), got {value}.")
    return value

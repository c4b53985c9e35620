"""The per-tensor probe of partition="parameter": optimizers whose update of a tensor depends on that tensor alone
pass; one that combines its tensors (a global norm, L-BFGS) is refused with a ValueError naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_zero.core.step.elementwise import check_elementwise, check_per_tensor


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients divided by their norm over every tensor of the group: not per tensor."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad / norm, alpha=-group["lr"])


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 4))]


PER_TENSOR = {
    "adamw": lambda p: torch.optim.AdamW(p),
    "adafactor": lambda p: torch.optim.Adafactor(p),
    "muon": lambda p: torch.optim.Muon(p),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, centered=True),
}


@pytest.mark.parametrize("name", list(PER_TENSOR))
def test_per_tensor_optimizers_pass(name: str) -> None:
    check_per_tensor(PER_TENSOR[name](_params()), 0)


def test_a_global_norm_is_refused_under_both_partitions() -> None:
    optimizer = GlobalNormSGD(_params())
    with pytest.raises(ValueError, match=r"optimizer 0 \(GlobalNormSGD\), param group 0, combines its tensors: "):
        check_per_tensor(optimizer, 0)
    with pytest.raises(ValueError, match="is not element-wise"):
        check_elementwise(optimizer, 0)


def test_lbfgs_is_refused() -> None:
    with pytest.raises(ValueError, match=r"optimizer 2 \(LBFGS\), param group 0, combines its tensors"):
        check_per_tensor(torch.optim.LBFGS(_params()), 2)

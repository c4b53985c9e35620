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


class ScaledSGD(torch.optim.Optimizer):
    """Element-wise SGD with a factor kept as an attribute of its own, and a history list its step appends to."""

    def __init__(self, params: Any, lr: float = 0.1, scale: float = 0.5) -> None:
        super().__init__(params, {"lr": lr})
        self.scale = scale
        self.history: list[float] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.history.append(self.scale)
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * self.scale)


def test_an_optimizers_own_attributes_reach_the_probe_and_its_steps_change_nothing() -> None:
    """copy.copy keeps only what Optimizer.__getstate__ lists: a custom attribute was missing and a correct
    optimizer refused ("has no attribute 'scale'")."""
    params = _params()
    before = params[0].detach().clone()
    optimizer = ScaledSGD(params)
    check_elementwise(optimizer, 0)
    check_per_tensor(optimizer, 0)
    assert optimizer.history == [], "the probe's steps appended to the optimizer's own list"
    assert torch.equal(params[0], before)


def test_lbfgs_is_refused_for_combining_its_tensors_and_never_steps_the_model() -> None:
    """L-BFGS keeps its parameters in ``_params``: the probe steps its own, and says the real reason (it said "no
    attribute '_params'"); the flat refusal does not send the user to partition='parameter', which refuses it too."""
    params = _params()
    before = params[0].detach().clone()
    optimizer = torch.optim.LBFGS(params)
    with pytest.raises(ValueError, match="is not element-wise: stepped on pieces") as refused:
        check_elementwise(optimizer, 0)
    assert "partition='parameter' cannot train it either" in str(refused.value)
    assert "Use ZeroStrategy(partition='parameter')" not in str(refused.value)
    with pytest.raises(ValueError, match="combines its tensors: stepped on two matrices"):
        check_per_tensor(optimizer, 0)
    assert torch.equal(params[0], before)
    assert optimizer._params[0] is params[0]


def test_the_flat_refusal_of_a_per_tensor_optimizer_points_to_partition_parameter() -> None:
    with pytest.raises(ValueError, match=r"Use ZeroStrategy\(partition='parameter'\) for Adafactor"):
        check_elementwise(torch.optim.Adafactor(_params()), 0)

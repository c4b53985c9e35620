"""partition="flat" refuses, at setup and on every rank, an optimizer whose update is not element-wise (see [Note:
the element-wise probe]); element-wise optimizers pass; and the refusal is needed: Adafactor forced past the probe
trains a different model than on whole tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zero.core.step.elementwise import check_elementwise
from tests.helpers import run_on_ranks

ELEMENTWISE = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD momentum nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p),
    "Adam amsgrad": lambda p: torch.optim.Adam(p, amsgrad=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, fused=True),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, foreach=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p),
    "RMSprop centered": lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
}


class TrustRatioSGD(torch.optim.Optimizer):
    """SGD scaled per tensor by ||p|| / ||g|| (as LARS and LAMB do)."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    ratio = p.norm() / (p.grad.norm() + 1e-12)
                    p.add_(p.grad, alpha=-group["lr"] * float(ratio))


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients divided by their norm over every parameter of the optimizer."""

    def __init__(self, params: object, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / total, alpha=-group["lr"])


NOT_ELEMENTWISE = {
    "Adafactor": lambda p: torch.optim.Adafactor(p),
    "Muon": lambda p: torch.optim.Muon(p),
    "LBFGS": lambda p: torch.optim.LBFGS(p),
    "TrustRatioSGD": TrustRatioSGD,
    "GlobalNormSGD": GlobalNormSGD,
}


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 4))]


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_optimizers_pass_the_probe_and_are_left_untouched(name: str) -> None:
    params = _params()
    before = params[0].detach().clone()
    optimizer = ELEMENTWISE[name](params)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # wraps optimizer.step
    state_before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[params[0]].items()}
    check_elementwise(optimizer, 0)
    state = optimizer.state[params[0]]  # empty, or what the constructor made (Adagrad's sum)
    assert set(state) == set(state_before)
    for key, value in state_before.items():
        assert torch.equal(state[key], value) if isinstance(value, torch.Tensor) else state[key] == value
    assert torch.equal(params[0], before)
    assert optimizer.param_groups[0]["params"] == params
    assert scheduler.last_epoch == 0
    assert not getattr(optimizer, "_opt_called", False)


@pytest.mark.parametrize("name", list(NOT_ELEMENTWISE))
def test_optimizers_that_need_whole_tensors_are_refused(name: str) -> None:
    optimizer = NOT_ELEMENTWISE[name](_params())
    with pytest.raises(ValueError, match=r"is not element-wise.*partition='parameter'") as raised:
        check_elementwise(optimizer, 0)
    assert type(optimizer).__name__ in str(raised.value)


def test_a_second_param_group_is_probed_with_its_own_hyperparameters() -> None:
    first, second = _params(), _params()
    optimizer = TrustRatioSGD([{"params": first}, {"params": second, "lr": 0.0}])
    with pytest.raises(ValueError, match="param group 0"):
        check_elementwise(optimizer, 3)


def _train(rank: int, world_size: int, optimizer_name: str, probe: bool) -> dict[str, object]:
    """Stage 1 on 2 ranks against one process on the global batch, 5 steps; ``probe=False`` forces past it."""
    import lightning_zero.core.setup as setup_module
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    if not probe:
        setup_module.check_elementwise = lambda optimizer, index: None
    make = {"Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2), "AdamW": lambda p: torch.optim.AdamW(p)}
    torch.manual_seed(0)
    # One matrix, so that every rank owns a piece of it (Adafactor divides by a piece's size: an empty one raises).
    initial = nn.Linear(12, 16, bias=False)
    reference, model = copy.deepcopy(initial), copy.deepcopy(initial)
    reference_optimizer = make[optimizer_name](reference.parameters())
    optimizer = make[optimizer_name](model.parameters())
    try:
        engine = ZeroEngine(model, [optimizer], EngineOptions(stage=1), Communicator())
    except ValueError as error:
        return {"error": str(error)}
    for step in range(5):
        data = torch.randn(world_size * 4, 12, generator=torch.Generator().manual_seed(step))
        local = data.chunk(world_size)[rank]
        for net, opt, batch in ((reference, reference_optimizer, data), (model, optimizer, local)):
            opt.zero_grad()
            net(batch).square().mean().backward()
            opt.step()
    with engine.gathered():
        difference = max(
            float((a - b).norm() / b.norm()) for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
    return {"difference": difference}


def test_adafactor_under_flat_is_refused_on_every_rank() -> None:
    for rank, result in enumerate(run_on_ranks(_train, 2, "Adafactor", True)):
        assert "Adafactor" in result.get("error", ""), (rank, result)
        assert "partition='parameter'" in result["error"], (rank, result)


def test_the_refusal_is_needed_adafactor_past_the_probe_trains_another_model() -> None:
    forced = run_on_ranks(_train, 2, "Adafactor", False)
    control = run_on_ranks(_train, 2, "AdamW", True)
    for rank in range(2):
        assert control[rank]["difference"] <= 1e-5, (rank, control[rank])  # the comparison itself is exact
        assert forced[rank]["difference"] > 1e-3, (rank, forced[rank])

"""apply_activation_checkpointing recomputes the chosen modules in backward and leaves the maths unchanged."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing


class Counting(nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counting.calls += 1
        return torch.tanh(super().forward(x))


def test_checkpointed_modules_recompute_in_backward_with_equal_gradients() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(Counting(4, 4), nn.Linear(4, 2))
    checkpointed = copy.deepcopy(plain)
    assert apply_activation_checkpointing(checkpointed, {Counting}) == [checkpointed[0]]
    x = torch.randn(3, 4)
    plain(x).sum().backward()
    Counting.calls = 0
    checkpointed(x).sum().backward()
    assert Counting.calls == 2  # forward, then the recomputation in backward
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    Counting.calls = 0
    with torch.no_grad():
        checkpointed(x)
    assert Counting.calls == 1  # nothing to recompute without autograd


def test_no_policy_wraps_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    assert apply_activation_checkpointing(model, None) == []
    assert apply_activation_checkpointing(model, lambda m: isinstance(m, nn.Linear)) == [model[0]]

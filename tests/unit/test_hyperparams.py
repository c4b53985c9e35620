"""What the ranks compare of each param group before a step (see [Note: agreeing on hyper-parameters])."""

from __future__ import annotations

import torch

from lightning_zero.core.hyperparams import describe


def test_description_holds_plain_values_only() -> None:
    param = torch.nn.Parameter(torch.randn(2))
    optimizer = torch.optim.AdamW([{"params": [param], "hook": lambda x: x}], lr=torch.tensor(0.5), betas=[0.9, 0.95])
    (group,) = describe(optimizer)
    values = dict(group)
    assert "params" not in values
    assert values["lr"] == 0.5  # a tensor learning rate, as its value
    assert values["betas"] == (0.9, 0.95)
    assert values["hook"] == "<builtins.function>"  # not its repr, which holds a per-process address
    assert [key for key, _ in group] == sorted(values)


def test_a_scheduler_step_changes_the_description() -> None:
    param = torch.nn.Parameter(torch.randn(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    before = describe(optimizer)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
    assert describe(optimizer) != before

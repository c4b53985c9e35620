"""What the ranks compare of each param group before a step (see [Note: agreeing on hyper-parameters])."""

from __future__ import annotations

import torch

from lightning_zero.core.comm.hyperparams import describe, describe_difference


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


def _two_groups(scheduler_steps: int | None, weight_decay: float = 0.0) -> list:
    """A rank's description: SGD with two groups, a StepLR (if ``scheduler_steps`` is not None) stepped that often."""
    first, second = torch.nn.Parameter(torch.randn(2)), torch.nn.Parameter(torch.randn(2))
    groups = [{"params": [first]}, {"params": [second], "weight_decay": weight_decay}]
    optimizer = torch.optim.SGD(groups, lr=0.008, momentum=0.9)
    if scheduler_steps is not None:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for _ in range(scheduler_steps):
            optimizer.step()
            scheduler.step()
    return describe(optimizer)


def test_the_difference_names_every_differing_key_of_every_group_with_every_ranks_value() -> None:
    # rank 0 has no scheduler; ranks 1, 2 and 4 stepped theirs once, rank 3 twice; rank 4 also has weight decay.
    everyone = [_two_groups(None), _two_groups(1), _two_groups(1), _two_groups(2), _two_groups(1, weight_decay=0.1)]
    message = describe_difference("optimizer 0 (SGD)", everyone)
    for group in (0, 1):
        assert f"param group {group}: " in message, message
    for expected in (
        "rank 0 has initial_lr=<missing>",
        "ranks 1-4 have initial_lr=0.008",
        "rank 0 has lr=0.008",
        "ranks 1-2, 4 have lr=0.004",
        "rank 3 has lr=0.002",
        "ranks 0-3 have weight_decay=0.0, rank 4 has weight_decay=0.1",
    ):
        assert expected in message, message
    assert "momentum" not in message, message  # equal everywhere: not a difference
    assert message.count("weight_decay") == 2, message  # group 1 only
    assert message == describe_difference("optimizer 0 (SGD)", [list(groups) for groups in everyone])


def test_the_difference_names_a_different_number_of_groups() -> None:
    one, two = _two_groups(None)[:1], _two_groups(None)
    message = describe_difference("optimizer 1 (AdamW)", [one, two, two])
    assert "rank 0 has 1 param group, ranks 1-2 have 2 param groups" in message, message

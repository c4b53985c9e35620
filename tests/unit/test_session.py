"""A ZeroSession before its engine (see [Note: a session before its engine] in session.py): what needs shards
raises one error naming the fix; everything else is the plain module's, or does nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.session import NOT_SET_UP, ZeroSession


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_what_needs_shards_raises_before_setup() -> None:
    session = ZeroSession(ZeroConfig())
    assert not session.sharded
    assert session.engine_or_none is None
    for report in (session.memory_report, session.comm_report, lambda: session.engine):
        with pytest.raises(RuntimeError, match=r"call this during or after Trainer\.fit setup"):
            report()
    assert NOT_SET_UP.startswith("ZeroStrategy has no sharded state yet")


def test_an_unsharded_session_gives_the_modules_own_state() -> None:
    session = ZeroSession(ZeroConfig())
    model, optimizer = _model()
    state = session.module_state_dict(model, keep=True)
    assert state.keys() == model.state_dict().keys()
    assert session.optimizer_state(optimizer, keep=True)["state"].keys() == optimizer.state_dict()["state"].keys()
    assert not session.sharded_checkpoints
    other = nn.Linear(3, 2)
    session.load_module_state_dict(other, {"state_dict": state}, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(other.parameters(), model.parameters(), strict=True))
    session.load_optimizer_states([optimizer], {"optimizer_states": [{}]}, strict_loading=True)  # none managed


def test_an_unsharded_session_does_nothing_around_steps() -> None:
    session = ZeroSession(ZeroConfig())
    model, _ = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with (
        session.training_forward(manual=True),
        session.evaluation_step(last=True),
        session.no_sync(),
        session.gathered(True),
    ):
        model(torch.ones(1, 3))
    session.take_training_step_output({"loss": torch.ones(()), "loss_weight": 3}, automatic=True, step=0)
    session.take_manual_backward(torch.ones(()), 3, step=0)
    session.remove_hooks()
    assert session.global_loss_weight is None
    assert session.global_mean_loss is None
    assert session.keeps(model, fitting=False) is False
    assert not session.sharded
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))

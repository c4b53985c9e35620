"""A module trained by one ``Trainer`` is fit again by a new ``Trainer`` with a new ``ZeroStrategy`` (a second
``fit`` of the same module, e.g. a second phase of training): the first strategy's engine gives the module its full
parameters back before the new one moves and shards it, and the two fits train as two DDP fits do. Found by a user
script: at stage 3 the new strategy's move to the device read the parameters the first engine still held sharded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers import run_on_ranks
from tests.lightning.models import TwoLayer, make_loader, make_trainer, max_rel_diff, state_of

STAGES = (2, 3)


def _two_fits(rank: int, world_size: int) -> dict[Any, Any]:
    from lightning_zero import ZeroStrategy

    out: dict[Any, Any] = {}
    for name in ("ddp", *STAGES):
        torch.manual_seed(0)
        model = TwoLayer()
        hooks = []
        for _ in range(2):
            strategy = DDPStrategy() if name == "ddp" else ZeroStrategy(stage=name)
            make_trainer(world_size, strategy, max_steps=3).fit(model, make_loader("two_layer"))
            hooks.append(sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))
        if name == "ddp":
            out[name] = state_of(model)
        else:
            with strategy.gathered_params():
                out[name] = state_of(model)
            # The first engine's units no longer hook the module's forwards: only the second engine's do.
            out[f"{name}/hooks"] = hooks
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return run_on_ranks(_two_fits, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_a_new_trainer_fits_the_module_again_like_ddp(results: list[dict[Any, Any]], stage: int) -> None:
    for rank, out in enumerate(results):
        diffs = max_rel_diff(out["ddp"], out[stage])
        assert max(diffs.values()) <= 1e-5, f"rank {rank}: {diffs}"
        first, second = out[f"{stage}/hooks"]
        assert second == first, f"rank {rank}: forward hooks after the first fit {first}, after the second {second}"

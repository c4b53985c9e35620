"""The same seed and data give bit-identical parameters and optimizer state in two separate runs (fresh processes),
with the prefetch, the asynchronous reductions and the swap file's worker threads all in play."""

from __future__ import annotations

import hashlib
import tempfile

import pytest
import torch
from torch import nn

from tests.helpers import run_on_ranks

CONFIGS = {
    "stage2": ({"stage": 2}, None),
    "stage3_bf16_everything_on_nvme": ({"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}, "bf16"),
}


def _digest(rank: int, world_size: int, config: str) -> str:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.mixed_precision import PrecisionPolicy
    from lightning_zero.core.options import EngineOptions

    options, precision = CONFIGS[config]
    if "offload_optimizer" in options:
        options = {**options, "nvme_path": tempfile.mkdtemp(prefix="lz-det-")}
    policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if precision else None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)], nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config_ = EngineOptions(bucket_cap_mb=0.002, **options)
    engine = ZeroEngine(model, [optimizer], config_, Communicator(), precision=policy)
    for step in range(4):
        data = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=policy is not None):
            loss = model(data).float().square().mean()
        loss.backward()
        engine.finish_backward()
        engine.step_of(optimizer).clip_grad_norm_(1.0)
        optimizer.step()
    digest = hashlib.sha256()
    for name, value in sorted(engine.full_state_dict(keep=True).items()):
        digest.update(name.encode() + value.detach().float().numpy().tobytes())
    for values in engine.named_state().optimizer_shard_state(0).values():
        for key in sorted(values):
            if isinstance(values[key], torch.Tensor):
                digest.update(values[key].detach().float().numpy().tobytes())
    engine.release()
    return digest.hexdigest()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_runs_are_bit_identical(config: str) -> None:
    first = run_on_ranks(_digest, 2, config)
    second = run_on_ranks(_digest, 2, config)
    assert first == second

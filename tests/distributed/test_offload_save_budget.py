"""A sharded save of an NVMe-offloaded rank is streamed from the swap file: with the process's anonymous memory
capped (``RLIMIT_DATA``) below the size of its optimizer state, the save completes and the rank file holds exactly
the state the swap file holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import run_on_ranks

LAYERS = 24  # 24M fp32 parameters: master and Adam's moments 288 MiB in the swap file
HEADROOM = 96 * 2**20  # the cap above what the process holds before the save: a third of that state

CAPPED_SAVE = textwrap.dedent(
    """
    import json, resource, sys, tempfile
    import torch, torch.distributed as dist
    from lightning_zero.checkpoint.saving import save_sharded
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    nvme_path, checkpoint, headroom, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = EngineOptions(stage=3, offload_optimizer="nvme", offload_params="nvme", nvme_path=nvme_path)
    engine = ZeroEngine(model, [optimizer], options, Communicator(), device=torch.device("cpu"))
    data = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        optimizer.zero_grad()
        model(data).square().mean().backward()
        optimizer.step()
    vm_data = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (vm_data + headroom, resource.RLIM_INFINITY))
    try:
        save_sharded(engine.named_state(), checkpoint, extra={}, version="test")
    except (RuntimeError, MemoryError) as error:
        print(json.dumps({"error": str(error)[:300]}))
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    saved = torch.load(f"{checkpoint}/rank_0.pt", map_location="cpu", weights_only=True)
    state = engine.named_state()
    held = state.optimizer_shard_state(0)
    same_state = all(
        torch.equal(saved["optimizers"][0]["state"][name][key], value)
        for name, values in held.items() for key, value in values.items() if isinstance(value, torch.Tensor)
    )
    same_params = all(torch.equal(saved["params"][t.name], t.owned()) for t in state.tensors())
    state_bytes = sum(
        v.numel() * v.element_size() for values in held.values() for v in values.values() if v.dim() > 0
    )
    print(json.dumps({"same_state": same_state, "same_params": same_params, "state_bytes": state_bytes,
                      "tensors": len(held)}))
    """
)


def test_nvme_save_streams_from_the_swap_file_under_a_memory_cap(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    swap, checkpoint = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    args = [sys.executable, "-c", CAPPED_SAVE, str(swap), str(checkpoint), str(HEADROOM), str(LAYERS)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert "error" not in result, result
    assert result["tensors"] == LAYERS
    assert result["state_bytes"] >= 2 * HEADROOM  # the moments alone are twice the cap
    assert result["same_state"]
    assert result["same_params"]


def _saved_storages(rank: int, world_size: int, stage: int) -> dict[str, bool]:
    import torch

    from lightning_zero.checkpoint.state import collect_rank_state
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=stage, offload_optimizer="cpu"), Communicator())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    saved = collect_rank_state(engine.named_state(), rank)
    masters = {store.master.untyped_storage().data_ptr() for store in (g.store for g in engine.model.trained)}
    moments = {v.untyped_storage().data_ptr() for s in optimizer.state.values() for v in s.values() if v.dim()}
    state = saved["optimizers"][0]["state"]
    return {
        "params_are_the_masters": {t.untyped_storage().data_ptr() for t in saved["params"].values()} <= masters,
        "moments_not_copied": {v.untyped_storage().data_ptr() for s in state.values() for v in s.values() if v.dim()}
        <= moments,
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_cpu_offload_saves_host_tensors_without_copies(stage: int) -> None:
    """``offload_optimizer="cpu"``: the rank file is written from the host master and state themselves (a copy
    would need the rank's share twice in host memory)."""
    for rank, result in enumerate(run_on_ranks(_saved_storages, 2, stage)):
        assert result["params_are_the_masters"], (rank, result)
        assert result["moments_not_copied"], (rank, result)

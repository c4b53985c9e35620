"""A memory budget that bites: with the process's anonymous memory capped (``RLIMIT_DATA``, no root needed) just
above what it holds before its first optimizer step, plus less than the optimizer state would take, a step
without offload fails with the allocator's error, and the same steps with NVMe offload complete, page the state
through a few bucket-sized slots, and equal the ``"cpu"`` run (which has no cap) bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

LAYERS = 24
PARAMS = LAYERS * 2**20  # 24M fp32 parameters: Adam's state is 192 MiB, the master 96 MiB
# The cap above what the process holds before its first step: half the state. NVMe offload needs about 80 MiB
# of it whatever the model's size (measured: 3-4 bucket pages of 12 MiB in flight, the two swap threads' stacks,
# the CPU kernel's threads); without offload the step needs the whole state.
HEADROOM = 96 * 2**20

BUDGETED_STEPS = textwrap.dedent(
    """
    import hashlib, json, os, resource, sys, tempfile
    import torch, torch.distributed as dist
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    offload, nvme_path, headroom, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "budget"
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(int(sys.argv[5]))])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    options = EngineOptions(stage=2, bucket_cap_mb=1, offload_optimizer=offload or False, nvme_path=nvme_path)
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    data = torch.randn(4, 1024, generator=torch.Generator().manual_seed(1))
    model(data).square().mean().backward()
    vm_data = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:"))
    if budget:
        resource.setrlimit(resource.RLIMIT_DATA, (vm_data + headroom, resource.RLIM_INFINITY))
    try:
        for step in range(3):
            if step:
                optimizer.zero_grad()
                model(data).square().mean().backward()
            optimizer.step()
    except (RuntimeError, MemoryError) as error:
        print(json.dumps({"error": str(error)[:300]}))
        sys.exit(0)
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # for the digest
    digest = hashlib.sha256()
    for value in model.state_dict().values():
        digest.update(value.detach().numpy().tobytes())
    print(json.dumps({"ok": True, "read": engine.io_counts.read, "vm_data": vm_data, "sha256": digest.hexdigest()}))
    """
)


def _run(offload: str, directory: Path, budget: bool) -> dict:
    repo = Path(__file__).resolve().parents[2]
    limit = "budget" if budget else "-"
    args = [sys.executable, "-c", BUDGETED_STEPS, offload, str(directory), str(HEADROOM), limit, str(LAYERS)]
    # glibc's dynamic mmap threshold would keep freed slot-sized blocks in the heap (counted by RLIMIT_DATA)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    run = subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    directory = tmp_path_factory.mktemp("budget")
    runs = {
        "none": _run("", directory, budget=True),
        "nvme": _run("nvme", directory, budget=True),
        "cpu": _run("cpu", directory, budget=False),
    }
    return directory, runs


def test_without_offload_the_budget_bites(results: tuple[Path, dict[str, dict]]) -> None:
    error = results[1]["none"].get("error", "")
    assert "can't allocate memory" in error or "memory" in error.lower(), results[1]["none"]


def test_nvme_offload_trains_within_the_budget_and_equals_cpu_offload(results: tuple[Path, dict[str, dict]]) -> None:
    # Digests, not tensors: 96 MiB of parameters loaded here would raise this process's peak RSS, which the
    # processes it spawns later inherit as the floor of their ru_maxrss.
    _, runs = results
    assert runs["nvme"].get("ok"), runs["nvme"]
    assert runs["nvme"]["read"] >= 12 * PARAMS * 2  # steps 2 and 3 read master and state from the file
    assert runs["nvme"]["sha256"] == runs["cpu"]["sha256"]


REBUILT_THREE_TIMES = textwrap.dedent(
    """
    import gc, json, os, sys, tempfile, threading
    import torch, torch.distributed as dist
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    def rss():
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))

    offload, nvme_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    after = []
    for build in range(3):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        options = EngineOptions(stage=2, bucket_cap_mb=1, offload_optimizer=offload, nvme_path=nvme_path)
        engine = ZeroEngine(model, [optimizer], options, Communicator())
        for step in range(2):
            optimizer.zero_grad()
            model(torch.randn(4, 1024)).square().mean().backward()
            optimizer.step()
        engine.release()
        del engine, model, optimizer
        gc.collect()
        after.append({"rss": rss(), "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()})
    print(json.dumps(after))
    """
)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_three_engines_in_one_process_leave_memory_files_and_threads_where_one_left_them(
    tmp_path: Path, offload: str
) -> None:
    """Each engine holds 4.2M parameters: a master and AdamW state kept alive would add 48 MiB per build."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    args = [sys.executable, "-c", REBUILT_THREE_TIMES, offload, str(tmp_path)]
    run = subprocess.run(args, cwd=repo, capture_output=True, text=True, check=False, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    first, _, third = json.loads(run.stdout.strip().splitlines()[-1])
    assert third["rss"] - first["rss"] < 8 * 2**20, (first, third)
    assert third["fds"] == first["fds"]
    assert third["threads"] == first["threads"]
    assert list(tmp_path.iterdir()) == []

"""Run a function on several real processes joined by a gloo process group (no mocked collectives)."""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, init_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return each rank's result.

    Each process has the environment of a ``torchrun`` launch (MASTER_ADDR/PORT, RANK, LOCAL_RANK,
    WORLD_SIZE), so a ``Trainer`` inside it joins the same process group instead of launching. With
    ``init_group`` the default gloo group is created before ``fn`` runs. An exception on any rank fails
    the call with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, init_group, args, queue))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + _TIMEOUT_S
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=1)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    errors[-1] = f"ranks {dead or 'some'} crashed or hung; answers came from {sorted(results)}"
                    break
                continue
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[rank] for rank in range(world_size)]


def _worker(fn, rank, world_size, port, init_group, args, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=_TIMEOUT_S))
        result = fn(rank, world_size, *args)
        # Through bytes: tensors sent as shared memory would vanish when this process exits.
        payload = io.BytesIO()
        torch.save(result, payload)
        queue.put((rank, True, payload.getvalue()))
    except BaseException:  # report every failure, including asserts, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

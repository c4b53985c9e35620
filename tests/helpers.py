"""Run a function on several real processes joined by one process group (no mocked collectives).

The one multi-process launcher of this repository: the tests (``from tests.helpers import run_on_ranks``) and the
benchmarks (``benchmarks/zero_bench/launch.py`` for ``bench_zero.py`` and the scripts built on it,
``gloo_collectives.py``, ``soak.py``) all start their ranks here. Lightning-level tests that need the strategy's
own launcher (``tests/lightning/test_launcher.py``) and the scripts that kill a rank on purpose
(``subprocess.Popen`` ranks in ``test_lost_rank.py``, ``clean_exits.py``, ``gpu_check.py``) start theirs
themselves.

[Note: where the launcher lives]
In ``tests/``, outside the package, for three reasons:

- ``tests`` is a regular package that both sides import from the repository root: pytest puts the root on
  ``sys.path``, and every benchmark script puts it there too (for ``examples.gpt``). ``benchmarks/`` is a folder
  of scripts that import one another as top-level modules, so a module there would need a second name for the
  tests.
- ``benchmarks/ab_core.py`` runs the benchmarks against an older checkout of ``lightning_zero``. This module
  imports only torch and the standard library, so it works whatever the checkout holds.
- ``lightning_zero`` launches ranks for users through ``ZeroStrategy``; this launcher is for the repository's
  own tests and measurements and is not part of the package's contract.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 240  # the tests' deadline: a rank that has not answered by then fails the call
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # the world group's backend per device type
# How long the ranks get to exit, all together, before they are killed: after every rank answered (they tear down
# their groups and interpreters), and after a failure (the others are likely stuck in a collective).
_EXIT_S = 30
_EXIT_AFTER_FAILURE_S = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _Launch:
    """How each rank starts: its thread count, device type, whether it joins the world group, and the deadline."""

    init_group: bool
    threads: int
    device_type: str
    timeout_s: float
    per_node: int


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    init_group: bool = True,
    threads: int = 1,
    env: dict[str, str] | None = None,
    device_type: str = "cpu",
    timeout_s: float = TIMEOUT_S,
    nodes: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return each rank's result.

    Each process has the environment of a ``torchrun`` launch (MASTER_ADDR/PORT, RANK, LOCAL_RANK,
    WORLD_SIZE), so a ``Trainer`` inside it joins the same process group instead of launching, plus ``env``
    (set before the interpreters start, so that glibc reads ``MALLOC_*`` from it), and ``threads`` torch
    threads. With ``init_group`` the default group is created before ``fn`` runs: gloo's for
    ``device_type="cpu"``, NCCL's for ``"cuda"`` (rank ``r`` on ``cuda:r``, one node). An exception on any rank
    fails the call with that rank's traceback; so does a rank that dies or has not answered after
    ``timeout_s`` seconds (also the group's collective timeout). ``nodes`` numbers the ranks as a launch on that
    many nodes would (LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK), all on this machine's loopback.
    """
    if world_size % nodes:
        raise ValueError(f"nodes={nodes} does not divide world_size={world_size}")
    if device_type not in BACKENDS:
        raise ValueError(f"device_type={device_type!r}: expected one of {sorted(BACKENDS)}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    launch = _Launch(init_group, threads, device_type, timeout_s, world_size // nodes)
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, launch, queue))
        for rank in range(world_size)
    ]
    with _environment(env or {}):  # spawned interpreters inherit it
        for proc in procs:
            proc.start()
    try:
        results, errors = _collect(procs, queue, timeout_s)
    except BaseException:  # interrupted: end the ranks before the error goes on
        _stop(procs, _EXIT_AFTER_FAILURE_S)
        raise
    _stop(procs, _EXIT_AFTER_FAILURE_S if errors else _EXIT_S)
    if errors:
        rank = min(errors)
        others = "".join(f"\n(also rank {r}: {errors[r].strip().splitlines()[-1]})" for r in sorted(errors)[1:])
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}{others}")
    return [results[rank] for rank in range(world_size)]


def _collect(procs: list[Any], queue: Any, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
    """Each rank's answer (a result or a traceback), until a rank died without one or time is up."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=1)
        except queue_module.Empty:
            silent = [r for r in range(len(procs)) if r not in results and r not in errors]
            failures = _silent_failures(procs, silent, time.monotonic() > deadline, timeout_s)
            if failures:  # the others may wait for a dead rank in a collective until their group times out
                errors.update(failures)
                break
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
    return results, errors


def _silent_failures(procs: list[Any], silent: list[int], late: bool, timeout_s: float) -> dict[int, str]:
    """Why the ranks that have not answered never will: those that died, else (``late``) all of them."""
    dead = {r: procs[r].exitcode for r in silent if procs[r].exitcode not in (None, 0)}
    if dead:
        return {r: f"died with exit code {code} without an answer (its output is above)" for r, code in dead.items()}
    return dict.fromkeys(silent, f"no answer within {timeout_s:.0f} s (hung?)") if late else {}


def _stop(procs: list[Any], grace_s: float) -> None:
    """Join the ranks, killing those still alive after ``grace_s`` seconds in all."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, launch: _Launch, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank % launch.per_node),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(launch.per_node),
        NODE_RANK=str(rank // launch.per_node),
        GROUP_RANK=str(rank // launch.per_node),
    )
    torch.set_num_threads(launch.threads)
    try:
        if launch.device_type == "cuda":
            torch.cuda.set_device(rank)  # before NCCL starts: one node, a GPU per rank
        if launch.init_group:
            timeout = timedelta(seconds=launch.timeout_s)
            dist.init_process_group(BACKENDS[launch.device_type], rank=rank, world_size=world_size, timeout=timeout)
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


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` added to ``os.environ`` for the duration (restored after)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

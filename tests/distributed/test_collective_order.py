"""The order of collectives is owned (see [Note: the order of collectives]): for every combination of the engine's
options, recorded on 2 real gloo ranks,

- the first two collectives of setup are the agreements on the parameters and on the options, and no process group
  is created before them (``new_group`` is itself a collective: a rank that disagrees must not be waiting in it);
- every rank issues the same collectives, on the same group, in the same order, through setup and three training
  iterations in which rank 1's loss reaches only the first block in one and no parameter in another (a backward that
  differs between ranks is legal);
- nothing calls ``torch.distributed`` behind the communicator's back (a collective outside it would neither be
  counted nor read the failure notices).

ZeRO++'s options (``quantize_weights``, ``quantize_gradients``, ``secondary_shard_size``) join the record with the
2 ranks numbered as 2 nodes of 1 (``ranks_per_node=1``), so that the secondary and the node/cross groups exist and
the gradients cross "nodes" quantized.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.helpers import run_on_ranks

STAGES = (1, 2, 3)
PARTITIONS = ("flat", "parameter")
OFFLOADS = {  # name -> (offload_optimizer, offload_params)
    "none": (False, False),
    "cpu": ("cpu", False),
    "nvme": ("nvme", False),
    "params_cpu": ("cpu", "cpu"),
    "params_nvme": ("nvme", "nvme"),
}
PRECISIONS = ("32-true", "bf16-mixed")
ZEROPP = {  # name -> (quantize_weights, quantize_gradients, secondary_shard_size)
    "-": (False, False, None),
    "qw": (True, False, None),
    "qg": (False, True, None),
    "hp": (False, False, 1),
    "pp": (True, True, 1),
}
COMMUNICATOR_METHODS = (
    "agree",
    "all_gather_object",
    "broadcast_object",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "exchange_tags",
    "barrier",
    "all_to_all",
    "all_gather_quantized",
)
RAW_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_object",
    "broadcast_object_list",
    "barrier",
    "all_to_all",
    "all_to_all_single",
)


Case = tuple[int, str, str, str, int | None, str]


def combinations() -> list[Case]:
    """Every stage x partition x offload x precision, flat; in fp32 also hybrid (``shard_size=1`` on 2 ranks: a
    shard group per rank and one replicate group). ZeRO++: every option and all three at stage 3 (flat partition)
    with and without offloaded parameters, in both precisions, all three also hybrid; ``quantize_gradients`` at
    stages 1 and 2."""
    cases: list[Case] = []
    for stage, partition, offload, precision in itertools.product(STAGES, PARTITIONS, OFFLOADS, PRECISIONS):
        if offload.startswith("params") and stage != 3:
            continue
        for shard_size in (None, 1) if precision == "32-true" else (None,):
            cases.append((stage, partition, offload, precision, shard_size, "-"))
    for zeropp, offload, precision in itertools.product(("qw", "qg", "hp", "pp"), ("none", "params_cpu"), PRECISIONS):
        cases.append((3, "flat", offload, precision, None, zeropp))
    cases.append((3, "flat", "cpu", "32-true", 1, "pp"))
    cases += [(stage, "flat", "none", precision, None, "qg") for stage in (1, 2) for precision in PRECISIONS]
    return cases


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(9, 9) for _ in range(3))
        self.head = nn.Linear(9, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        first = torch.tanh(self.blocks[0](x))
        hidden = first
        for block in self.blocks[1:]:
            hidden = torch.tanh(block(hidden))
        return self.head(hidden), first


class Recorder:
    """Wraps the communicator's collectives, ``new_group`` and torch's raw collectives, in this process."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.depth = 0  # inside a communicator method
        self.outside: list[str] = []  # raw collectives issued outside one

    def install(self) -> None:
        from lightning_zero.core.comm import communicator as comm_module

        for name in COMMUNICATOR_METHODS:
            setattr(comm_module.Communicator, name, self._method(getattr(comm_module.Communicator, name), name))
        for name in RAW_COLLECTIVES:
            if hasattr(dist, name):
                setattr(dist, name, self._raw(getattr(dist, name), name))
        for name in ("_all_gather_single", "_reduce_scatter_single"):
            setattr(comm_module, name, self._raw(getattr(comm_module, name), name))
        dist.new_group = self._new_group(dist.new_group)

    def _method(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        recorder = self

        @functools.wraps(method)
        def wrapper(comm: Any, *args: Any, **kwargs: Any) -> Any:
            if recorder.depth == 0:
                recorder.events.append((comm.role, name))  # "world", "shard", "gather", "replicate"
            recorder.depth += 1
            try:
                return method(comm, *args, **kwargs)
            finally:
                recorder.depth -= 1

        return wrapper

    def _raw(self, function: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.depth == 0:
                self.outside.append(name)
            return function(*args, **kwargs)

        return wrapper

    def _new_group(self, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.events.append(("world", "new_group"))
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper


def _record(rank: int, world_size: int, cases: list[Case], nvme: str) -> dict[str, Any]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    recorder = Recorder()
    recorder.install()
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.mixed_precision import PrecisionPolicy
    from lightning_zero.core.options import EngineOptions

    results: dict[str, Any] = {}
    for index, (stage, partition, offload, precision, shard_size, zeropp) in enumerate(cases):
        recorder.events, recorder.outside = [], []
        torch.manual_seed(0)
        model = Blocks()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        offload_optimizer, offload_params = OFFLOADS[offload]
        quantize_weights, quantize_gradients, secondary_shard_size = ZEROPP[zeropp]
        options = EngineOptions(
            stage=stage,
            partition=partition,
            offload_optimizer=offload_optimizer,
            offload_params=offload_params,
            nvme_path=nvme,
            bucket_cap_mb=0.0005,
            wrap_policy={nn.Linear} if stage == 3 else None,
            overlap_comm=index % 2 == 0,
            shard_size=shard_size,
            quantize_weights=quantize_weights,
            quantize_gradients=quantize_gradients,
            secondary_shard_size=secondary_shard_size,
        )
        policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if precision == "bf16-mixed" else None
        with _nodes_of_one(zeropp != "-", rank):  # ZeRO++: 2 nodes of 1 rank
            engine = ZeroEngine(model, [optimizer], options, Communicator(), precision=policy)
        setup = len(recorder.events)
        for step in range(3):
            engine.begin_iteration()
            optimizer.zero_grad()
            engine.model.scheduler.unshard_root()
            x = torch.randn(4, 9, generator=torch.Generator().manual_seed(10 * step + rank))
            out, first = model(x.to(policy.param_dtype) if policy else x)
            loss = out.float().pow(2).mean()
            if rank == 1 and step == 1:
                loss = first.float().pow(2).mean()  # reaches the first block only
            if rank == 1 and step == 2:
                loss = 0 * out.detach().float().requires_grad_().sum()  # reaches no parameter
            engine.scale_loss(loss).backward()
            engine.finish_backward()
            engine.step_of(optimizer).clip_grad_norm_(1.0)
            optimizer.step()
            engine.model.scheduler.reshard_all()
        engine.release()
        results["/".join(map(str, (stage, partition, offload, precision, shard_size, zeropp)))] = {
            "events": recorder.events,
            "setup": setup,
            "outside": recorder.outside,
        }
    return results


@contextlib.contextmanager
def _nodes_of_one(active: bool, rank: int) -> Iterator[None]:
    """The environment a launcher gives a rank alone on its node, inside the block (where ``active``)."""
    saved = {name: os.environ.get(name) for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if active:
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    nvme = str(tmp_path_factory.mktemp("nvme"))
    return run_on_ranks(_record, 2, combinations(), nvme, init_group=False)


CASES = ["/".join(map(str, case)) for case in combinations()]


@pytest.mark.parametrize("case", CASES)
def test_setup_agrees_first_and_every_rank_issues_the_same_collectives(
    records: list[dict[str, Any]], case: str
) -> None:
    for rank, per_rank in enumerate(records):
        record = per_rank[case]
        events = record["events"]
        assert events[:2] == [("world", "agree"), ("world", "agree")], f"rank {rank}: setup began with {events[:3]}"
        groups = [i for i, event in enumerate(events) if event[1] == "new_group"]
        assert all(i >= 2 for i in groups), f"rank {rank}: a group was created before the agreements"
        if case.startswith("3/"):
            assert groups, "stage 3 gathers over a group of its own"
        roles = {e[0] for e in events}
        shard_size, zeropp = case.split("/")[-2:]
        if shard_size == "1":
            assert {"shard", "replicate"} <= roles, f"rank {rank}: hybrid used {roles}"
        if zeropp in ("hp", "pp"):
            assert ("secondary", "all_gather") in events, f"rank {rank}: backward never gathered a secondary shard"
        if zeropp in ("qw", "pp"):
            assert ("gather", "all_gather_quantized") in events, f"rank {rank}: no quantized gather in {roles}"
        if zeropp in ("qg", "pp"):
            quantized = {"all_to_all", "all_gather"} if shard_size == "None" else {"all_gather"}
            assert any(e in events for e in itertools.product(("cross", "replicate"), quantized)), (
                f"rank {rank}: gradients never crossed the nodes: {sorted(set(events))}"
            )
        assert record["outside"] == [], f"rank {rank}: collectives outside the communicator: {record['outside']}"
    first, second = (per_rank[case]["events"] for per_rank in records)
    for group in {e[0] for e in first + second}:
        ours = [e for e in first if e[0] == group]
        theirs = [e for e in second if e[0] == group]
        assert ours == theirs, f"the ranks' {group} collectives differ: {ours} vs {theirs}"

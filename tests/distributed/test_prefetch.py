"""Stage-3 prefetch: the next unit's gather starts while the current unit computes, and nothing is wasted."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.layout.flat_buffer import ShardedState
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from tests.helpers import run_on_ranks

DEPTH = 6
STEPS = 3


def _in_flight(engine: ZeroEngine) -> int:
    """Units that are gathered or being gathered right now."""
    return sum(1 for unit in engine.model.units if unit._pending or unit.state is ShardedState.GATHERED)


def _run(rank: int, overlap: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(DEPTH)])  # six units, an empty root
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, overlap_comm=overlap), Communicator())
    seen: list[list[int]] = []
    for layer in model:  # registered after the engine's hooks, so it runs once the layer is gathered
        layer.register_forward_pre_hook(lambda module, args: seen[-1].append(_in_flight(engine)))
    gathered_bytes = []
    for step in range(STEPS):
        seen.append([])
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))).square().sum().backward()
        optimizer.step()
        gathered_bytes.append(engine.last_step_comm.by_op["all_gather"])
    with engine.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {"in_flight": seen, "all_gather": gathered_bytes, "weights": weights, "after": _in_flight(engine)}


def _runs(rank: int, world_size: int) -> dict[Any, dict]:
    return {
        **{overlap: _run(rank, overlap) for overlap in (True, False)},
        "announced": _announced(rank),
        **{f"recomputed={on}": _recomputed(rank, on) for on in (False, True)},
        **{
            f"frozen_base={on}": _frozen_base(rank, on)
            for on in (False, True, "save_on_cpu", "save_on_cpu_inside", "reentrant")
        },
        "recomputed=reentrant": _recomputed(rank, "reentrant"),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, dict]]:
    """One spawn for the tests below that read plain runs."""
    return run_on_ranks(_runs, 2)


def test_prefetch_gathers_one_unit_ahead_without_extra_traffic(runs: list[dict[Any, dict]]) -> None:
    for per_rank in runs:
        on, off = per_rank[True], per_rank[False]
        # Without prefetch only the computing unit is gathered; with it the next one is on its way, except
        # in the first step (no order recorded yet) and at the last unit.
        assert off["in_flight"] == [[1] * DEPTH] * STEPS
        assert on["in_flight"][0] == [1] * DEPTH
        for later in on["in_flight"][1:]:
            assert later == [2] * (DEPTH - 1) + [1]
        assert on["all_gather"] == off["all_gather"]  # every prefetched gather is used
        assert on["after"] == off["after"] == 0  # all freed after each step
        for a, b in zip(on["weights"], off["weights"], strict=True):
            assert torch.equal(a, b)


class Reordering(nn.Module):
    """Runs its layers in another order every other step, so the recorded order mispredicts."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = [0, 1, 2, 3] if self.step % 2 == 0 else [3, 1, 0, 2]
        for index in order:
            x = torch.tanh(self.layers[index](x))
        return x


def _reordering(rank: int, overlap: bool) -> dict:
    torch.manual_seed(0)
    model = Reordering()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, overlap_comm=overlap), Communicator())
    left_gathered = []
    for step in range(4):
        model.step = step
        optimizer.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank))).square().sum().backward()
        optimizer.step()
        left_gathered.append(_in_flight(engine))
    with engine.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": weights, "left": left_gathered}


def _reordering_both(rank: int, world_size: int) -> dict[bool, dict]:
    return {overlap: _reordering(rank, overlap) for overlap in (True, False)}


def test_a_changing_order_costs_nothing_but_a_wrong_guess() -> None:
    for per_rank in run_on_ranks(_reordering_both, 2):
        assert per_rank[True]["left"] == per_rank[False]["left"] == [0, 0, 0, 0]
        for a, b in zip(per_rank[True]["weights"], per_rank[False]["weights"], strict=True):
            assert torch.equal(a, b)


def _frozen_backward(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).requires_grad_(False)
    engine = ZeroEngine(model, [], EngineOptions(stage=3), Communicator())
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()  # gradients for the input only: the units are gathered, nothing is reduced
    # No gradient hook ran (nothing is trainable), so the end of backward is the caller's to announce, as after
    # every backward; it frees the units. (A torch.autograd.grad pass reaches units too and must not free them.)
    engine.finish_backward()
    return [_in_flight(engine), float(x.grad.abs().sum() > 0)]


def test_backward_through_frozen_units_only() -> None:
    assert run_on_ranks(_frozen_backward, 2) == [[0, 1.0], [0, 1.0]]


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``record``: it runs after the unit it feeds was freed, before the unit that
    made its input is reached."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, record: Callable[[], None]) -> torch.Tensor:
        ctx.record = record
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.record()
        return grad, None


def _announced(rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(DEPTH)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, overlap_comm=True), Communicator())
    memory = engine.model.scheduler.memory
    unit_bytes = max(b.data.numel() * b.data.element_size() for u in engine.model.units for b in u.buffers)
    seen: dict[str, list[int]] = {"backward": [], "kept": [], "kept_at_loss": [], "kept_after": []}

    def record() -> None:
        seen["backward"].append(_in_flight(engine))
        seen["kept"].append(memory.nbytes)

    for layer in model:  # after the engine's pre-hook: the probe's output is what the layer sees
        layer.register_forward_pre_hook(lambda module, args: (_Probe.apply(args[0], record),))
        layer.register_forward_hook(lambda module, args, out: seen["kept"].append(memory.nbytes))
    for step in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step + rank))
        loss = model(x).square().sum()
        seen["kept_at_loss"].append(memory.nbytes)
        engine.scale_loss(loss).backward()
        engine.finish_backward()
        optimizer.step()
        seen["kept_after"].append(memory.nbytes)
    return {**seen, "unit_bytes": unit_bytes, "after": _in_flight(engine)}


def test_announced_backward_prefetches_every_unit_and_reuses_freed_memory_only_between_gathers(
    runs: list[dict[Any, dict]],
) -> None:
    for result in (per_rank["announced"] for per_rank in runs):
        # Each probe runs after its layer was freed (the first layer's input needs no gradient: no probe runs):
        # the layer before it is already gathered or on its way. (Once it was every other one: a prefetched unit
        # had no entry left to prefetch the next from.)
        assert result["backward"] == [1] * (DEPTH - 1) * STEPS, result["backward"]
        # The memory of a freed unit waits for the next gather, never more than one unit's, and never at the
        # end of a forward or after a step; from the second step on (an order recorded) it is used.
        assert max(result["kept"]) == result["unit_bytes"], result["kept"]
        assert result["kept_at_loss"] == result["kept_after"] == [0] * STEPS
        assert result["after"] == 0


def _recomputed(rank: int, checkpointing: bool | str) -> dict:
    """Blocks whose Linear is a unit of its own; with ``checkpointing`` each block recomputes its forward (and so
    gathers its unit again) inside backward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(DEPTH)])
    if checkpointing == "reentrant":  # the block's forward runs without gradients, then again inside backward
        for block in model:
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True)
    elif checkpointing:
        apply_activation_checkpointing(model, {nn.Sequential})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(stage=3, wrap_policy={nn.Linear})
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    seen: list[int] = []
    for block in model:  # outside the checkpoint: the probe's backward runs once the block's backward is over
        block.register_forward_pre_hook(
            lambda module, args: (_Probe.apply(args[0], lambda: seen.append(_in_flight(engine))),)
        )
    for step in range(STEPS):
        optimizer.zero_grad()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step + rank))
        x.requires_grad_(checkpointing == "reentrant")  # else a reentrant checkpoint's output needs no gradient
        engine.scale_loss(model(x).square().sum()).backward()
        engine.finish_backward()
        optimizer.step()
    with engine.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {"backward": seen, "weights": weights, "after": _in_flight(engine)}


def test_a_recomputed_unit_is_freed_when_its_backward_ends(runs: list[dict[Any, dict]]) -> None:
    """Activation checkpointing gathers a unit again inside backward, with gradients enabled: that must not hold
    it to the end of backward as a graph being created would (it once did: every recomputed unit stayed gathered,
    the whole model by the first layer's backward)."""
    for per_rank in runs:
        plain, recomputed = per_rank["recomputed=False"], per_rank["recomputed=True"]
        assert len(recomputed["backward"]) == (DEPTH - 1) * STEPS
        assert recomputed["backward"] == plain["backward"], (recomputed["backward"], plain["backward"])
        assert max(recomputed["backward"]) <= 1
        assert recomputed["after"] == plain["after"] == 0
        for a, b in zip(recomputed["weights"], plain["weights"], strict=True):
            assert torch.equal(a, b)


def test_reentrant_checkpointing_around_units_trains_as_without_it(runs: list[dict[Any, dict]]) -> None:
    """A reentrant checkpoint runs its block's forward without gradients, then again inside backward, followed by
    a backward of its own: its units record plan entries in forward, are gathered again by the recompute and freed
    when their gradients are in (it raised, naming ``use_reentrant=False``). See [Note: reentrant activation
    checkpointing at stage 3]."""
    for per_rank in runs:
        plain, reentrant = per_rank["recomputed=False"], per_rank["recomputed=reentrant"]
        # a probe per block now (the input needs a gradient): never more than the unit computing and the next
        assert len(reentrant["backward"]) == DEPTH * STEPS
        assert max(reentrant["backward"]) <= 1, reentrant["backward"]
        assert reentrant["after"] == 0
        for a, b in zip(reentrant["weights"], plain["weights"], strict=True):
            assert torch.equal(a, b)


class LowRankAdapted(nn.Module):
    """A frozen base layer plus a trainable adapter (LoRA's shape): each a unit of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(64, 64).requires_grad_(False)
        self.adapter = nn.Sequential(nn.Linear(64, 4, bias=False), nn.Linear(4, 64, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + self.adapter(x))


class HostSavedBase(LowRankAdapted):
    """Its base layer's forward under ``save_on_cpu``, the adapter's not: a checkpoint around it recomputes both."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.save_on_cpu(pin_memory=False):
            base = self.base(x)
        return torch.tanh(base + self.adapter(x))


def _frozen_base(rank: int, checkpointing: bool | str) -> dict:
    """A frozen embedding, then blocks whose frozen base layer takes an input that needs no gradient (the first
    block's): its outputs need none either, so backward never reaches it, but a checkpoint recomputes it.
    ``"save_on_cpu"``: the forward under ``torch.autograd.graph.save_on_cpu`` instead (saved-tensor hooks that never
    recompute)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 64).requires_grad_(False), *[LowRankAdapted() for _ in range(3)])
    initial = model.state_dict()
    saving = functools.partial(torch.autograd.graph.save_on_cpu, pin_memory=False)
    if checkpointing == "save_on_cpu":
        model.forward = functools.partial(_under, saving, model.forward)
    elif checkpointing == "save_on_cpu_inside":  # checkpointed blocks whose base layer saves on the host
        model = nn.Sequential(model[0], *[HostSavedBase() for _ in range(3)])
        model.load_state_dict(initial)
        apply_activation_checkpointing(model, {HostSavedBase})
    elif checkpointing == "reentrant":  # as Hugging Face and PEFT do it: the embedding's output needs a gradient
        model[0].register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        for block in model[1:]:
            block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=True)
    elif checkpointing:
        apply_activation_checkpointing(model, {LowRankAdapted})
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={nn.Linear}), Communicator())
    left, gathered = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step + rank))
        engine.scale_loss(model(tokens).square().mean()).backward()
        engine.finish_backward()
        optimizer.step()
        left.append(_in_flight(engine))
        gathered.append(engine.last_step_comm.by_op["all_gather"])
    with engine.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {"weights": weights, "left": left, "all_gather": gathered}


def _under(context: Any, forward: Any, *args: Any) -> Any:
    with context():
        return forward(*args)


def test_a_frozen_unit_inside_a_checkpoint_is_gathered_for_its_recompute(runs: list[dict[Any, dict]]) -> None:
    """The recompute of a checkpointed block needs its frozen base layer gathered, though backward never reaches
    it: a plan entry recorded for it in forward (it raised "no forward since the last backward left an entry"), also
    where the block uses ``save_on_cpu`` inside (its hooks then top the checkpoint's), and with reentrant checkpoints
    as Hugging Face's PEFT fine-tunes run them."""
    for per_rank in runs:
        plain = per_rank["frozen_base=False"]
        for recomputed in (per_rank[f"frozen_base={on}"] for on in (True, "save_on_cpu_inside", "reentrant")):
            assert recomputed["left"] == plain["left"] == [0] * STEPS
            for a, b in zip(recomputed["weights"], plain["weights"], strict=True):
                assert torch.equal(a, b)


def test_saved_tensor_hooks_that_never_recompute_cost_no_gather(runs: list[dict[Any, dict]]) -> None:
    """Under ``save_on_cpu`` (saved-tensor hooks, but no recompute) a frozen unit whose outputs need no gradient
    records no plan entry: the same gathers as without it (it once cost one more at the end of each backward)."""
    for per_rank in runs:
        plain, saving = per_rank["frozen_base=False"], per_rank["frozen_base=save_on_cpu"]
        assert saving["all_gather"] == plain["all_gather"], (saving["all_gather"], plain["all_gather"])
        assert saving["left"] == [0] * STEPS
        for a, b in zip(saving["weights"], plain["weights"], strict=True):
            assert torch.equal(a, b)

"""memory_report().step_peak on 2 gloo ranks, stages 1 to 3 in fp32 and bf16-mixed, one spawn for every case.

The step's peak by kind is checked two ways. Against an independent probe: the test wraps the methods that gather
and free units, fill, launch and finish buckets and make and drop step gradients, and after each call counts the
transient bytes from the tensors themselves (units' storage and the memory kept for the next gather,
``bucket.nbytes`` less the persistent gradient, ``step.step_grad_nbytes``); the ledger's per-kind snapshot at its
peak must equal the probe's to the byte (both ways: a missed or a double count fails). Against the formulas: the
peak lies between the model states and the model states plus the root unit and three blocks gathered at once (in
backward: the block whose backward just ended, freed when its inputs' gradients are complete, i.e. as the next
block's backward begins; that block; and the one prefetched after it), every bucket's staging buffer and
reduce-scatter output in ``reduce_dtype``, and the fp32 step gradients of the masters (4 bytes an owned element).
Activations are not counted on the CPU (the allocator's peak is CUDA's), so the bound has no term for them.

With bf16 gradients summed in fp32 the reduce-scatter writes into the staging buffer (see [Note:
the result in the staging buffer]): the same steps with a separate result buffer give the same masters bit for bit
and hold more in buckets at their most.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.units import GatherUnit
from lightning_zero.core.step.buckets import GradBucket, part_of
from lightning_zero.core.step.full_bucket import FullGradBucket
from lightning_zero.core.step.optimizer_step import OptimizerStep
from lightning_zero.core.step.shard_bucket import ShardGradBucket
from lightning_zero.core.step.step_grads import StepGrads
from tests.helpers import run_on_ranks

WORLD_SIZE = 2
WIDTH = 24
DEPTH = 4
STEPS = 2
CASES = [(stage, precision, free) for stage in (1, 2, 3) for precision in ("32-true", "bf16-mixed") for free in (0, 1)]
KINDS = ("gathered", "buckets", "temporaries")
SEPARATE_RESULT = [(stage, "bf16-mixed", 0) for stage in (1, 2, 3)]  # measured again with a separate result buffer


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.linear(hidden))


class Net(nn.Module):
    """Stage 3: four Block units and the root (``inp`` and ``out``); uneven sizes, so buffers are padded."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(11, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.out(hidden)


class Probe:
    """The transient bytes counted from the tensors after each wrapped call; the snapshot at their highest sum."""

    def __init__(self, engine: ZeroEngine) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.peak, self.peak_sum = dict.fromkeys(KINDS, 0), 0
        self.most_in_buckets = 0  # the buckets' highest bytes, whether or not the peak of the sum

    def __call__(self) -> None:
        model = self.engine.model
        gathered = sum(b.data.untyped_storage().nbytes() for unit in model.units for b in unit.buffers)
        kept = getattr(model.scheduler, "memory", None)  # stage 3: a freed unit's memory kept for the next gather
        gathered += kept.nbytes if kept is not None else 0
        buckets = sum(bucket.nbytes - _persistent(bucket) for bucket in model.buckets)
        temporaries = sum(step.step_grad_nbytes for step in model.steps)
        now = {"gathered": gathered, "buckets": buckets, "temporaries": temporaries}
        self.most_in_buckets = max(self.most_in_buckets, buckets)
        if sum(now.values()) > self.peak_sum:
            self.peak, self.peak_sum = now, sum(now.values())


def _persistent(bucket: GradBucket) -> int:
    kept = bucket.full_grad if isinstance(bucket, FullGradBucket) else bucket._shard_grad  # type: ignore[attr-defined]
    return 0 if kept is None else kept.numel() * kept.element_size()


def _wrap(cls: type, name: str, probe: list[Probe]) -> None:
    method = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if probe:
            probe[0]()
        return result

    setattr(cls, name, wrapped)


def _unit_bytes(unit: GatherUnit) -> int:
    return sum(b.layout.padded_numel * b.data.element_size() for b in unit.buffers)


def _bounds(engine: ZeroEngine, stage: int, mixed: bool) -> dict[str, int]:
    """The formulas' bound of each transient kind (see the module docstring)."""
    model = engine.model
    reduce_size = 4  # fp32 gradients, or bf16 ones reduced in fp32
    buckets = 0
    for bucket in model.buckets:
        layout = bucket.buffer.layout
        if stage > 1 or mixed:  # stage 1 in fp32 reduces in place in its full gradient buffer
            buckets += reduce_size * (layout.padded_numel + layout.padded_numel // WORLD_SIZE)
    gathered = 0
    if stage == 3:
        blocks = [_unit_bytes(unit) for unit in model.units if not unit.is_root]
        gathered = _unit_bytes(model.scheduler.root) + 3 * max(blocks)  # type: ignore[attr-defined]
    temporaries = 4 * sum(group.buffer.shard_numel for group in model.trained) if mixed else 0
    return {"gathered": gathered, "buckets": buckets, "temporaries": temporaries}


def _measure(rank: int, stage: int, precision: str, free: int, probe: list[Probe]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixed = precision == "bf16-mixed"
    policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if mixed else None
    # a bucket per Linear or two
    options = EngineOptions(stage=stage, bucket_cap_mb=0.002, free_gradients_after_step=bool(free))
    engine = ZeroEngine(model, [optimizer], options, Communicator(), precision=policy)
    probe[:] = [Probe(engine)]
    in_staging: list[bool] = []  # per launch of the last backward: the result is a part of the staging buffer
    for bucket in engine.model.buckets:
        _record_launches(bucket, in_staging)
    for step in range(STEPS):
        engine.begin_iteration()
        probe[0].reset()
        probe[0]()
        inputs = torch.randn(6, 11, generator=torch.Generator().manual_seed(10 * rank + step))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            loss = model(inputs).float().square().mean()
        in_staging.clear()
        engine.scale_loss(loss).backward()
        engine.finish_backward()
        engine.step_of(optimizer).prepare()
        during_step = dict(engine.model.ledger.current)
        held = engine.memory_report().gradients - engine.step_of(optimizer).step_grad_nbytes
        optimizer.step()
        optimizer.zero_grad()
    report = engine.memory_report()
    out = {
        "peak": report.step_peak,
        "as_dict": report.as_dict(),
        "total": report.total,
        "held_gradients": held,  # before the last step; emptied by the free or the zero_grad after it
        "probe": dict(probe[0].peak),
        "most_in_buckets": probe[0].most_in_buckets,
        "during_step": during_step,
        "bounds": _bounds(engine, stage, mixed),
        "root": _unit_bytes(engine.model.scheduler.root) if stage == 3 else 0,  # type: ignore[attr-defined]
        "block": max((_unit_bytes(u) for u in engine.model.units if not u.is_root), default=0),
        "masters": list(engine.full_state_dict(keep=True).values()),  # fp32 where masters are kept
        "results_in_staging": in_staging,
        "bucket_parts": [bucket.buffer.shard_numel for bucket in engine.model.buckets],
    }
    with engine.gathered():  # the whole model, for an export between steps: not the step's
        pass
    out["peak_after_gathered"] = engine.memory_report().step_peak
    probe.clear()
    engine.release()
    return out


def _record_launches(bucket: GradBucket, in_staging: list[bool]) -> None:
    launch = bucket.launch

    def recorded() -> None:
        launch()
        staging = bucket.staging if isinstance(bucket, ShardGradBucket) else bucket._staging  # type: ignore[attr-defined]
        in_staging.append(part_of(bucket._output, staging))  # type: ignore[attr-defined]

    bucket.launch = recorded  # type: ignore[method-assign]


def _all(rank: int, world_size: int) -> dict[tuple[int, str, int], dict[str, Any]]:
    probe: list[Probe] = []
    wrapped = ((GatherUnit, ("start_unshard", "reshard")), (OptimizerStep, ("prepare",)), (StepGrads, ("release",)))
    for cls, names in wrapped:
        for name in names:
            _wrap(cls, name, probe)
    for name in ("add_grad", "launch", "wait", "finish", "reset"):
        _wrap(GradBucket, name, probe)
    results: dict[Any, dict[str, Any]] = {case: _measure(rank, *case, probe) for case in CASES}
    GradBucket._rounded_in_at_wait = ShardGradBucket._rounded_in_at_wait = lambda self: False  # type: ignore[method-assign]
    for case in SEPARATE_RESULT:
        results[("separate", *case)] = _measure(rank, *case, probe)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[tuple[int, str, int], dict[str, Any]]]:
    return run_on_ranks(_all, WORLD_SIZE)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" + ("-free" if f else "") for s, p, f in CASES])
def test_step_peak_by_kind_equals_the_probe_and_lies_within_the_formulas(
    ranks: list[dict[tuple[int, str, int], dict[str, Any]]], case: tuple[int, str, int]
) -> None:
    stage, precision, _ = case
    for rank, results in enumerate(ranks):
        got = results[case]
        peak = got["peak"]
        transient = {kind: getattr(peak, kind) for kind in KINDS}
        assert transient == got["probe"], f"rank {rank}: ledger {transient} != probe {got['probe']}"
        # Nothing transient is held after the step; the gradients emptied after it count as they were held.
        assert got["total"] + got["held_gradients"] == peak.model_states, f"rank {rank}: {peak}"
        assert got["held_gradients"] > 0
        assert peak.activations is None  # the CPU has no allocator peak
        assert peak.allocated is None
        bounds = got["bounds"]
        assert all(transient[kind] <= bounds[kind] for kind in KINDS), f"rank {rank}: {transient} > {bounds}"
        states = got["total"] + got["held_gradients"]
        assert states <= peak.total <= states + sum(bounds.values()), f"rank {rank}: {peak}"
        # Stage 1 in fp32 reduces in place in its full gradient: the only case with nothing transient. (Stage 1 in
        # bf16 peaks at its step: one staging buffer in backward is smaller than the fp32 step gradients.)
        assert (sum(transient.values()) > 0) != (stage == 1 and precision == "32-true"), f"rank {rank}: {peak}"
        if stage == 3:  # the root and at least one block at once
            assert transient["gathered"] >= got["root"] + got["block"], f"rank {rank}: {peak}"
        else:
            assert transient["gathered"] == 0
        # Between prepare() and the step only the step gradients are held: fp32 copies for the masters, 4 bytes an
        # owned element (fp32 steps on the held gradients themselves).
        assert got["during_step"] == {"gathered": 0, "buckets": 0, "temporaries": bounds["temporaries"]}, rank
        assert (bounds["temporaries"] > 0) == (precision == "bf16-mixed")
        flat = got["as_dict"]
        assert flat["peak"] == peak.total
        assert {k: flat[f"peak_{k}"] for k in (*KINDS, "model_states")} == {
            **transient,
            "model_states": peak.model_states,
        }


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" + ("-free" if f else "") for s, p, f in CASES])
def test_a_gathered_block_after_the_step_leaves_its_peak(
    ranks: list[dict[tuple[int, str, int], dict[str, Any]]], case: tuple[int, str, int]
) -> None:
    """``gathered_params()`` after a step holds the whole model at stage 3, which is not the step's peak (it once
    became it: 133120 bytes gathered, the whole model, against the step's 33280, in a user's trial)."""
    for rank, results in enumerate(ranks):
        assert results[case]["peak_after_gathered"] == results[case]["peak"], f"rank {rank}"


@pytest.mark.parametrize("case", [c for c in CASES if c[2]], ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_freeing_gradients_after_the_step_reports_the_same_peak(
    ranks: list[dict[tuple[int, str, int], dict[str, Any]]], case: tuple[int, str, int]
) -> None:
    """The gradients ``free_gradients_after_step`` empties were held through the backward and the step: the
    reported peak is the one of the same steps without the option."""
    for rank, results in enumerate(ranks):
        assert results[case]["peak"] == results[(*case[:2], 0)]["peak"], f"rank {rank}"


@pytest.mark.parametrize("case", SEPARATE_RESULT, ids=lambda c: f"stage{c[0]}")
def test_fp32_sums_of_bf16_gradients_land_in_the_staging_buffer(
    ranks: list[dict[Any, dict[str, Any]]], case: tuple[int, str, int]
) -> None:
    for rank, results in enumerate(ranks):
        into_staging, separate = results[case], results[("separate", *case)]
        assert into_staging["results_in_staging"], rank  # the last backward launched buckets
        assert all(into_staging["results_in_staging"]), rank
        assert not any(separate["results_in_staging"]), rank
        for got, expected in zip(into_staging["masters"], separate["masters"], strict=True):
            assert torch.equal(got, expected), f"rank {rank}"
        # the separate result costs at least the smallest bucket's part: 4 bytes an element of the rank's shard
        smallest_part = 4 * min(into_staging["bucket_parts"])
        assert into_staging["most_in_buckets"] + smallest_part <= separate["most_in_buckets"], f"rank {rank}"

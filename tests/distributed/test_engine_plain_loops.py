"""ZeroEngine in plain training loops: ``module.zero_grad()``, a gradient penalty through
``torch.autograd.grad``, and backward passes in another order than their forwards at stage 3.

Every case runs in one spawn of 2 gloo ranks at stages 1-3 and returns plain values; a case that raises on every
rank alike returns its error message, so the tests can assert on it.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.distributed.parity import relative_difference
from tests.helpers import run_on_ranks

STAGES = (1, 2, 3)
STEPS = 3
RTOL = 1e-5  # fp32 against DDP or a reordered reference; the parity tests measure their spread at 1e-7 - 4e-7


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, stage: int, free: bool = False) -> ZeroEngine:
    policy = {nn.Linear} if stage == 3 else None  # every Linear a gather unit: several units per backward
    options = EngineOptions(stage=stage, bucket_cap_mb=0.0005, wrap_policy=policy, free_gradients_after_step=free)
    return ZeroEngine(model, [optimizer], options, Communicator())


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# ---------------------------------------------------------------------------------------------- module.zero_grad
def _zero_grad_through_module(model: nn.Module, run: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Per step: a backward whose gradients ``model.zero_grad()`` then discards, a second backward, the step. A
    zero_grad that missed the held gradients would step on the sum of both."""
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_fn(run, *batch(100 * step + rank)).backward()
        model.zero_grad()  # what Lightning calls before each validation loop
        loss_fn(run, *batch(100 * step + 10 + rank)).backward()
        optimizer.step()


def _module_zero_grad_case(rank: int, stage: int) -> float:
    torch.manual_seed(0)
    initial = TinyLM()
    reference = copy.deepcopy(initial)
    _zero_grad_through_module(reference, DistributedDataParallel(reference), _sgd(reference), rank)
    model = copy.deepcopy(initial)
    optimizer = _sgd(model)
    engine = _engine(model, optimizer, stage)
    _zero_grad_through_module(model, model, optimizer, rank)
    with engine.gathered():
        return relative_difference(reference, model)


def _no_sync_then_zero_grad_case(rank: int, stage: int) -> float:
    """A micro-batch accumulated under ``no_sync``, then ``zero_grad``, then the reducing backward: the step sees
    only the last one's gradients (stage 1 keeps local sums between them, which zero_grad must drop too)."""
    torch.manual_seed(0)
    initial = TinyLM()
    runs = []
    for use_ddp in (True, False):
        model = copy.deepcopy(initial)
        optimizer = _sgd(model)
        wrapped = DistributedDataParallel(model) if use_ddp else _engine(model, optimizer, stage)
        for step in range(STEPS):
            with wrapped.no_sync():
                loss_fn(model if not use_ddp else wrapped, *batch(100 * step + rank)).backward()
            optimizer.zero_grad()
            loss_fn(model if not use_ddp else wrapped, *batch(100 * step + 10 + rank)).backward()
            optimizer.step()
        runs.append((model, wrapped))
    (reference, _), (model, engine) = runs
    with engine.gathered():
        return relative_difference(reference, model)


def _steps_without_zero_grad_case(rank: int, stage: int) -> dict[str, Any]:
    """Backward, step, backward, step, ... and never ``zero_grad``: torch's gradients add up across the steps (DDP,
    and the engine by default); with ``free_gradients_after_step`` each step empties them, as DDP with a
    ``zero_grad`` before each backward. Also the gradients the engine holds right after each step."""
    torch.manual_seed(0)
    initial = TinyLM()
    out: dict[str, Any] = {}
    for free in (False, True):
        reference = copy.deepcopy(initial)
        ddp, reference_optimizer = DistributedDataParallel(reference), _sgd(reference)
        model = copy.deepcopy(initial)
        optimizer = _sgd(model)
        engine = _engine(model, optimizer, stage, free=free)
        held = []
        for step in range(STEPS):
            if free:
                reference_optimizer.zero_grad()
            loss_fn(ddp, *batch(100 * step + rank)).backward()
            reference_optimizer.step()
            loss_fn(model, *batch(100 * step + rank)).backward()
            optimizer.step()
            held.append((len(engine.step_of(optimizer).gradients()), engine.memory_report().gradients))
        with engine.gathered():
            out[f"free={free}"] = (relative_difference(reference, model), held)
        engine.release()
    return out


class _SharedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.shared, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.shared(torch.tanh(self.a(x)))))


def _two_optimizers_sharing(model: _SharedLayer) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    first = torch.optim.SGD([*model.a.parameters(), model.shared.weight], lr=0.1)
    return first, torch.optim.SGD([*model.b.parameters(), *model.shared.parameters()], lr=0.1)


def _shared_parameter_case(rank: int, stage: int, free: bool, prepared_first: bool) -> float:
    """A parameter in two optimizers, one backward, both step (DDP steps it twice); ``prepared_first``: both steps
    are prepared (clipped) before the first one steps. The first step must not empty what the second steps on."""
    torch.manual_seed(1 + rank)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    reference = _SharedLayer()
    ddp, reference_optimizers = DistributedDataParallel(reference), _two_optimizers_sharing(reference)
    model = _SharedLayer()
    first, second = _two_optimizers_sharing(model)
    options = EngineOptions(stage=stage, free_gradients_after_step=free)
    engine = ZeroEngine(model, [first, second], options, Communicator())
    for _ in range(2):
        for optimizer in (*reference_optimizers, first, second):
            optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        for optimizer in reference_optimizers:
            optimizer.step()
        nn.functional.mse_loss(model(x), y).backward()
        if prepared_first:
            engine.step_of(first).clip_grad_norm_(1e9)
            engine.step_of(second).clip_grad_norm_(1e9)
        first.step()
        second.step()
    with engine.gathered():
        difference = relative_difference(reference, model)
    engine.release()
    return difference


def _gathered_state_dict_case(rank: int) -> dict[str, Any]:
    """Stage 3: a state_dict taken inside gathered() holds copies that outlive the block (it is usually saved after
    it); outside the block, metadata of a parameter works and its values raise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    engine = _engine(model, _sgd(model), 3)
    with engine.gathered():
        state = model.state_dict()
        expected = {k: v.clone() for k, v in state.items()}
    weight = model[0].weight
    out = {"kept": all(torch.equal(state[k], expected[k]) for k in expected)}  # read after the block
    out["metadata"] = [
        tuple(torch.zeros_like(weight).shape),
        tuple(torch.empty_like(weight).shape),
        tuple(weight.new_zeros(3).shape),
        torch.numel(weight),
        torch.is_floating_point(weight),
        weight.type(),
        weight.is_pinned(),
        tuple(weight.to("meta").shape),
    ]
    errors = []
    for read in (lambda: weight.sum(), lambda: weight.to(torch.float64), lambda: weight.type(torch.float64)):
        try:
            read()
            errors.append("no error")
        except RuntimeError as error:
            errors.append(str(error))
    out["errors"] = errors
    return out


# ---------------------------------------------------------------------------------------------- gradient penalty
class Critic(nn.Module):
    """A WGAN-GP critic: the loss adds ``(|d out / d x| - 1)^2``, computed with ``torch.autograd.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def loss(self, x: Tensor, penalty_first: bool = False) -> Tensor:
        """``penalty_first``: the penalty's torch.autograd.grad runs before the forward of the loss itself (as
        WGAN-GP code often orders it): a backward through units that no ``scale_loss`` announced."""
        interpolated = x.flip(0).clone().requires_grad_(True)
        if penalty_first:
            penalty = self._penalty(interpolated)
            return self.layers(x).mean() + penalty
        out = self.layers(x).mean()
        return out + self._penalty(interpolated)

    def _penalty(self, x: Tensor) -> Tensor:
        (grad,) = torch.autograd.grad(self.layers(x).sum(), x, create_graph=True)  # reaches every unit
        return ((grad.norm(dim=1) - 1) ** 2).mean()


def _critic_batch(step: int, rank: int) -> Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def _penalty_case(rank: int, world_size: int, stage: int, penalty_first: bool) -> float:
    torch.manual_seed(0)
    initial = Critic()
    reference = copy.deepcopy(initial)  # one process, every rank's loss, averaged: the gradient DDP would reduce
    optimizer = _sgd(reference)
    for step in range(STEPS):
        optimizer.zero_grad()
        for other in reversed(range(world_size)):
            (reference.loss(_critic_batch(step, other), penalty_first) / world_size).backward()
        optimizer.step()
    model = copy.deepcopy(initial)
    optimizer = _sgd(model)
    engine = _engine(model, optimizer, stage)
    for step in range(STEPS):
        engine.begin_iteration()
        optimizer.zero_grad()
        engine.scale_loss(model.loss(_critic_batch(step, rank), penalty_first)).backward()
        engine.finish_backward()
        optimizer.step()
    with engine.gathered():
        return relative_difference(reference, model)


# ---------------------------------------------------------------------------------------------- backward order
def _interleaved_case(rank: int, announced: bool) -> str:
    """Stage 3: forward A, forward B, backward A, backward B. Announced (``scale_loss``, as the Lightning glue
    does), a backward follows a plan every rank derives alike, so backward B (whose units backward A's plan
    already issued and freed) raises rather than gathering out of order; no rank hangs, and the engine is
    usable again. Unannounced, each backward gathers what its graph reaches (every rank must then reach the same
    units), and the same order works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    engine = _engine(model, _sgd(model), 3)
    out_a = model(torch.randn(4, 6)).sum()
    out_b = model(torch.randn(4, 6)).sum()
    (engine.scale_loss(out_a) if announced else out_a).backward()
    engine.finish_backward()
    try:
        (engine.scale_loss(out_b) if announced else out_b).backward()
        engine.finish_backward()
    except RuntimeError as error:
        engine.begin_iteration()
        engine.scale_loss(model(torch.randn(4, 6)).sum()).backward()
        engine.finish_backward()
        return str(error)
    return "no error"


def _retained_graph_case(rank: int, stage: int) -> float:
    """Two losses of one forward, the first backward keeping the graph (``retain_graph=True``, announced with
    ``scale_loss(loss, retain_graph=True)``): the parameters after the steps, against DDP stepping on the gradient
    of the losses' sum (the same gradients, summed in another order)."""
    torch.manual_seed(0)
    initial = TinyLM()
    reference = copy.deepcopy(initial)
    ddp, ddp_optimizer = DistributedDataParallel(reference), _sgd(reference)
    model = copy.deepcopy(initial)
    optimizer = _sgd(model)
    engine = _engine(model, optimizer, stage)

    def losses(run: nn.Module, step: int) -> tuple[Tensor, Tensor]:
        tokens, targets = batch(100 * step + rank)
        logits = run(tokens)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()), logits.square().mean()

    for step in range(STEPS):
        first, second = losses(ddp, step)
        (first + second).backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        first, second = losses(model, step)
        engine.scale_loss(first, retain_graph=True).backward(retain_graph=True)
        engine.scale_loss(second).backward()
        optimizer.step()
        optimizer.zero_grad()
    with engine.gathered():
        return relative_difference(reference, model)


def _unmatched_policy_case(rank: int) -> list[str]:
    """Stage 3 with a wrap_policy naming a class of another module (the ``__main__`` trap): the warnings raised
    while the engine is built; it then trains, the whole model one unit."""
    twin = type("Block", (nn.Module,), {"__module__": "__main__", "__qualname__": "Block"})
    torch.manual_seed(0)
    model = TinyLM(nested=True)
    optimizer = _sgd(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ZeroEngine(model, [optimizer], EngineOptions(stage=3, wrap_policy={twin}), Communicator())
    loss_fn(model, *batch(seed=rank)).backward()
    optimizer.step()
    engine.release()
    return [str(w.message) for w in caught if "wrap_policy" in str(w.message)]


def _all_cases(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stage in STAGES:
        results[f"module_zero_grad/{stage}"] = _module_zero_grad_case(rank, stage)
        results[f"penalty/{stage}"] = _penalty_case(rank, world_size, stage, penalty_first=False)
        results[f"penalty_first/{stage}"] = _penalty_case(rank, world_size, stage, penalty_first=True)
        results[f"no_sync_zero_grad/{stage}"] = _no_sync_then_zero_grad_case(rank, stage)
        results[f"no_zero_grad/{stage}"] = _steps_without_zero_grad_case(rank, stage)
        results[f"retained/{stage}"] = _retained_graph_case(rank, stage)
        for free, prepared_first in itertools.product((False, True), repeat=2):
            key = f"shared/{stage}/{free}/{prepared_first}"
            try:
                results[key] = _shared_parameter_case(rank, stage, free, prepared_first)
            except Exception as error:  # the same on every rank (no collective left half-done): the test shows it
                results[key] = f"{type(error).__name__}: {error}"
    results["gathered_state_dict"] = _gathered_state_dict_case(rank)
    results["interleaved"] = _interleaved_case(rank, announced=True)
    results["interleaved_unannounced"] = _interleaved_case(rank, announced=False)
    results["unmatched_policy"] = _unmatched_policy_case(rank)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_module_zero_grad_empties_the_held_gradients(results: list[dict[str, Any]], stage: int) -> None:
    """``model.zero_grad()`` discards the reduced gradients like ``optimizer.zero_grad()``: equal to DDP."""
    for rank, result in enumerate(results):
        assert result[f"module_zero_grad/{stage}"] <= RTOL, f"rank {rank}: {result[f'module_zero_grad/{stage}']}"


@pytest.mark.parametrize("order", ["penalty", "penalty_first"])
@pytest.mark.parametrize("stage", STAGES)
def test_gradient_penalty_through_autograd_grad(results: list[dict[str, Any]], stage: int, order: str) -> None:
    """``torch.autograd.grad(..., create_graph=True)`` reaches every stage-3 unit without ending the backward,
    before or after the loss's own forward; the parameters equal the averaged-loss reference."""
    for rank, result in enumerate(results):
        assert result[f"{order}/{stage}"] <= RTOL, f"rank {rank}: {result[f'{order}/{stage}']}"


@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_after_a_no_sync_backward_drops_it(results: list[dict[str, Any]], stage: int) -> None:
    for rank, result in enumerate(results):
        assert result[f"no_sync_zero_grad/{stage}"] <= RTOL, f"rank {rank}: {result[f'no_sync_zero_grad/{stage}']}"


@pytest.mark.parametrize("stage", STAGES)
def test_free_gradients_after_step_starts_each_backward_from_zero(results: list[dict[str, Any]], stage: int) -> None:
    """Without ``zero_grad``: by default the gradients add up across steps as DDP's do; with the option each step
    empties them (nothing held after it), as DDP with ``zero_grad`` before each backward."""
    for rank, per_rank in enumerate(results):
        cases = per_rank[f"no_zero_grad/{stage}"]
        difference, held = cases["free=False"]
        assert difference <= RTOL, f"rank {rank}: kept gradients differ from DDP's sums by {difference:.2e}"
        assert all(tensors > 0 and nbytes > 0 for tensors, nbytes in held), f"rank {rank}: {held}"
        difference, held = cases["free=True"]
        assert difference <= RTOL, f"rank {rank}: freed gradients differ from DDP with zero_grad by {difference:.2e}"
        assert held == [(0, 0)] * STEPS, f"rank {rank}: held after the step: {held}"


@pytest.mark.parametrize("prepared_first", [False, True])
@pytest.mark.parametrize("free", [False, True])
@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_in_two_optimizers_is_stepped_by_both(
    results: list[dict[str, Any]], stage: int, free: bool, prepared_first: bool
) -> None:
    """With ``free_gradients_after_step`` too: the first step leaves a shared parameter's gradient to the second
    (which DDP steps on as well), also when both were prepared before the first one stepped."""
    for rank, per_rank in enumerate(results):
        difference = per_rank[f"shared/{stage}/{free}/{prepared_first}"]
        assert isinstance(difference, float), f"rank {rank}: {difference}"
        assert difference <= RTOL, f"rank {rank}: differs from DDP by {difference:.2e}"


def test_state_dict_taken_inside_gathered_outlives_the_block(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        value = result["gathered_state_dict"]
        assert value["kept"], f"rank {rank}"
        assert value["metadata"] == [(6, 6), (6, 6), (3,), 36, True, "torch.FloatTensor", False, (6, 6)]
        assert all("'0.weight'" in e and "gathered_params" in e for e in value["errors"]), value["errors"]


def test_backward_of_an_earlier_forward_raises_naming_the_unit(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["interleaved_unannounced"] == "no error", f"rank {rank}: {result['interleaved_unannounced']}"
        message = result["interleaved"]
        assert "is needed by this backward pass" in message, f"rank {rank}: {message}"
        assert "forward A, forward B, backward A, backward B" in message, f"rank {rank}: {message}"


def test_a_wrap_policy_that_matches_nothing_warns_once_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert len(result["unmatched_policy"]) == 1, f"rank {rank}: {result['unmatched_policy']}"
        message = result["unmatched_policy"][0]
        assert message.startswith("wrap_policy={__main__.Block} matches no module"), f"rank {rank}: {message}"
        assert "tests.distributed.models.Block has the name of __main__.Block" in message, f"rank {rank}: {message}"
    assert results[0]["unmatched_policy"] == results[1]["unmatched_policy"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_second_backward_over_a_retained_graph(results: list[dict[str, Any]], stage: int) -> None:
    """``backward(retain_graph=True)`` then a second backward over the same forward: at stage 3 the second gathers
    the units again (the plan kept for it, see [Note: a retained graph]). Equal to DDP."""
    for rank, result in enumerate(results):
        difference = result[f"retained/{stage}"]
        assert difference <= RTOL, f"rank {rank}: {difference:.2e}"

"""Mixed precision's fp32 masters and loss scale in uncommon use (several optimizers, direct writes), core and plugin.

Every distributed case runs in one spawn of 2 gloo ranks (``run_review_cases``); each case returns plain values
(or the error it raised, as a string) and the tests below judge them. Gradients are made exact on purpose: the
models compute ``sum(w * x)`` in fp32, so ``w``'s gradient is ``x`` rounded to ``w``'s dtype, and the values are
chosen to be exact in bf16/fp16, so most expectations are exact numbers.

Written by a review that found the defects the first group of tests pins (each fixed since); the second group
checks risky behaviour that was right from the start.
"""

from __future__ import annotations

import copy
import os
import types
from collections.abc import Callable
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn

from lightning_zero.checkpoint import (
    ShardedCheckpoint,
    load_sharded_optimizers,
    load_sharded_params,
    save_sharded,
)
from lightning_zero.checkpoint.state import tensor_specs
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.step.optimizer_step import StepState
from lightning_zero.precision import ZeroPrecision
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks

WORLD_SIZE = 2
_SHARED: dict[str, str] = {}  # set on each rank: "directory", a temporary directory every rank sees
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------- helpers
class Pair(nn.Module):
    """``sum(a * xa) + sum(b * xb)`` computed in fp32: the gradients are exactly ``xa`` and ``xb`` (rounded)."""

    def __init__(self, a: list[float] | None = None, with_b: bool = True) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a or [1.0, 1.0, 1.0, 1.0]))
        self.b = nn.Parameter(torch.ones(4)) if with_b else None

    def forward(self, xa: float | Tensor, xb: float | Tensor = 0.0) -> Tensor:
        loss = (self.a.float() * xa).sum()
        if self.b is not None:
            loss = loss + (self.b.float() * xb).sum()
        return loss


def _policy(precision: str) -> PrecisionPolicy:
    dtype = DTYPES[precision]
    return PrecisionPolicy() if dtype == torch.float32 else PrecisionPolicy(dtype, torch.float32, torch.float32)


def _engine(model: nn.Module, optimizers: list[torch.optim.Optimizer], stage: int, precision: str) -> ZeroEngine:
    return ZeroEngine(model, optimizers, EngineOptions(stage=stage), Communicator(), precision=_policy(precision))


def _sgd(params: Any, lr: float = 0.5) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, foreach=False)


def _masters(engine: ZeroEngine, name: str) -> list[float]:
    """The full fp32 values of parameter ``name`` (the masters where kept), on every rank."""
    return engine.full_state_dict(keep=True)[name].float().tolist()


def _piece_grads(engine: ZeroEngine, optimizer: torch.optim.Optimizer) -> Tensor:
    """This rank's gradients as the optimizer would see them now, concatenated (fp32)."""
    grads = [grad.float().reshape(-1) for grad in engine.step_of(optimizer).gradients()]
    return torch.cat(grads) if grads else torch.zeros(0)


def _plugin(engine: ZeroEngine, **options: Any) -> ZeroPrecision:
    """A ZeroPrecision driving ``engine``; Lightning's hooks around the step (which need a Trainer) are skipped."""
    plugin = ZeroPrecision("16-mixed", **options)
    plugin.attach(engine)
    plugin._after_closure = lambda model, optimizer: None  # type: ignore[method-assign]
    return plugin


MANUAL = types.SimpleNamespace(automatic_optimization=False)  # what optimizer_step reads from the LightningModule


def _backward(plugin: ZeroPrecision, loss: Tensor) -> None:
    """``manual_backward(loss)``: the plugin scales the loss; Lightning's on_before_backward hooks (which need a
    Trainer) are skipped."""
    with mock.patch.object(Precision, "pre_backward", lambda self, tensor, module: tensor):
        plugin.pre_backward(loss, None).backward()  # type: ignore[arg-type]


def _step(plugin: ZeroPrecision, optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` in manual optimization: the closure does nothing."""
    plugin.optimizer_step(optimizer, MANUAL, lambda: None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- cases
CASES: dict[str, Callable[[int], Any]] = {}


def case(name: str) -> Callable[[Callable[[int], Any]], Callable[[int], Any]]:
    def register(fn: Callable[[int], Any]) -> Callable[[int], Any]:
        CASES[name] = fn
        return fn

    return register


def _second_reducing_backward(stage: int) -> dict[str, Any]:
    """fp16: two backward passes that both reduce (no no_sync), gradients 40000 then 32 on both ranks."""
    model = Pair(with_b=False)
    optimizer = _sgd(model.parameters())
    engine = _engine(model, [optimizer], stage, "fp16")
    model(40000.0).backward()  # averaged: 40000, finite in fp16 (max 65504)
    model(32.0).backward()  # held: 40000 + 32 = 40032, exact in fp16
    held = _piece_grads(engine, optimizer).tolist()
    finite = engine.step_of(optimizer).prepare(loss_scale=1.0)
    engine.step_of(optimizer).skip()
    return {"held": held, "finite": finite}


for _stage in (1, 2, 3):
    case(f"second_reducing_backward/stage{_stage}")(lambda rank, s=_stage: _second_reducing_backward(s))


@case("clip_without_step")
def _clip_without_step(rank: int) -> list[float]:
    """Manual optimization: clip (no step), zero_grad, backward, step. The step must use fresh unscaled grads."""
    model = Pair(with_b=False)
    optimizer = _sgd(model.parameters())
    engine = _engine(model, [optimizer], 2, "fp16")
    plugin = _plugin(engine, init_scale=1024.0)
    _backward(plugin, model(1.0))
    plugin.clip_grad_by_norm(optimizer, 1e6)  # e.g. only to log the norm; this batch does not step
    optimizer.zero_grad()
    _backward(plugin, model(2.0))
    _step(plugin, optimizer)  # expected: a = 1 - 0.5 * 2 = 0
    return _masters(engine, "a")


@case("two_optimizers_one_backward")
def _two_optimizers_one_backward(rank: int) -> dict[str, list[float]]:
    """fp16, growth_interval=1: one backward, then two optimizer steps; the scale grows after the first."""
    model = Pair()
    opt_a, opt_b = _sgd([model.a]), _sgd([model.b])
    engine = _engine(model, [opt_a, opt_b], 2, "fp16")
    plugin = _plugin(engine, init_scale=1024.0, growth_interval=1)
    _backward(plugin, model(1.0, 1.0))
    _step(plugin, opt_a)
    _step(plugin, opt_b)  # expected: both a and b = 1 - 0.5 * 1 = 0.5
    return {"a": _masters(engine, "a"), "b": _masters(engine, "b"), "scale": [plugin.scaler.scale]}


def _overflow_of_another_optimizer(stage: int) -> dict[str, Any]:
    """fp16: optimizer B's gradient overflows; optimizer A's are finite, so A's step must not be skipped."""
    model = Pair()
    opt_a, opt_b = _sgd([model.a]), _sgd([model.b])
    engine = _engine(model, [opt_a, opt_b], stage, "fp16")
    model(1.0, 1e6).backward()  # b's gradient 1e6 is inf in fp16
    finite_a = engine.step_of(opt_a).prepare(loss_scale=1.0)
    b_step_grads = [engine.step_of(opt_b).state is StepState.PREPARED]
    engine.step_of(opt_a).skip()
    return {"finite_a": finite_a, "b_step_grads": b_step_grads}


for _stage in (1, 2, 3):
    case(f"overflow_of_another_optimizer/stage{_stage}")(lambda rank, s=_stage: _overflow_of_another_optimizer(s))


def _direct_write(stage: int, precision: str) -> list[float]:
    """Clamp the parameters in place (as WGAN weight clipping does), then a step with zero gradients."""
    model = Pair([0.5, 1.5, -2.0, 3.0], with_b=False)
    optimizer = _sgd(model.parameters())
    engine = _engine(model, [optimizer], stage, precision)
    with engine.gathered(write_back=True) if stage == 3 else torch.no_grad(), torch.no_grad():
        model.a.clamp_(-1.0, 1.0)
    model(0.0).backward()
    engine.step_of(optimizer).prepare()
    optimizer.step()
    return _masters(engine, "a")  # expected: [0.5, 1.0, -1.0, 1.0]


for _stage in (1, 2, 3):
    for _precision in ("fp32", "bf16"):
        case(f"direct_write/stage{_stage}/{_precision}")(lambda rank, s=_stage, p=_precision: _direct_write(s, p))


FROZEN = [1.0001, 0.3333333, -2.7182817, 3.1415927]  # fp32 values that bf16 cannot hold


class WithFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.frozen = nn.Parameter(torch.tensor(FROZEN), requires_grad=False)

    def forward(self, x: float) -> Tensor:
        return (self.a.float() * x).sum() + (self.frozen.float() * x).sum()


def _frozen(stage: int, frozen_in_optimizer: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = WithFrozen()
    params = list(model.parameters()) if frozen_in_optimizer else [model.a]
    engine = _engine(model, [_sgd(params)], stage, "bf16")
    state = engine.full_state_dict(keep=True)
    return {"frozen": state["frozen"].float().tolist(), "frozen_dtype": str(state["frozen"].dtype)}


for _stage in (1, 2, 3):
    for _in_opt in (False, True):
        case(f"frozen/stage{_stage}/in_optimizer={_in_opt}")(lambda rank, s=_stage, i=_in_opt: _frozen(s, i))


class WithIndex(nn.Module):
    """A trainable vector and a frozen integer parameter (e.g. a lookup table kept as a Parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(4))
        self.index = nn.Parameter(torch.tensor([1, 2, 3]), requires_grad=False)

    def forward(self, x: float) -> Tensor:
        return (self.a.float() * x).sum()


def _integer(stage: int, precision: str, in_optimizer: bool) -> dict[str, str]:
    model = WithIndex()
    params = list(model.parameters()) if in_optimizer else [model.a]
    engine = _engine(model, [_sgd(params)], stage, precision)
    state = engine.full_state_dict(keep=True)
    return {"dtype": str(state["index"].dtype), "spec_dtype": tensor_specs(engine.named_state())["index"]["dtype"]}


for _stage in (1, 2, 3):
    for _precision in ("fp32", "bf16"):
        for _in_opt in (False, True):
            case(f"integer/stage{_stage}/{_precision}/in_optimizer={_in_opt}")(
                lambda rank, s=_stage, p=_precision, i=_in_opt: _integer(s, p, i)
            )


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, 0.5 + 0.5j, 2j], dtype=torch.complex64))
        self.r = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return (self.w * x).abs().sum() + self.r.float().sum()


def _complex(stage: int, precision: str) -> Any:
    model = Complex()
    optimizer = _sgd(model.parameters(), lr=0.1)
    engine = _engine(model, [optimizer], stage, precision)
    model(torch.ones(4)).backward()
    engine.step_of(optimizer).prepare()
    optimizer.step()
    return engine.full_state_dict(keep=True)["w"]


for _stage in (1, 2, 3):
    for _precision in ("fp32", "bf16"):
        case(f"complex/stage{_stage}/{_precision}")(lambda rank, s=_stage, p=_precision: _complex(s, p))


def _grad_after_clipped_step(precision: str) -> float:
    """Clip by norm 1 a gradient of norm 4, step; return the squared norm of what the pieces then hold."""
    model = Pair(with_b=False)
    optimizer = _sgd(model.parameters())
    engine = _engine(model, [optimizer], 2, precision)
    scale = 1024.0 if precision == "fp16" else None
    (model(2.0) * (scale or 1.0)).backward()  # gradient [2, 2, 2, 2]: norm 4
    engine.step_of(optimizer).prepare(scale)
    engine.step_of(optimizer).clip_grad_norm_(1.0)
    optimizer.step()
    # torch keeps the clipped gradient until zero_grad; the held one stays scaled by its backward's loss scale,
    # so that a next backward (same scale) adds to it consistently.
    return float(((_piece_grads(engine, optimizer) / (scale or 1.0)) ** 2).sum())


for _precision in DTYPES:
    case(f"grad_after_clipped_step/{_precision}")(lambda rank, p=_precision: _grad_after_clipped_step(p))


def _write_back_load(stage: int, through_engine: bool) -> list[float]:
    """Load fp32 values that bf16 cannot hold, through gathered(write_back=True) or ZeroEngine.load_state_dict."""
    model = Pair(with_b=False)
    engine = _engine(model, [_sgd(model.parameters())], stage, "bf16")
    saved = {"a": torch.tensor([1.001, 2.0003, -0.3337, 0.1234567])}  # 1.001 rounds to bf16's 1.0 (unchanged)
    if through_engine:
        engine.load_state_dict(saved)
    else:
        with engine.gathered(write_back=True):
            model.load_state_dict(saved)
    return _masters(engine, "a")


for _stage in (1, 2, 3):
    for _through in (False, True):
        case(f"write_back_load/stage{_stage}/engine={_through}")(
            lambda rank, s=_stage, t=_through: _write_back_load(s, t)
        )


def _zero_grad_mode(stage: int, set_to_none: bool) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = TinyLM(unused=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(model, [optimizer], stage, "bf16")
    for step in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = loss_fn(model, *batch(10 * step + engine.comm.rank))
        loss.backward()
        engine.step_of(optimizer).prepare()
        optimizer.step()
    return engine.full_state_dict(keep=True)


for _stage in (1, 2, 3):
    case(f"zero_grad_set_to_none_false/stage{_stage}")(
        lambda rank, s=_stage: [_zero_grad_mode(s, False), _zero_grad_mode(s, True)]
    )


def _accumulate_across_steps(stage: int, precision: str) -> list[float]:
    """No zero_grad between two steps: step 2 uses gradient 2 (step 1's) + 1 (new), as torch does."""
    model = Pair(with_b=False)
    optimizer = _sgd(model.parameters(), lr=0.25)
    engine = _engine(model, [optimizer], stage, precision)
    scale = 1024.0 if precision == "fp16" else None
    rank = engine.comm.rank
    for xs in ((1.0, 3.0), (0.5, 1.5)):  # averaged over the 2 ranks: 2, then 1
        (model(xs[rank]) * (scale or 1.0)).backward()
        assert engine.step_of(optimizer).prepare(scale)
        optimizer.step()
    return _masters(engine, "a")  # 1 - 0.25 * 2 - 0.25 * (2 + 1) = -0.25


for _stage in (1, 2, 3):
    for _precision in ("bf16", "fp16"):
        case(f"accumulate_across_steps/stage{_stage}/{_precision}")(
            lambda rank, s=_stage, p=_precision: _accumulate_across_steps(s, p)
        )


@case("skip_path_state")
def _skip_path_state(rank: int) -> dict[str, Any]:
    """fp16: an overflowing step is skipped; nothing of it may linger, and the next clean step runs normally."""
    model = Pair(with_b=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    engine = _engine(model, [optimizer], 2, "fp16")
    plugin = _plugin(engine, init_scale=1024.0)
    (model(1e6 if rank == 1 else 1.0) * plugin.scaler.scale).backward()  # inf on rank 1 only
    _step(plugin, optimizer)
    pending_comm_calls = engine.comm.stats.calls  # read before the gathers below count
    step = engine.step_of(optimizer)
    after_skip = {
        "a": _masters(engine, "a"),
        "state": step.state.name,
        "step_grads": [step.step_grad_nbytes > 0],
        "optimizer_state": len(optimizer.state),
        "scale": plugin.scaler.scale,
        "pending_comm_calls": pending_comm_calls,
    }
    optimizer.zero_grad()
    (model(1.0) * plugin.scaler.scale).backward()
    _step(plugin, optimizer)
    return {"after_skip": after_skip, "a": _masters(engine, "a"), "scale": plugin.scaler.scale}


@case("toggle_freezes_through_master_pieces")
def _toggle(rank: int) -> dict[str, Any]:
    """Lightning's toggle_optimizer sets requires_grad on the optimizer's tensors: master pieces must forward it."""
    model = Pair()
    opt_a, opt_b = _sgd([model.a]), _sgd([model.b])
    engine = _engine(model, [opt_a, opt_b], 2, "bf16")
    for piece in opt_b.param_groups[0]["params"]:
        piece.requires_grad = False
    model(1.0, 1.0).backward()
    b_grads = [bool(engine.step_of(opt_b).gradients())]
    engine.step_of(opt_a).prepare()
    opt_a.step()
    return {"b_requires_grad": model.b.requires_grad, "b_grads": b_grads, "a": _masters(engine, "a")}


def _train(engine: ZeroEngine, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            loss = loss_fn(model, *batch(10 * step + engine.comm.rank))
        loss.backward()
        engine.step_of(optimizer).prepare()
        optimizer.step()


def _largest_difference(a: dict[Any, Any], b: dict[Any, Any]) -> float:
    """Largest |a - b| over the tensors of two (nested) dicts with the same keys; inf if the keys differ."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for key, value in a.items():
        if isinstance(value, dict):
            worst = max(worst, _largest_difference(value, b[key]))
        elif isinstance(value, Tensor) and value.numel():
            worst = max(worst, float((value.float() - b[key].float()).abs().max()))
    return worst


def _checkpoint_between_stages(save_stage: int, load_stage: int) -> dict[str, float]:
    """bf16; tied, frozen (in the optimizer) and unused parameters: sharded save at one stage, load at another."""
    torch.manual_seed(0)
    initial = TinyLM(tied=True, frozen=True, unused=True)
    engines, optimizers = [], []
    for stage in (save_stage, load_stage):
        model = copy.deepcopy(initial)
        optimizers.append(torch.optim.AdamW(model.parameters(), lr=1e-2))
        engines.append(_engine(model, [optimizers[-1]], stage, "bf16"))
    _train(engines[0], engines[0].module, optimizers[0], steps=2)
    path = os.path.join(_SHARED["directory"], f"stage{save_stage}_to_stage{load_stage}")
    save_sharded(engines[0].named_state(), path, {}, "review", "bf16-mixed")
    checkpoint = ShardedCheckpoint(path)
    load_sharded_params(engines[1].named_state(), checkpoint)
    load_sharded_optimizers(engines[1].named_state(), checkpoint)
    states = [engine.full_state_dict(keep=True) for engine in engines]
    optimizer_states = [e.full_optimizer_state_dict(o)["state"] for e, o in zip(engines, optimizers, strict=True)]
    frozen = {name for name, p in initial.named_parameters() if not p.requires_grad}
    trainable = [{k: v for k, v in state.items() if k not in frozen} for state in states]
    return {
        "params": _largest_difference(*trainable),
        "frozen": _largest_difference(*[{k: state[k] for k in frozen} for state in states]),
        "optimizer": _largest_difference(*optimizer_states),
        "state_entries": float(len(optimizer_states[1])),
    }


for _save, _load in ((1, 3), (3, 1), (2, 3)):
    case(f"checkpoint/stage{_save}_to_stage{_load}")(lambda rank, a=_save, b=_load: _checkpoint_between_stages(a, b))


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 16)
        self.b = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit_then_validate(stage: int) -> dict[str, Any]:
    """fit, then validate on the same Trainer, then what a full checkpoint would hold (rank 0's dict)."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy
    from tests.lightning.models import make_trainer

    generator = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(16, 7, generator=generator), torch.randn(16, 3, generator=generator)))
    strategy = ZeroStrategy(stage=stage, state_dict_type="full")
    trainer = make_trainer(WORLD_SIZE, strategy, precision="bf16-mixed", max_steps=2, limit_val_batches=1)
    model = Regression()
    trainer.fit(model, loader)
    after_fit = strategy._engine.full_state_dict(keep=True)
    trainer.validate(model, loader, verbose=False)
    after_validate = strategy.lightning_module_state_dict()  # the state_dict trainer.save_checkpoint writes
    try:
        trainer.save_checkpoint(os.path.join(_SHARED["directory"], f"fit_then_validate_stage{stage}.ckpt"))
        saved = "saved"
    except Exception as error:
        saved = f"{type(error).__name__}: {error}"
    return {"masters_kept": _largest_difference(after_fit, after_validate) if after_validate else None, "saved": saved}


for _stage in (2, 3):
    case(f"fit_then_validate/stage{_stage}")(lambda rank, s=_stage: _fit_then_validate(s))


def run_review_cases(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    _SHARED["directory"] = directory
    results: dict[str, Any] = {}
    for name, fn in CASES.items():
        torch.manual_seed(0)
        try:
            results[name] = fn(rank)
        except Exception as error:  # every case raises on both ranks alike, before any unmatched collective
            results[name] = f"raised {type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_ranks(run_review_cases, WORLD_SIZE, str(tmp_path_factory.mktemp("review")))


def _value(results: list[dict[str, Any]], name: str, rank: int = 0) -> Any:
    value = results[rank][name]
    if isinstance(value, str) and value.startswith("raised"):
        pytest.fail(f"{name} on rank {rank} {value}")
    return value


def _every_rank(results: list[dict[str, Any]], name: str) -> list[Any]:
    return [_value(results, name, rank) for rank in range(WORLD_SIZE)]


# ---------------------------------------------------------------------------------------------------- bugs
def test_stage1_second_reducing_backward_does_not_overflow_fp16(results: list[dict[str, Any]]) -> None:
    """A second reducing backward adds its average to the held one: 40000 + 32 fits fp16. (Stage 1 used to turn
    the held average back into a local sum times world_size: 80000 = inf in fp16.)"""
    for value in _every_rank(results, "second_reducing_backward/stage1"):
        assert value == {"held": [40032.0, 40032.0], "finite": True}


def test_a_clip_without_a_step_leaves_no_stale_fp32_gradients(results: list[dict[str, Any]]) -> None:
    """A clip that no step follows made fp32 step gradients; the next backward drops them, so the next step
    unscales the fresh gradients (it used to update the masters with the scaled 16-bit one: 2048 instead of 2)."""
    for value in _every_rank(results, "clip_without_step"):
        assert value == [0.0] * 4


def test_every_optimizer_unscales_with_the_scale_of_its_backward(
    results: list[dict[str, Any]],
) -> None:
    """The scale grows after the first optimizer's step; the second, stepping on the same backward, still divides
    by the scale that backward used (1024), not the grown one (2048)."""
    value = _value(results, "two_optimizers_one_backward")
    assert value["a"] == [0.5] * 4, value
    assert value["b"] == [0.5] * 4, value


def test_stage3_overflow_of_another_optimizer_does_not_skip_this_one(results: list[dict[str, Any]]) -> None:
    """Stage-3 buffers are per unit, not per optimizer: prepare_step(A) unscales and checks only A's pieces, so
    B's overflow does not skip A's step and A's step holds no fp32 copies of B's gradients."""
    for value in _every_rank(results, "overflow_of_another_optimizer/stage3"):
        assert value == {"finite_a": True, "b_step_grads": [False]}


@pytest.mark.parametrize("stage", [1, 2])
def test_direct_parameter_writes_reach_the_masters(results: list[dict[str, Any]], stage: int) -> None:
    """At stages 1/2 parameters may be changed in place (no gathering needed, as in 32-true): prepare_step takes
    the changed elements into the masters, so the step does not undo the write (WGAN weight clipping)."""
    for value in _every_rank(results, f"direct_write/stage{stage}/bf16"):
        assert value == [0.5, 1.0, -1.0, 1.0]


@pytest.mark.parametrize(
    ("stage", "in_optimizer"), [(1, False), (2, False), (3, False), (1, True), (2, True)], ids=lambda v: str(v)
)
def test_frozen_parameters_keep_their_fp32_values(
    results: list[dict[str, Any]], stage: int, in_optimizer: bool
) -> None:
    """Frozen parameters have no master; the mixed modes keep them in fp32 (autocast casts them for compute), so
    checkpoints hold their fp32 values at every stage."""
    value = _value(results, f"frozen/stage{stage}/in_optimizer={in_optimizer}")
    assert value == {"frozen": torch.tensor(FROZEN).tolist(), "frozen_dtype": "torch.float32"}


@pytest.mark.parametrize("in_optimizer", [False, True], ids=["frozen_only", "in_optimizer"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage3_integer_parameter(results: list[dict[str, Any]], precision: str, in_optimizer: bool) -> None:
    """An integer Parameter at stage 3: its piece cannot require grad and it gets no master, in any precision, so
    it is held and saved as int64."""
    value = _value(results, f"integer/stage3/{precision}/in_optimizer={in_optimizer}")
    assert value == {"dtype": "torch.int64", "spec_dtype": "int64"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_complex_parameters_under_a_16bit_policy(results: list[dict[str, Any]], stage: int) -> None:
    """Complex parameters keep their dtype, no master and their own reduction dtype under a 16-bit policy, and
    train as in 32-true."""
    reference = _value(results, f"complex/stage{stage}/fp32")
    value = _value(results, f"complex/stage{stage}/bf16")
    assert torch.is_complex(value), value
    torch.testing.assert_close(value, reference)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gradient_kept_after_a_clipped_step_is_the_clipped_one(results: list[dict[str, Any]], precision: str) -> None:
    """torch (and 32-true, test_gradient_kept_after_a_clipped_step_is_clipped_in_32_true) clip .grad in place, so
    what accumulates into the next step without zero_grad is the clipped gradient; with masters the clipped fp32
    step gradient is written back into the held one (in fp16 times the loss scale)."""
    squared = sum(_every_rank(results, f"grad_after_clipped_step/{precision}"))
    assert squared == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_write_back_takes_the_16bit_values_written(results: list[dict[str, Any]], stage: int) -> None:
    """gathered_params(write_back=True) goes through the 16-bit parameters, so the masters take the 16-bit values
    written where they changed (documented; 1.001 rounds to the bf16 1.0 the parameter held, so that master stays).
    Loading fp32 values exactly is ZeroEngine.load_state_dict (test_engine_load_state_dict_restores_fp32)."""
    value = _value(results, f"write_back_load/stage{stage}/engine=False")
    loaded = torch.tensor([1.001, 2.0003, -0.3337, 0.1234567])
    assert value == [1.0, *loaded[1:].to(torch.bfloat16).float().tolist()]


def test_stage3_validate_after_fit_keeps_the_masters(results: list[dict[str, Any]]) -> None:
    """At stage 3 validate()/test() after fit() on the same Trainer keep the fit's engine: the masters, and a
    checkpoint saved afterwards has its optimizer state (a new engine without optimizer made the save raise "AdamW
    is not managed by this ZeroEngine")."""
    value = _value(results, "fit_then_validate/stage3")
    assert value == {"masters_kept": 0.0, "saved": "saved"}


def test_from_plugin_accepts_a_grad_scaler_with_init_scale_below_one() -> None:
    """A GradScaler(init_scale=0.5) is valid in torch; its translation lowers min_scale to it."""
    scaler = torch.amp.GradScaler("cpu", init_scale=0.5)
    plugin = ZeroPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler))
    assert plugin.scaler is not None
    assert plugin.scaler.scale == 0.5


# ---------------------------------------------------------------------------------------------------- fine
@pytest.mark.parametrize("stage", [2, 3])
def test_second_reducing_backward_adds_into_the_held_gradient(results: list[dict[str, Any]], stage: int) -> None:
    for value in _every_rank(results, f"second_reducing_backward/stage{stage}"):
        assert value == {"held": [40032.0, 40032.0], "finite": True}


@pytest.mark.parametrize("stage", [1, 2])
def test_overflow_of_another_optimizer_is_its_own_at_stages_1_and_2(results: list[dict[str, Any]], stage: int) -> None:
    for value in _every_rank(results, f"overflow_of_another_optimizer/stage{stage}"):
        assert value == {"finite_a": True, "b_step_grads": [False]}


@pytest.mark.parametrize(("stage", "precision"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_direct_parameter_write_survives_without_masters_or_through_write_back(
    results: list[dict[str, Any]], stage: int, precision: str
) -> None:
    for value in _every_rank(results, f"direct_write/stage{stage}/{precision}"):
        assert value == [0.5, 1.0, -1.0, 1.0]


def test_stage3_keeps_fp32_values_of_frozen_parameters_the_optimizer_lists(results: list[dict[str, Any]]) -> None:
    value = _value(results, "frozen/stage3/in_optimizer=True")
    assert value == {"frozen": torch.tensor(FROZEN).tolist(), "frozen_dtype": "torch.float32"}


@pytest.mark.parametrize("in_optimizer", [False, True], ids=["frozen_only", "in_optimizer"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_integer_parameter_at_stages_1_and_2(
    results: list[dict[str, Any]], stage: int, precision: str, in_optimizer: bool
) -> None:
    value = _value(results, f"integer/stage{stage}/{precision}/in_optimizer={in_optimizer}")
    assert value == {"dtype": "torch.int64", "spec_dtype": "int64"}


def test_gradient_kept_after_a_clipped_step_is_clipped_in_32_true(results: list[dict[str, Any]]) -> None:
    assert sum(_every_rank(results, "grad_after_clipped_step/fp32")) == pytest.approx(1.0, rel=1e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_engine_load_state_dict_restores_fp32(results: list[dict[str, Any]], stage: int) -> None:
    value = _value(results, f"write_back_load/stage{stage}/engine=True")
    assert value == torch.tensor([1.001, 2.0003, -0.3337, 0.1234567]).tolist()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_set_to_none_false_equals_set_to_none(results: list[dict[str, Any]], stage: int) -> None:
    zeroed, emptied = _value(results, f"zero_grad_set_to_none_false/stage{stage}")
    assert zeroed.keys() == emptied.keys()
    for name in zeroed:
        assert torch.equal(zeroed[name], emptied[name]), name


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_accumulate_across_steps_without_zero_grad(
    results: list[dict[str, Any]], stage: int, precision: str
) -> None:
    for value in _every_rank(results, f"accumulate_across_steps/stage{stage}/{precision}"):
        assert value == [-0.25] * 4


def test_skipped_step_leaves_nothing_behind(results: list[dict[str, Any]]) -> None:
    for value in _every_rank(results, "skip_path_state"):
        skipped = value["after_skip"]
        assert skipped["a"] == [1.0] * 4, skipped
        assert skipped["state"] == "IDLE", skipped
        assert not any(skipped["step_grads"]), skipped
        assert skipped["optimizer_state"] == 0, skipped  # Adam's step and moments untouched
        assert skipped["scale"] == 512.0, skipped
        assert skipped["pending_comm_calls"] == 0, skipped  # the step took this step's counts
        assert value["scale"] == 512.0
        assert all(v < 1.0 for v in value["a"]), value  # the next clean step ran


def test_toggle_optimizer_freezes_through_master_pieces(results: list[dict[str, Any]]) -> None:
    for value in _every_rank(results, "toggle_freezes_through_master_pieces"):
        assert value == {"b_requires_grad": False, "b_grads": [False], "a": [0.5] * 4}


@pytest.mark.parametrize("stages", ["stage1_to_stage3", "stage3_to_stage1", "stage2_to_stage3"])
def test_sharded_checkpoint_moves_masters_between_stages(results: list[dict[str, Any]], stages: str) -> None:
    """bf16 with tied, frozen and unused parameters: masters and Adam state arrive bit for bit, and frozen ones
    (kept in fp32) too."""
    for value in _every_rank(results, f"checkpoint/{stages}"):
        assert value["params"] == 0.0, value
        assert value["frozen"] == 0.0, value
        assert value["optimizer"] == 0.0, value
        assert value["state_entries"] > 0, value


def test_stage2_validate_after_fit_keeps_the_masters(results: list[dict[str, Any]]) -> None:
    value = _value(results, "fit_then_validate/stage2")
    assert value == {"masters_kept": 0.0, "saved": "saved"}


def test_bf16_true_leaves_integer_buffers_and_inputs_alone() -> None:
    module = nn.BatchNorm1d(3)
    plugin = ZeroPrecision("bf16-true")
    plugin.convert_module(module)
    assert module.weight.dtype == torch.bfloat16
    assert module.num_batches_tracked.dtype == torch.int64
    converted = plugin.convert_input({"ids": torch.arange(3), "x": torch.ones(2)})
    assert converted["ids"].dtype == torch.int64
    assert converted["x"].dtype == torch.bfloat16

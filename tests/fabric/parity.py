"""Training runs under Fabric for test_fabric_parity.py: ZeroFabricStrategy against Fabric's DDPStrategy (fp32), the
Trainer's ZeroStrategy (bf16-mixed) and itself (a model created by ``fabric.init_module()`` at stage 3), a local
run that sums the same gradients in another order (the tolerance's calibration), and the errors of wrong setups.

Every function here runs inside ``tests.helpers.run_on_ranks`` (a process group is up); :func:`run_all` is the
entry point of one spawn and returns plain numbers and strings per rank.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.utils.checkpoint
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, Strategy
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroFabricStrategy, ZeroStrategy, grad_norm
from tests.distributed.models import VOCAB, TinyLM, batch, loss_fn
from tests.distributed.parity import relative_difference
from tests.lightning.models import make_trainer

STAGES = (1, 2, 3)
STEPS = 4
ACCUMULATE = 2
CLIP = 0.05  # below every step's gradient norm (about 0.3-1.0): every step clips
TINY_BUCKET_MB = 0.0005  # several buckets per stage, so ordering and partial buckets are exercised
INIT_SEED = 1234
# The model of the peak-memory check: 8 x (1024 x 1024 + 1024) fp32 = 33.6 MB, 8 gather units of 4.2 MB.
WIDE, DEEP = 1024, 8
WIDE_UNIT_BYTES = (WIDE * WIDE + WIDE) * 4
WIDE_BYTES = DEEP * WIDE_UNIT_BYTES
# ``kind`` of a run: one AdamW over every parameter, or AdamW and SGD with momentum over disjoint parts.
KINDS = ("one", "two")


# ------------------------------------------------------------------------------------------------ the maths
def make_optimizers(model: nn.Module, kind: str) -> list[Optimizer]:
    if kind == "one":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)]
    first = [*model.emb.parameters(), *model.a.parameters(), *model.b.parameters()]
    second = [*model.c.parameters(), *model.head.parameters()]
    return [torch.optim.AdamW(first, lr=1e-2, weight_decay=0.05), torch.optim.SGD(second, lr=0.1, momentum=0.9)]


def micro_batch(step: int, micro: int, rank: int) -> tuple[Tensor, Tensor]:
    return batch(seed=1000 * step + 10 * micro + rank)


def fabric_loop(
    fabric: Fabric, model: nn.Module, optimizers: list[Any], rank: int, held: list[list[int]] | None = None
) -> list[float]:
    """STEPS optimizer steps of ACCUMULATE micro-batches, each optimizer clipped by norm; returns the norms. ``held``
    gets, after each ``optimizer.step()``, how many gradients each of the engine's optimizer steps holds."""
    norms = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            tokens, targets = micro_batch(step, micro, rank)
            with fabric.no_backward_sync(model, enabled=micro < ACCUMULATE - 1):
                fabric.backward(loss_fn(model, tokens, targets) / ACCUMULATE)
        for optimizer in optimizers:
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
        for optimizer in optimizers:
            optimizer.step()
            if held is not None:
                held.append([len(step.gradients()) for step in fabric.strategy.session.engine.model.steps])
            optimizer.zero_grad()
    return norms


def train_reordered(model: nn.Module, kind: str, world_size: int) -> nn.Module:
    """The same steps in one process: every rank's loss sample by sample in reverse, so gradients sum in another
    order (what DDP itself may legitimately differ by)."""
    optimizers = make_optimizers(model, kind)
    for step in range(STEPS):
        for rank in reversed(range(world_size)):
            for micro in reversed(range(ACCUMULATE)):
                tokens, targets = micro_batch(step, micro, rank)
                for i in reversed(range(len(tokens))):
                    loss = loss_fn(model, tokens[i : i + 1], targets[i : i + 1])
                    (loss / (len(tokens) * ACCUMULATE * world_size)).backward()
        for optimizer in optimizers:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model


# ------------------------------------------------------------------------------------------------ Fabric runs
def zero_strategy(stage: int, free_gradients_after_step: bool = False) -> ZeroFabricStrategy:
    return ZeroFabricStrategy(
        stage=stage,
        bucket_cap_mb=TINY_BUCKET_MB,
        wrap_policy={nn.Linear} if stage == 3 else None,
        free_gradients_after_step=free_gradients_after_step,
    )


def launched(world_size: int, strategy: Strategy | str, precision: str = "32-true") -> Fabric:
    """A Fabric joined to the spawn's process group (several can be made one after another)."""
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def set_up(fabric: Fabric, model: nn.Module, kind: str, separate: bool) -> tuple[Any, list[Any]]:
    """``fabric.setup(model, *optimizers)``, or ``setup_module`` then ``setup_optimizers(*optimizers)``."""
    if separate:
        wrapped = fabric.setup_module(model)
        optimizers = fabric.setup_optimizers(*make_optimizers(model, kind))
        return wrapped, list(optimizers) if isinstance(optimizers, tuple) else [optimizers]
    wrapped, *optimizers = fabric.setup(model, *make_optimizers(model, kind))
    return wrapped, optimizers


def trained(fabric: Fabric, initial: nn.Module, kind: str, separate: bool, rank: int) -> tuple[nn.Module, list[float]]:
    model = copy.deepcopy(initial)
    wrapped, optimizers = set_up(fabric, model, kind, separate)
    return model, fabric_loop(fabric, wrapped, optimizers, rank)


def full_params(fabric: Fabric, model: nn.Module) -> dict[str, Tensor]:
    """The module's parameters in full (gathered at stage 3), cloned."""
    strategy = fabric.strategy
    context = strategy.gathered_params() if isinstance(strategy, ZeroFabricStrategy) else torch.no_grad()
    with context:
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def relative(reference: dict[str, Tensor], other: dict[str, Tensor]) -> float:
    """Largest per-tensor max|a - b| / max|a|."""
    assert reference.keys() == other.keys(), (sorted(reference), sorted(other))
    worst = 0.0
    for name, ref in reference.items():
        scale = ref.double().abs().max().clamp_min(1e-12)
        worst = max(worst, ((ref.double() - other[name].double()).abs().max() / scale).item())
    return worst


def max_norm_difference(reference: list[float], other: list[float]) -> float:
    assert len(reference) == len(other)
    return max(abs(a - b) / abs(a) for a, b in zip(reference, other, strict=True))


def fp32_runs(rank: int, world_size: int) -> tuple[dict[str, Any], dict[int, dict[str, Tensor]]]:
    """Stages 1-3 (together and separate setups, one and two optimizers), the registry's ``"zero_2"``, DDP and the
    reordered spread: each ZeRO run's relative difference from DDP, and its clipping norms' difference. Also the
    parameters of each stage's separate two-optimizer run, for :func:`error_runs`."""
    out: dict[str, Any] = {}
    separate_two: dict[int, dict[str, Tensor]] = {}
    torch.manual_seed(0)
    initial = TinyLM()
    for kind in KINDS:
        fabric = launched(world_size, DDPStrategy())
        model, ddp_norms = trained(fabric, initial, kind, False, rank)
        reference = full_params(fabric, model)
        out[f"ddp_norms/{kind}"] = ddp_norms
        reordered = train_reordered(copy.deepcopy(initial), kind, world_size)
        out[f"spread/{kind}"] = relative_difference(model, reordered)
        for stage in STAGES:
            for separate in (False, True):
                name = f"stage{stage}/{kind}/{'separate' if separate else 'together'}"
                fabric = launched(world_size, zero_strategy(stage))
                model, norms = trained(fabric, initial, kind, separate, rank)
                params = full_params(fabric, model)
                out[name] = relative(reference, params)
                if kind == "two" and separate:
                    separate_two[stage] = params
                out[f"norms/{name}"] = max_norm_difference(ddp_norms, norms)
            if kind == "two":  # each optimizer.step() empties its own gradients, not the other optimizer's
                fabric = launched(world_size, zero_strategy(stage, free_gradients_after_step=True))
                model = copy.deepcopy(initial)
                wrapped, optimizers = set_up(fabric, model, kind, False)
                held: list[list[int]] = []
                out[f"norms/stage{stage}/two/free"] = max_norm_difference(
                    ddp_norms, fabric_loop(fabric, wrapped, optimizers, rank, held)
                )
                out[f"stage{stage}/two/free"] = relative(reference, full_params(fabric, model))
                out[f"held/stage{stage}"] = held
        if kind == "one":
            by_class = launched(world_size, ZeroFabricStrategy(stage=2))
            model, _ = trained(by_class, initial, kind, False, rank)
            class_params = full_params(by_class, model)
            by_name = launched(world_size, "zero_2")
            out["registry/strategy"] = f"{type(by_name.strategy).__name__} stage {by_name.strategy.config.engine.stage}"
            model, _ = trained(by_name, initial, kind, False, rank)
            out["registry/vs_class"] = relative(class_params, full_params(by_name, model))
            out["registry/vs_ddp"] = relative(reference, class_params)
    return out, separate_two


# ------------------------------------------------------------------------------------------------ bf16-mixed
class LitTinyLM(pl.LightningModule):
    """The Trainer's side of the bf16 comparison: TinyLM with ``make_optimizers(.., "one")``'s optimizer."""

    def __init__(self, initial: nn.Module) -> None:
        super().__init__()
        self.net = copy.deepcopy(initial)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        return loss_fn(self.net, tokens, targets)

    def configure_optimizers(self) -> Optimizer:
        return make_optimizers(self.net, "one")[0]


def rank_loader(rank: int) -> DataLoader:
    """This rank's micro-batches of :func:`fabric_loop`, in order (the Trainer runs without a distributed sampler)."""
    batches = [micro_batch(step, micro, rank) for step in range(STEPS) for micro in range(ACCUMULATE)]
    tokens, targets = (torch.cat(parts) for parts in zip(*batches, strict=True))
    return DataLoader(TensorDataset(tokens, targets), batch_size=len(batches[0][0]), shuffle=False)


def masters(engine: Any, prefix: str = "") -> dict[str, Tensor]:
    """The engine's full fp32 master weights (collective), names without ``prefix``."""
    return {name.removeprefix(prefix): t.clone() for name, t in engine.full_state_dict(keep=True).items()}


def bf16_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Per stage: Fabric (bf16-mixed) and the Trainer (bf16-mixed) doing the same maths, their masters' difference,
    and how far each is from the fp32 result (bf16 must show)."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    initial = TinyLM()
    fp32 = launched(world_size, zero_strategy(2))
    model, _ = trained(fp32, initial, "one", False, rank)
    fp32_params = full_params(fp32, model)
    for stage in STAGES:
        fabric = launched(world_size, zero_strategy(stage), precision="bf16-mixed")
        model, _ = trained(fabric, initial, "one", False, rank)
        by_fabric = masters(fabric.strategy.session.engine)
        lit = LitTinyLM(initial)
        strategy = ZeroStrategy(
            stage=stage, bucket_cap_mb=TINY_BUCKET_MB, wrap_policy={nn.Linear} if stage == 3 else None
        )
        trainer = make_trainer(
            world_size,
            strategy,
            precision="bf16-mixed",
            max_steps=STEPS,
            accumulate_grad_batches=ACCUMULATE,
            gradient_clip_val=CLIP,
            gradient_clip_algorithm="norm",
            use_distributed_sampler=False,
        )
        trainer.fit(lit, rank_loader(rank))
        by_trainer = masters(strategy.session.engine, prefix="net.")
        out[f"bf16/stage{stage}/steps"] = trainer.global_step
        out[f"bf16/stage{stage}/vs_trainer"] = relative(by_trainer, by_fabric)
        out[f"bf16/stage{stage}/vs_fp32"] = relative(fp32_params, by_fabric)
        out[f"bf16/stage{stage}/param_dtype"] = str(model.a.weight.dtype)
    return out


# ------------------------------------------------------------------------------------------------ init_module
def reset_as_the_engine_does(model: TinyLM) -> None:
    """Stage 3 with ``wrap_policy={nn.Linear}`` initialises a meta model unit by unit, the root (the embedding)
    last, each module by its ``reset_parameters()``: the same calls in the same order on a normal model."""
    torch.manual_seed(INIT_SEED)
    for module in (model.a, model.b, model.c, model.head, model.emb):
        module.reset_parameters()


def init_module_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 3: a TinyLM created under ``fabric.init_module()`` against one created normally and initialised the
    same way, both set up (setup_module, setup_optimizers) and trained alike."""
    out: dict[str, Any] = {}
    fabric = launched(world_size, zero_strategy(3))
    with fabric.init_module():
        lazy = TinyLM()
    out["init/meta_before_setup"] = [p.is_meta for p in lazy.parameters()]
    torch.manual_seed(INIT_SEED)
    wrapped = fabric.setup_module(lazy)
    out["init/report_params"] = fabric.strategy.memory_report().params
    out["init/resting_bytes"] = sum(p.untyped_storage().nbytes() for p in lazy.parameters())
    optimizers = fabric.setup_optimizers(*make_optimizers(lazy, "two"))
    lazy_initial = full_params(fabric, lazy)
    fabric_loop(fabric, wrapped, list(optimizers), rank)
    lazy_trained = full_params(fabric, lazy)

    torch.manual_seed(0)
    eager = TinyLM()
    reset_as_the_engine_does(eager)
    fabric = launched(world_size, zero_strategy(3))
    wrapped = fabric.setup_module(eager)
    optimizers = fabric.setup_optimizers(*make_optimizers(eager, "two"))
    out["init/initial_vs_normal"] = relative(full_params(fabric, eager), lazy_initial)
    fabric_loop(fabric, wrapped, list(optimizers), rank)
    out["init/trained_vs_normal"] = relative(full_params(fabric, eager), lazy_trained)
    out["init/moved"] = relative(lazy_initial, lazy_trained)  # the comparison is not of untrained models
    fabric = launched(world_size, zero_strategy(3))
    with fabric.init_module():
        tied = TinyLM(tied=True)  # head.weight = emb.weight: the embedding's values on a real device
    fabric.setup_module(tied)
    out["init/tied_std"] = float(full_params(fabric, tied)["emb.weight"].std())
    out["init/peak_lazy"] = _peak_growth(world_size, lazy=True)
    out["init/peak_eager"] = _peak_growth(world_size, lazy=False)
    return out


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _peak_growth(world_size: int, lazy: bool) -> int:
    """Peak RSS growth while a WIDE x DEEP MLP is created (under ``init_module()`` or normally) and set up at stage 3
    (needs ``MALLOC_MMAP_THRESHOLD_`` low, so that freed buffers leave RSS: see tests/lightning/test_stage3_init)."""
    fabric = launched(world_size, ZeroFabricStrategy(stage=3, wrap_policy={nn.Linear}))
    gc.collect()
    before = _resident_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    with fabric.init_module() if lazy else torch.device("cpu"):
        model = nn.Sequential(*[nn.Linear(WIDE, WIDE) for _ in range(DEEP)])
    fabric.setup_module(model)
    return _peak_resident_bytes() - before


# ------------------------------------------------------------------------------------------------ errors
def _error_of(call: Any) -> str:
    try:
        call()
    except Exception as error:  # the test asserts the type and the message
        return f"{type(error).__name__}: {error}"
    return "no error"


def _recovered(fabric: Fabric, wrapped: Any, model: nn.Module, rank: int, expected: dict[str, Tensor]) -> Any:
    """The right optimizers set up after a refused one and trained: the difference from ``expected``, or the error
    (every rank raises alike: each check before the first collective is local)."""
    try:
        optimizers = fabric.setup_optimizers(*make_optimizers(model, "two"))
        fabric_loop(fabric, wrapped, list(optimizers), rank)
    except Exception as error:  # reported to the test
        return f"{type(error).__name__}: {error}"
    return relative(expected, full_params(fabric, model))


def error_runs(rank: int, world_size: int, separate_two: dict[int, dict[str, Tensor]]) -> dict[str, Any]:
    """The message (``Type: text``) each wrong setup raises on this rank; after an optimizer over a foreign model
    was refused, the right ones set up and trained: their difference from ``separate_two`` (the same run without
    the refused optimizer)."""
    out: dict[str, Any] = {}
    fabric = launched(world_size, zero_strategy(2))
    first = TinyLM()
    fabric.setup(first, *make_optimizers(first, "one"))
    second = TinyLM()
    out["error/second_model"] = _error_of(lambda: fabric.setup(second, *make_optimizers(second, "one")))
    out["error/second_module"] = _error_of(lambda: fabric.setup_module(TinyLM()))

    fabric = launched(world_size, zero_strategy(2))
    model = TinyLM()
    out["error/optimizer_first"] = _error_of(lambda: fabric.setup_optimizers(*make_optimizers(model, "one")))

    torch.manual_seed(0)
    initial = TinyLM()
    for stage in STAGES:
        fabric = launched(world_size, zero_strategy(stage))
        model = copy.deepcopy(initial)
        wrapped = fabric.setup_module(model)
        stranger = TinyLM()
        out[f"error/foreign_optimizer/stage{stage}"] = _error_of(
            lambda: fabric.setup_optimizers(*make_optimizers(stranger, "one"))  # noqa: B023 - called at once
        )
        out[f"recovered/stage{stage}"] = _recovered(fabric, wrapped, model, rank, separate_two[stage])
    fabric = launched(world_size, zero_strategy(2))
    model, stranger = TinyLM(), TinyLM()
    out["error/foreign_optimizer/together"] = _error_of(lambda: fabric.setup(model, *make_optimizers(stranger, "one")))
    # Refused before anything was sharded: the same model set up again with the right optimizer works.
    out["retried_setup"] = _error_of(lambda: fabric.setup(model, *make_optimizers(model, "one")))
    return out


def retained_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Two losses of one forward, ``fabric.backward(l1, retain_graph=True)`` then ``fabric.backward(l2)``, under
    Fabric's DDP and stages 1-3: parameters relative to DDP's. DDP reduces a second backward of one forward only
    when its reducer is armed again before it, as Lightning's DDPStrategy does for ``manual_backward``; Fabric's
    does not, so the reference does it here."""
    from lightning.pytorch.overrides.distributed import prepare_for_backward

    initial, params = TinyLM(), {}
    for stage in ("ddp", *STAGES):
        fabric = launched(world_size, DDPStrategy() if stage == "ddp" else zero_strategy(stage))
        model = copy.deepcopy(initial)
        wrapped, optimizers = set_up(fabric, model, "one", False)

        def backward(
            loss: Tensor, stage: Any = stage, wrapped: Any = wrapped, fabric: Fabric = fabric, **kwargs: Any
        ) -> None:
            if stage == "ddp":
                prepare_for_backward(wrapped._forward_module, loss)
            fabric.backward(loss, **kwargs)

        for step in range(STEPS):
            tokens, targets = micro_batch(step, 0, rank)
            logits = wrapped(tokens)
            backward(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), retain_graph=True)
            backward(logits.square().mean())
            optimizers[0].step()
            optimizers[0].zero_grad()
        params[stage] = full_params(fabric, model)
    return {f"retained/stage{stage}": relative(params["ddp"], params[stage]) for stage in STAGES}


def small_mlp(outputs: int) -> nn.Module:
    """8 inputs, two hidden layers of 16, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, outputs))


def against_ddp(
    world_size: int, initial: nn.Module, name: str, train: Callable[[Fabric, Any, Optimizer, Any], None]
) -> dict[str, float]:
    """``train(fabric, wrapped, optimizer, stage)`` of a copy of ``initial`` with one AdamW under Fabric's DDP and
    stages 1-3: each stage's parameters relative to DDP's, as ``{name}/stage{n}``."""
    params = {}
    for stage in ("ddp", *STAGES):
        fabric = launched(world_size, DDPStrategy() if stage == "ddp" else zero_strategy(stage))
        model = copy.deepcopy(initial)
        wrapped, optimizers = set_up(fabric, model, "one", False)
        train(fabric, wrapped, optimizers[0], stage)
        params[stage] = full_params(fabric, model)
    return {f"{name}/stage{stage}": relative(params["ddp"], params[stage]) for stage in STAGES}


def penalty_runs(rank: int, world_size: int) -> dict[str, Any]:
    """A gradient penalty: ``torch.autograd.grad(loss, x, create_graph=True)`` inside the strategy's
    ``allow_autograd_grad()`` (Fabric refuses it otherwise), then ``fabric.backward(loss + penalty)``, under Fabric's
    DDP and stages 1-3: parameters relative to DDP's."""

    def train(fabric: Fabric, wrapped: Any, optimizer: Optimizer, stage: Any) -> None:
        allowed = nullcontext if stage == "ddp" else fabric.strategy.allow_autograd_grad
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank)).requires_grad_()
            loss = wrapped(x).square().mean()
            with allowed():
                (gradient,) = torch.autograd.grad(loss, x, create_graph=True)
            fabric.backward(loss + 0.1 * gradient.square().sum(1).mean())
            optimizer.step()
            optimizer.zero_grad()

    return against_ddp(world_size, small_mlp(outputs=1), "penalty", train)


def grad_norm_runs(rank: int, world_size: int) -> dict[str, Any]:
    """``lightning_zero.grad_norm`` right after ``fabric.backward``, under Fabric's DDP and stages 1-3: with one
    optimizer (no argument) and with two (each named; the error when none is): each stage's largest relative
    difference from DDP's norms, key by key (infinite where the keys differ)."""
    torch.manual_seed(0)
    initial = TinyLM()
    norms: dict[Any, dict[str, float]] = {}
    out: dict[str, Any] = {}
    for stage in ("ddp", *STAGES):
        seen: dict[str, float] = {}
        for kind in KINDS:
            fabric = launched(world_size, DDPStrategy() if stage == "ddp" else zero_strategy(stage))
            wrapped, optimizers = set_up(fabric, copy.deepcopy(initial), kind, False)
            for step in range(2):
                tokens, targets = micro_batch(step, 0, rank)
                fabric.backward(loss_fn(wrapped, tokens, targets))
                if kind == "two" and stage != "ddp" and step == 0:
                    out[f"grad_norm_error/stage{stage}"] = _error_of(functools.partial(grad_norm, wrapped, 2))
                by_optimizer = [None] if kind == "one" else optimizers
                for index, optimizer in enumerate(by_optimizer):
                    for key, value in grad_norm(wrapped, 2, optimizer=optimizer).items():
                        seen[f"{kind}/{step}/{index}/{key}"] = float(value)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
        norms[stage] = seen
    out["grad_norm/keys"] = sorted(norms["ddp"])
    for stage in STAGES:
        if norms[stage].keys() != norms["ddp"].keys():
            out[f"grad_norm/stage{stage}"] = float("inf")
            continue
        out[f"grad_norm/stage{stage}"] = max(
            abs(norms[stage][key] - value) / max(abs(value), 1e-12) for key, value in norms["ddp"].items()
        )
    return out


def two_forward_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Two calls of the model before one ``fabric.backward`` (a siamese or contrastive loss), after a forward and one
    that raised (a wrong input, caught) before the first step, under Fabric's DDP and stages 1-3: parameters relative to
    DDP's."""

    def train(fabric: Fabric, wrapped: Any, optimizer: Optimizer, stage: Any) -> None:
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(step + 10 * rank)
            first, second = torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)
            if step == 0:  # a forward, then one that raises (its first unit gathered): the user starts again
                wrapped(first)
                with contextlib.suppress(RuntimeError):
                    wrapped(torch.randn(4, 5))
            fabric.backward((wrapped(first) - wrapped(second)).square().mean())
            optimizer.step()
            optimizer.zero_grad()

    return against_ddp(world_size, small_mlp(outputs=4), "two_forwards", train)


def evaluation_runs(rank: int, world_size: int) -> dict[str, Any]:
    """A BatchNorm model evaluated (``eval()``, ``torch.no_grad()``) after each step: Fabric's DDP broadcasts rank 0's
    buffers in that forward, so every rank evaluates with rank 0's statistics; stages 1-3 likewise (they once kept
    each rank's own). Then a ``copy.deepcopy`` of the module (an EMA's copy; it once failed at every stage: "cannot
    pickle PrefixStore", the strategy's hooks) evaluates the same. Each stage's largest relative difference of the
    outputs from DDP's."""
    outputs = {}
    for stage in ("ddp", *STAGES):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
        fabric = launched(world_size, DDPStrategy() if stage == "ddp" else zero_strategy(stage))
        wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        outputs[stage] = []
        for step in range(STEPS):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step + 10 * rank))
            fabric.backward(wrapped(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            wrapped.eval()
            with torch.no_grad():
                outputs[stage].append(wrapped(torch.ones(2, 4)))
            wrapped.train()
        with nullcontext() if stage == "ddp" else fabric.strategy.gathered_params():
            copied = copy.deepcopy(model).eval()  # an EMA's copy: a plain module, no hook of the strategy's
        with torch.no_grad():
            outputs[stage].append(copied(torch.ones(2, 4)))
    reference = torch.stack(outputs["ddp"])
    scale = reference.abs().max()
    return {
        f"evaluation/stage{stage}": ((torch.stack(outputs[stage]) - reference).abs().max() / scale).item()
        for stage in STAGES
    }


class ReentrantBlocks(nn.Module):
    """Three blocks called inside ``torch.utils.checkpoint(..., use_reentrant=True)`` where ``reentrant`` (at stage
    3 each block is a unit, its hooks inside the checkpoint), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.reentrant = False

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block.__call__, x, use_reentrant=True) if self.reentrant else block(x)
        return self.head(x)


def reentrant_runs(rank: int, world_size: int) -> dict[str, Any]:
    """Reentrant checkpoints of the user's own under stages 1-3 against Fabric's DDP without them (the same maths)."""

    def train(fabric: Fabric, wrapped: Any, optimizer: Optimizer, stage: Any) -> None:
        wrapped.module.reentrant = stage != "ddp"
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step + 10 * rank)).requires_grad_()
            fabric.backward(wrapped(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    return against_ddp(world_size, ReentrantBlocks(), "reentrant", train)


def run_all(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn: every run of this module."""
    results, separate_two = fp32_runs(rank, world_size)
    results.update(retained_runs(rank, world_size))
    results.update(penalty_runs(rank, world_size))
    results.update(grad_norm_runs(rank, world_size))
    results.update(two_forward_runs(rank, world_size))
    results.update(evaluation_runs(rank, world_size))
    results.update(reentrant_runs(rank, world_size))
    results.update(bf16_runs(rank, world_size))
    results.update(init_module_runs(rank, world_size))
    results.update(error_runs(rank, world_size, separate_two))
    return results

"""LightningModules, callbacks, a same-maths fp16 reference and a case runner for the spawns of ``training_cases.py``.

Everything is module-level so that the processes ``tests.helpers.run_on_ranks`` spawns can import it. Models seed
themselves in ``__init__``, so every rank and every strategy starts from the same weights.

test_feature_matrix.py and test_failing_rank.py run cases of their own with the same runner.

A *case* is a plain dict (one spawn runs a whole list of them, see :func:`run_cases`):

- ``strategy``: ``"ddp"`` (``DDPStrategy(find_unused_parameters=True)``), a ZeRO stage (1, 2, 3), or
  ``"reference"`` (no ``Trainer``: :func:`train_norm_reference`, with ``reference`` its keyword arguments);
- ``model`` / ``model_kwargs``: a key of :data:`MODELS` and its arguments;
- ``callbacks``: ``[(key of CALLBACKS, kwargs), ...]``; ``save_at``: ``(global_step, path)``; ``ckpt_path``;
- ``trainer``: extra ``Trainer`` arguments; ``strategy_kwargs``: extra ``ZeroStrategy`` arguments;
- ``precision``: ``"32-true"`` (default), ``"bf16-mixed"`` or ``"16-mixed"`` (Lightning's ``MixedPrecision``
  plugin with a ``GradScaler`` of ``init_scale``, which ``ZeroStrategy`` translates);
- ``samples``: the dataset size.

Every case runs in a process group of its own with a short collective timeout (:data:`TIMEOUT`), so a case
that hangs in a collective fails after the timeout instead of stalling the spawn, and the cases after it
start from a clean group. :func:`run_isolated` starts a new spawn after a case that kills the processes (a
segfault), so that case alone fails.
"""

from __future__ import annotations

import copy
import math
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.lightning.models import BATCH_SIZE, SaveAt, make_trainer, state_of

# A rank of a healthy run waits for its peers for well under a second between collectives (a whole case of
# these tiny models takes 0.1-0.3 s). 30 s ends a hang quickly enough that a spawn whose every hang-prone
# case hangs (five per world size on the code before the fixes) still finishes inside run_on_ranks' 240 s.
TIMEOUT = timedelta(seconds=30)
_RENDEZVOUS_TIMEOUT = timedelta(seconds=200)  # the case groups' store: ranks arrive up to one TIMEOUT apart
INJECTED = "injected failure"  # the message of every exception the models raise on purpose
ACCUMULATE = 2


# ------------------------------------------------------------------------------------------------- data
def regression_loader(samples: int, features: int = 7, outputs: int = 3, batch_size: int = BATCH_SIZE) -> DataLoader:
    """The same fixed data on every rank; Lightning's DistributedSampler splits it (shuffled, seed 0: alike in every
    run)."""
    gen = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(samples, features, generator=gen), torch.randn(samples, outputs, generator=gen))
    return DataLoader(dataset, batch_size=batch_size)


NORM_FEATURES = 8
NORM_BATCH = 8


def norm_dataset(samples: int) -> TensorDataset:
    """A learnable regression for :class:`NormNet`: y = 2 * x0 - x1 (a scalar target)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(samples, NORM_FEATURES, generator=gen)
    return TensorDataset(x, 2 * x[:, :1] - x[:, 1:2])


def norm_loader(samples: int) -> DataLoader:
    return DataLoader(norm_dataset(samples), batch_size=NORM_BATCH)


# ------------------------------------------------------------------------------------------------- 1. unfreezing
class Finetunable(pl.LightningModule):
    """``backbone`` (Linear(7, 12) -> tanh -> Linear(12, 16)) -> tanh -> ``head`` (Linear(16, 3)), 355 elements.

    The callbacks below freeze the backbone and unfreeze it later. By default the optimizer holds only the head:
    what ``filter(lambda p: p.requires_grad, self.parameters())`` gives under ``BaseFinetuning``, written
    explicitly so that a run freezing the backbone only after ``configure_optimizers`` gets the same groups.

    Args:
        optimize_backbone: the optimizer holds every parameter, the frozen backbone included.
    """

    LR = 1e-2

    def __init__(self, optimize_backbone: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(7, 12), nn.Tanh(), nn.Linear(12, 16))
        self.head = nn.Linear(16, 3)
        self.optimize_backbone = optimize_backbone

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.backbone(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters() if self.optimize_backbone else self.head.parameters()
        return torch.optim.AdamW(params, lr=self.LR, weight_decay=0.01)


FINETUNE_DENOM = 4.0  # BaseFinetuning's initial_denom_lr: the backbone group trains at lr / 4


class FinetuneBackbone(BaseFinetuning):
    """Lightning's ``BaseFinetuning``: the backbone is frozen in ``setup`` (before ``configure_optimizers`` and
    before the strategy wraps the model) and joins the optimizer as a new param group at epoch ``unfreeze_at``.

    A run resumed after that epoch gets the param group back from the checkpoint (ZeroStrategy adds it back: on
    resume ``BaseFinetuning`` rebuilds its groups only in ``on_fit_start``, before the checkpoint is read) but, as
    ``BaseFinetuning`` freezes in ``setup`` again, not ``requires_grad``. A checkpoint written at the end of an
    epoch resumes inside that epoch, so ``on_train_epoch_start`` (``finetune_function``) does not run before the
    next batch: the backbone is made trainable again when a batch of a later epoch starts. This is the user's part
    with any strategy, DDP included.
    """

    def __init__(self, unfreeze_at: int = 1) -> None:
        super().__init__()
        self.unfreeze_at = unfreeze_at

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == self.unfreeze_at:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial_denom_lr=FINETUNE_DENOM)
        elif epoch > self.unfreeze_at:
            self.make_trainable(pl_module.backbone)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.current_epoch > self.unfreeze_at:
            self.make_trainable(pl_module.backbone)


class Unfreeze(pl.Callback):
    """Freezes the backbone in ``freeze_in`` and unfreezes it at the start of epoch ``unfreeze_at``.

    ``freeze_in="setup"`` freezes before the strategy sets the model up (as ``BaseFinetuning`` does);
    ``"on_fit_start"`` only after it (so DDP has registered the backbone and reduces its gradients once it trains
    again: the oracle of "DDP given the same updates").

    Args:
        how: ``"finetuning"``: ``BaseFinetuning.unfreeze_and_add_param_group`` with :data:`FINETUNE_DENOM` (the
            oracle of :class:`FinetuneBackbone`); ``"add_param_group"``: ``requires_grad_(True)`` and a direct
            ``optimizer.add_param_group`` with its own lr and no weight decay; ``"requires_grad"``: only
            ``requires_grad_(True)`` (for a model whose optimizer already holds the backbone).
    """

    ADDED_GROUP: ClassVar[dict[str, float]] = {"lr": Finetunable.LR / 2, "weight_decay": 0.0}

    def __init__(self, freeze_in: str, unfreeze_at: int, how: str) -> None:
        self.freeze_in = freeze_in
        self.unfreeze_at = unfreeze_at
        self.how = how

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.freeze_in == "setup":
            pl_module.backbone.requires_grad_(False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.freeze_in == "on_fit_start":
            pl_module.backbone.requires_grad_(False)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != self.unfreeze_at:
            return
        optimizer = trainer.optimizers[0]
        if self.how == "finetuning":
            BaseFinetuning.unfreeze_and_add_param_group(pl_module.backbone, optimizer, initial_denom_lr=FINETUNE_DENOM)
            return
        pl_module.backbone.requires_grad_(True)
        if self.how == "add_param_group":
            optimizer.add_param_group({"params": list(pl_module.backbone.parameters()), **self.ADDED_GROUP})


# ------------------------------------------------------------------------------------------------- 2. exceptions
class FlakyLinear(nn.Linear):
    """A Linear whose forward raises once after :meth:`arm` (a stage-3 unit under ``wrap_policy={nn.Linear}``)."""

    armed = False

    def arm(self) -> None:
        self.armed = True

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            self.armed = False
            raise RuntimeError(f"{INJECTED} in forward")
        return super().forward(x)


class Flaky(pl.LightningModule):
    """Four layers (Linear 7-16-16-16-3, tanh between) trained by manual optimization, with one failure on purpose.

    In step ``fail_at`` the failure ``fail`` happens once on every rank and the step recovers:

    - ``"backward"``: a hook on the first activation raises; by then the gradients of ``l4``, ``l3`` and ``l2``
      have arrived (so with tiny buckets and ``overlap_comm`` their reductions were launched), those of ``l1`` not.
      The step calls ``opt.zero_grad()`` and runs forward and backward again for the same batch;
    - ``"forward"``: ``l3``'s forward raises (``l1`` and ``l2`` ran); forward and backward run again;
    - ``"step"``: a step pre-hook of the optimizer raises before any update; ``opt.step()`` is called again.

    ``record["failures"]`` lists the steps that caught a failure; ``record["arrived"]`` the parameters whose
    gradient had arrived when the backward failure raised.
    """

    def __init__(self, fail: str | None = None, fail_at: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.l1 = nn.Linear(7, 16)
        self.l2 = nn.Linear(16, 16)
        self.l3 = FlakyLinear(16, 16)
        self.l4 = nn.Linear(16, 3)
        self.fail = fail
        self.fail_at = fail_at
        self.record: dict[str, list[Any]] = {"failures": [], "arrived": []}
        self._armed: str | None = None
        self._arrived: list[str] = []

    def on_train_start(self) -> None:
        # After the strategy's own gradient hooks, so these see every arrival (not the gradient itself).
        for name, param in self.named_parameters():
            param.register_post_accumulate_grad_hook(lambda _, name=name: self._arrived.append(name))
        self.optimizers().optimizer.register_step_pre_hook(self._step_pre_hook)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.l1(x))
        if self._armed == "backward":
            hidden.register_hook(self._backward_hook)
        if self._armed == "forward":
            self._armed = None
            self.l3.arm()
        return self.l4(torch.tanh(self.l3(torch.tanh(self.l2(hidden)))))

    def _backward_hook(self, grad: Tensor) -> Tensor:
        if self._armed == "backward":
            self._armed = None
            self.record["arrived"] = sorted(self._arrived)
            raise RuntimeError(f"{INJECTED} in backward")
        return grad

    def _step_pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._armed == "step":
            self._armed = None
            raise RuntimeError(f"{INJECTED} in optimizer.step")

    def _forward_backward(self, batch: tuple[Tensor, Tensor]) -> None:
        x, y = batch
        self._arrived = []
        self.manual_backward(nn.functional.mse_loss(self(x), y))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        self._armed = self.fail if batch_idx == self.fail_at else None
        opt.zero_grad()
        try:
            self._forward_backward(batch)
        except RuntimeError as error:
            if INJECTED not in str(error):
                raise
            self.record["failures"].append(batch_idx)
            opt.zero_grad()
            self._forward_backward(batch)
        try:
            opt.step()
        except RuntimeError as error:
            if INJECTED not in str(error):
                raise
            self.record["failures"].append(batch_idx)
            opt.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


# ------------------------------------------------------------------------------------------------- 3. idle rank
class IdleRank(pl.LightningModule):
    """Linear(7, 16) -> tanh -> Linear(16, 3), trained with ``accumulate_grad_batches=2``; rank 1 is idle sometimes.

    In optimizer steps ``idle_steps``, on micro-batch ``idle_micro`` (0: the first, 1: the second), rank 1 runs the
    model's forward like every rank but returns a loss that reaches no trainable parameter:
    ``0 * out.detach().requires_grad_().sum()``. With ``oracle=True`` it returns ``0 * out.sum()`` instead, which
    reaches every parameter with a zero gradient: the same reduced gradients, what DDP can be given.
    """

    def __init__(self, idle_micro: int, idle_steps: tuple[int, ...] = (1, 3), oracle: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 16)
        self.b = nn.Linear(16, 3)
        self.idle_micro = idle_micro
        self.idle_steps = idle_steps
        self.oracle = oracle

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)  # every rank runs the same units in forward (stage 3's rule); only the loss differs
        step, micro = divmod(batch_idx, ACCUMULATE)
        if self.global_rank == 1 and micro == self.idle_micro and step in self.idle_steps:
            return 0 * out.sum() if self.oracle else 0 * out.detach().requires_grad_().sum()
        return nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


# ------------------------------------------------------------------------------------------------- 4. fp16 + BatchNorm
NORM_LR = 0.1
NORM_CLIP = 0.5  # below the unscaled gradient norm of every step (3.4-5.3 measured), so clipping always acts


class NormNet(pl.LightningModule):
    """Linear(8, 16) -> BatchNorm1d(16) -> tanh -> Linear(16, 1) with SGD (momentum 0.9).

    In 16-bit runs the strategy keeps the batch-norm parameters in fp32 and trains them without a master.

    Args:
        inject: ``"norm"`` or ``"linear"``: in optimizer step ``inject_step`` (1-based) rank 1 alone sets element 0
            of the gradient of the batch norm's weight (or of the last Linear's weight) to inf, through a tensor
            hook, before the gradient is reduced.
    """

    def __init__(self, inject: str | None = None, inject_step: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(NORM_FEATURES, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        self.inject = inject
        self.inject_step = inject_step
        self._hook: Any = None

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(batch)

    def on_train_start(self) -> None:
        if self.inject is not None:
            target = self.net[1].weight if self.inject == "norm" else self.net[3].weight
            self._hook = target.register_hook(self._make_inf)

    def on_train_end(self) -> None:
        if self._hook is not None:
            self._hook.remove()

    def _make_inf(self, grad: Tensor) -> Tensor:
        if self.global_rank == 1 and self.trainer.global_step + 1 == self.inject_step:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=NORM_LR, momentum=0.9)


def trainable_names(module: nn.Module) -> list[str]:
    return [name for name, param in module.named_parameters() if param.requires_grad]


def step_gradients(trainer: pl.Trainer, optimizer: Any) -> list[Tensor]:
    """The gradients of this rank's pieces that ``optimizer``'s step will use, from the strategy's engine.

    At ``on_before_optimizer_step`` the step is prepared (ZeroPrecision prepares it before that hook, as Lightning's
    AMP plugin unscales before it): these are the gradients clipping sees, cast to fp32 and unscaled, not yet clipped.
    """
    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    return trainer.strategy._engine.step_of(inner).gradients()


class StepRecorder(pl.Callback):
    """Per optimizer step: the global 2-norm of the gradients clipping sees (:func:`step_gradients`, summed over all
    ranks; ``norms``), and the loss scaler's state after the step (``scaler``, fp16 runs). ZeroStrategy runs only.
    """

    def __init__(self) -> None:
        self.record: dict[str, list[Any]] = {"norms": [], "scaler": []}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        local = sum(
            (g.double().pow(2).sum() for g in step_gradients(trainer, optimizer)), torch.zeros((), dtype=torch.float64)
        )
        dist.all_reduce(local)
        self.record["norms"].append(local.sqrt().item())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            self.record["scaler"].append(dict(scaler.state_dict()))


def _norm_batches(rank: int, world_size: int, samples: int, steps: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's first ``steps`` batches as Lightning deals them: a training loader gets a shuffling
    DistributedSampler (seed 0), its epoch set at the start of each epoch."""
    dataset = norm_dataset(samples)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    batches: list[tuple[Tensor, Tensor]] = []
    epoch = 0
    while len(batches) < steps:
        sampler.set_epoch(epoch)
        batches.extend(DataLoader(dataset, batch_size=NORM_BATCH, sampler=sampler))
        epoch += 1
    return batches[:steps]


def _averaged(grad: Tensor, reversed_sum: bool) -> Tensor:
    """``grad`` averaged over ranks in fp32 (divided before summing); ``reversed_sum`` adds the ranks last to first."""
    averaged = grad.float() / dist.get_world_size()
    if not reversed_sum:
        dist.all_reduce(averaged)
        return averaged
    parts = [torch.empty_like(averaged) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, averaged)
    total = parts[-1].clone()
    for part in reversed(parts[:-1]):
        total += part
    return total


def _clip(grads: list[Tensor], max_norm: float, flat_norm: bool) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s maths; ``flat_norm`` sums the squares in another order (one flat
    vector, parameters last to first). Returns the norm before clipping."""
    if flat_norm:
        total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in reversed(grads)]))
    else:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient)
    return total.item()


def train_norm_reference(
    rank: int,
    world_size: int,
    steps: int,
    samples: int,
    scale: float,
    reversed_sum: bool = False,
    flat_norm: bool = False,
) -> dict[str, Any]:
    """:class:`NormNet` trained with the maths of ZeroStrategy's ``"16-mixed"``, without sharding.

    An fp16 copy of every layer except the batch norm, which stays fp32 (parameters and statistics), runs forward
    under autocast; the loss times ``scale`` goes backward. Each gradient is averaged across ranks in fp32 and
    rounded to its parameter's dtype (fp16, or fp32 for the batch norm), then divided by ``scale`` in fp32. The
    optimizer (SGD, momentum) updates fp32 masters of the fp16 parameters and the batch norm's own fp32 parameters,
    after clipping the gradients by their global norm (:data:`NORM_CLIP`); the masters are rounded into the fp16
    copy. ``reversed_sum`` and ``flat_norm`` change only the order of sums: the same maths, rounded differently.
    Returns the fp32 state (masters and batch-norm parameters) and each step's norm before clipping.
    """
    module = NormNet()
    model = copy.deepcopy(module)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.half()
    params = list(model.parameters())
    # The masters start from the fp32 values before the cast, as the strategy's do.
    masters = [
        param if param.dtype == torch.float32 else original.detach().clone().requires_grad_()
        for param, original in zip(params, module.parameters(), strict=True)
    ]
    optimizer = torch.optim.SGD(masters, lr=NORM_LR, momentum=0.9)
    batches = _norm_batches(rank, world_size, samples, steps)
    norms = []
    for step in range(steps):
        for param in params:
            param.grad = None
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = model.loss(batches[step])
        (loss * scale).backward()
        for param, master in zip(params, masters, strict=True):
            held = _averaged(param.grad, reversed_sum).to(param.dtype)  # the reduced gradient as the strategy holds it
            master.grad = held.float() / scale
        grads = [master.grad for master in masters]
        assert all(torch.isfinite(g).all() for g in grads), "the reference overflowed: lower the loss scale"
        norms.append(_clip(grads, NORM_CLIP, flat_norm))
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                if param is not master:
                    param.copy_(master)
    names = [name for name, _ in model.named_parameters()]
    return {"state": {name: m.detach().clone() for name, m in zip(names, masters, strict=True)}, "norms": norms}


# ------------------------------------------------------------------------------------------------- runner
MODELS: dict[str, type[pl.LightningModule]] = {
    "finetunable": Finetunable,
    "flaky": Flaky,
    "idle_rank": IdleRank,
    "norm": NormNet,
}
CALLBACKS: dict[str, type[pl.Callback]] = {
    "finetune": FinetuneBackbone,
    "unfreeze": Unfreeze,
    "steps": StepRecorder,
}
LOADERS = {
    "finetunable": regression_loader,
    "flaky": regression_loader,
    "idle_rank": regression_loader,
    "norm": norm_loader,
}


def make_strategy(case: dict[str, Any]) -> Strategy:
    from lightning_zero import ZeroStrategy

    if case["strategy"] == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=TIMEOUT)
    # At stage 3 every Linear is a gather unit of its own.
    policy = {"wrap_policy": {nn.Linear}} if case["strategy"] == 3 else {}
    return ZeroStrategy(stage=case["strategy"], timeout=TIMEOUT, **policy, **case.get("strategy_kwargs", {}))


def _precision_options(case: dict[str, Any]) -> dict[str, Any]:
    precision = case.get("precision", "32-true")
    if precision == "16-mixed":  # on CPU, fp16 is asked for with a plugin; ZeroStrategy translates Lightning's
        scaler = torch.amp.GradScaler("cpu", init_scale=case["init_scale"], growth_interval=1000)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": precision}


def final_state(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Tensor]:
    """The module's state after ``fit``: gathered at stage 3; in 16-bit runs the fp32 masters (what trains)."""
    from lightning_zero import ZeroStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ZeroStrategy):
        return state_of(model)
    if strategy.precision_plugin.precision == "32-true":
        with strategy.gathered_params():
            return state_of(model)
    return strategy._engine.full_state_dict(keep=True)


def fit_case(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Run one case on this rank; return its state, global step and the records of its model and callbacks."""
    if case["strategy"] == "reference":
        return train_norm_reference(dist.get_rank(), world_size, **case["reference"])
    model = MODELS[case["model"]](**case.get("model_kwargs", {}))
    callbacks = [CALLBACKS[name](**kwargs) for name, kwargs in case.get("callbacks", [])]
    if case.get("save_at"):
        callbacks.append(SaveAt(*case["save_at"]))
    trainer_kwargs = {**_precision_options(case), **case.get("trainer", {})}
    trainer = make_trainer(world_size, make_strategy(case), callbacks=callbacks, **trainer_kwargs)
    trainer.fit(model, LOADERS[case["model"]](case["samples"]), ckpt_path=case.get("ckpt_path"))
    return {
        "state": final_state(trainer, model),
        "global_step": trainer.global_step,
        "model": getattr(model, "record", None),
        "callbacks": [getattr(callback, "record", None) for callback in callbacks],
        "saved": case.get("save_at"),
    }


def run_cases(
    rank: int,
    world_size: int,
    cases: list[tuple[int, dict[str, Any]]],
    out_dir: str,
    fit: Callable[[int, dict[str, Any]], Any] | None = None,
) -> None:
    """``run_on_ranks(..., init_group=False)`` entry point: every case in turn, each in a new process group.

    Each rank saves each case's result to ``out_dir/<index>.rank<rank>.pt`` as soon as the case ends, so the results
    of the cases before a crash survive it (see :func:`run_isolated`). The ranks meet in a store before each case,
    so a case that timed out on one rank later than on another does not shift the next one; a case that raises is
    reported as ``{"error": traceback}`` (see ``models.result_of``).
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0,
        timeout=_RENDEZVOUS_TIMEOUT,
    )
    for index, case in cases:
        case_store = dist.PrefixStore(f"case{index}", store)
        case_store.set(f"arrived{rank}", "1")
        case_store.wait([f"arrived{r}" for r in range(world_size)])
        dist.init_process_group("gloo", store=case_store, rank=rank, world_size=world_size, timeout=TIMEOUT)
        try:
            result = (fit or fit_case)(world_size, copy.deepcopy(case))
        except Exception:
            result = {"error": f"rank {rank}, case {case.get('name')}:\n{traceback.format_exc()}"}
        finally:
            dist.destroy_process_group()
        torch.save(result, _result_path(out_dir, index, rank))
    # Rank 0 serves the store, so it returns only once the others no longer need it.
    store.set(f"left{rank}", "1")
    if rank == 0:
        store.wait([f"left{r}" for r in range(world_size)])


def _result_path(out_dir: str, index: int, rank: int) -> str:
    return os.path.join(out_dir, f"{index}.rank{rank}.pt")


def run_isolated(
    world_size: int, cases: list[dict[str, Any]], out_dir: str, fit: Callable[[int, dict[str, Any]], Any] | None = None
) -> list[list[dict[str, Any]]]:
    """Run ``cases`` on ``world_size`` ranks in one spawn; return, per rank, each case's result (``fit(world_size,
    case)``, by default :func:`fit_case`; a module-level function, so that the spawn can pickle it).

    If the processes die (a segfault) or outlive ``run_on_ranks``' limit during a case, that case's result is the
    error and a new spawn runs the cases after it, so one crash fails only its own case.
    """
    from tests.helpers import run_on_ranks

    pending = list(range(len(cases)))
    while pending:
        failure = "the spawn ended without an error but left no result"
        try:
            run_on_ranks(run_cases, world_size, [(i, cases[i]) for i in pending], out_dir, fit, init_group=False)
        except RuntimeError as error:
            failure = str(error)
        finished = [all(os.path.exists(_result_path(out_dir, i, r)) for r in range(world_size)) for i in pending]
        if all(finished):
            break
        lost = pending[finished.index(False)]
        for rank in range(world_size):
            message = f"case {cases[lost].get('name')}: the ranks died or hung during this case:\n{failure}"
            torch.save({"error": message}, _result_path(out_dir, lost, rank))
        pending = pending[pending.index(lost) + 1 :]
    return [
        [torch.load(_result_path(out_dir, i, rank), weights_only=False) for i in range(len(cases))]
        for rank in range(world_size)
    ]

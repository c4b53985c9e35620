"""Mixed precision through the Lightning ``Trainer`` with ZeroStrategy (stages 1-3) on 2 real gloo ranks.

One spawn runs every case (see ``runs``), in this order: fp16 runs in which rank 1 alone makes one gradient element
inf at optimizer step 3 and which save a checkpoint after step 4 (sharded and full, every stage); resumes from
those checkpoints; gradient clipping at two loss scales (manual and automatic optimization); ``"bf16-true"``;
``memory_report()`` in ``"bf16-mixed"``; and last, runs whose gradients always overflow (they end in an error).

A :class:`Recorder` callback records on every rank, after each optimizer step, the loss scaler's state, the fp32
masters (``full_state_dict``) and the rank's sharded optimizer state, and just before each step whether the
rank's own fp32 (unscaled) gradient shard holds an inf.
"""

from __future__ import annotations

import copy
import math
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.checkpoint.sharded import ShardedCheckpoint
from lightning_zero.core.mixed_precision import LossScaleError
from lightning_zero.precision import unwrap_optimizer
from tests.helpers import run_on_ranks
from tests.lightning.models import BATCH_SIZE, SaveAt, make_trainer, max_rel_diff, result_of, state_of

WORLD_SIZE = 2
STAGES = (1, 2, 3)
SAMPLES = 32  # 32 samples / 2 ranks / batch size 4: 4 optimizer steps per epoch
STEPS = 8
INJECT_STEP = 3  # the optimizer step (1-based) whose gradient rank 1 makes inf
SAVE_STEP = 4  # end of the first epoch: the resumed run continues exactly like the uninterrupted one
INIT_SCALE = 2.0**9
RESUME_INIT_SCALE = 2.0**3  # what a fresh scaler of the resumed run would start from
SCALER = {"init_scale": INIT_SCALE, "growth_interval": 2, "backoff_factor": 0.5, "growth_factor": 2.0}
# (scale, clean_steps, skipped_steps) after each optimizer step: growth after 2 clean steps, halved at step 3.
EXPECTED_HISTORY = [
    (512.0, 1, 0),
    (1024.0, 0, 0),
    (512.0, 0, 1),  # step 3 overflowed: skipped, scale * 0.5
    (512.0, 1, 1),
    (1024.0, 0, 1),  # two clean steps: scale * 2 again
    (1024.0, 1, 1),
    (2048.0, 0, 1),
    (2048.0, 1, 1),
]
CLIP = 0.7  # the unscaled gradient norms of the clip runs are about 0.84-0.92 in steps 1-4, 0.5 in steps 5-6
CLIP_SCALES = (2.0**8, 2.0**12)
BF16_TRUE_STEPS = 12
MEMORY_HIDDEN = 512  # Linear(7, 512) + Linear(512, 3): 5635 parameters, padding negligible
CKPT_TYPES = ("sharded", "full")


# ---------------------------------------------------------------------------------------------- model and data
class MixedNet(pl.LightningModule):
    """Linear(7, hidden) -> tanh -> Linear(hidden, 3), with switches for the cases of this module.

    Args:
        hidden: width of the hidden layer.
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum 0.9).
        lr: learning rate.
        inject_steps: optimizer steps (1-based) in which rank 1 sets element 0 of ``b.weight``'s gradient to inf
            (through a tensor hook, before the gradient is reduced).
        inject_always: the same in every step.
        manual: manual optimization that clips with ``self.clip_gradients(opt, CLIP, "norm")`` before
            ``opt.step()``; in automatic optimization ``configure_gradient_clipping`` clips (when the Trainer asks).

    ``clipped_norms`` gets, for every clipping, the global norm of the optimizer's gradients (the fp32 gradients of
    the master pieces, over all ranks) just before and just after it; ``losses`` and ``dtypes`` what
    ``training_step`` saw.
    """

    def __init__(
        self,
        hidden: int = 16,
        optimizer: str = "adamw",
        lr: float = 1e-2,
        inject_steps: tuple[int, ...] = (),
        inject_always: bool = False,
        manual: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, hidden)
        self.b = nn.Linear(hidden, 3)
        self.optimizer_name = optimizer
        self.lr = lr
        self.inject_steps = inject_steps
        self.inject_always = inject_always
        self.automatic_optimization = not manual
        self.clipped_norms: list[tuple[float, float]] = []
        self.losses: list[float] = []
        self.dtypes: dict[str, str] = {}
        self._hook: Any = None

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))

    def on_train_start(self) -> None:
        self._hook = self.b.weight.register_hook(self._inject)

    def on_train_end(self) -> None:
        self._hook.remove()

    def _inject(self, grad: Tensor) -> Tensor:
        step = self.trainer.global_step + 1  # the optimizer step this backward belongs to
        if self.global_rank == 1 and (self.inject_always or step in self.inject_steps):
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y)
        self.dtypes = {"input": str(x.dtype), "output": str(out.dtype), "loss": str(loss.dtype)}
        self.losses.append(loss.item())
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        # A threshold no norm reaches leaves the gradients as they are: the norm the real clipping then meets.
        self.clip_gradients(opt, gradient_clip_val=math.inf, gradient_clip_algorithm="norm")
        before = global_grad_norm(self.trainer, opt.optimizer)
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        self.clipped_norms.append((before, global_grad_norm(self.trainer, opt.optimizer)))
        opt.step()
        return None

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        before = global_grad_norm(self.trainer, optimizer)  # the step's fp32 gradients exist already: see ZeroPrecision
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val:
            self.clipped_norms.append((before, global_grad_norm(self.trainer, optimizer)))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def step_gradients(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients ``optimizer`` sees for this rank's pieces (after the step's fp32 copies are made: unscaled)."""
    return trainer.strategy._engine.step_of(unwrap_optimizer(optimizer)).gradients()


def global_grad_norm(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> float:
    """The 2-norm of the gradients of ``optimizer``'s pieces over all ranks (each rank holds its shard)."""
    local = sum(
        (grad.double().pow(2).sum() for grad in step_gradients(trainer, optimizer)),
        torch.zeros((), dtype=torch.float64),
    )
    dist.all_reduce(local)
    return local.sqrt().item()


def make_loader(samples: int = SAMPLES) -> DataLoader:
    """A learnable regression (y = tanh(x W)), the same on every rank; Lightning's sampler splits it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 7, generator=gen)
    y = torch.tanh(x @ (torch.randn(7, 3, generator=gen) / 7**0.5))
    return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE)


def _pieces(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> list[dict[str, Tensor]]:
    """This rank's sharded optimizer state, per piece (``step`` included), cloned."""
    return [{k: v.detach().clone() for k, v in optimizer.state.get(p, {}).items()} for p in _pieces(optimizer)]


class Recorder(pl.Callback):
    """Records on every rank: the restored scaler state at train start; per optimizer step whether this rank's
    own unscaled fp32 gradient shard held an inf/NaN, then the scaler state, the fp32 masters and the optimizer
    state after the step. ``masters[0]`` and ``optimizer[0]`` are taken at train start."""

    def __init__(self) -> None:
        self.start_scaler: dict[str, Any] | None = None
        self.history: list[tuple[float, int, int]] = []
        self.local_inf: list[bool] = []
        self.step_grad_dtypes: set[str] = set()
        self.masters: list[dict[str, Tensor]] = []
        self.optimizer: list[list[dict[str, Tensor]]] = []
        self.global_steps: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = trainer.precision_plugin.scaler
        self.start_scaler = dict(scaler.state_dict()) if scaler is not None else None
        self._snapshot(trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = step_gradients(trainer, optimizer)  # ZeroPrecision made the step's fp32 gradients already
        self.local_inf.append(any(not bool(torch.isfinite(g).all()) for g in grads))
        self.step_grad_dtypes |= {str(g.dtype) for g in grads}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scaler = trainer.precision_plugin.scaler
        if scaler is not None:
            self.history.append((scaler.scale, scaler.clean_steps, scaler.skipped_steps))
        self.global_steps.append(trainer.global_step)
        self._snapshot(trainer)

    def _snapshot(self, trainer: pl.Trainer) -> None:
        self.masters.append(trainer.strategy._engine.full_state_dict(keep=True))  # collective
        self.optimizer.append(optimizer_snapshot(trainer.optimizers[0]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "start_scaler": self.start_scaler,
            "history": self.history,
            "local_inf": self.local_inf,
            "step_grad_dtypes": sorted(self.step_grad_dtypes),
            "masters": self.masters,
            "optimizer": self.optimizer,
            "global_steps": self.global_steps,
        }


# ---------------------------------------------------------------------------------------------- cases
def _precision(case: dict[str, Any]) -> dict[str, Any]:
    """Trainer kwargs that select the case's precision."""
    kind = case["precision"]
    if kind == "zero16":  # ZeroPrecision with explicit loss-scaling options
        return {"plugins": [ZeroPrecision("16-mixed", **case["scaler"])]}
    if kind == "lightning16":  # Lightning's own plugin, translated by ZeroStrategy (keeps its GradScaler options)
        scaler = torch.amp.GradScaler("cpu", init_scale=case["scaler"]["init_scale"], growth_interval=1000)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": kind}  # "bf16-true", "bf16-mixed"


def fit_case(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    model = MixedNet(**case.get("model", {}))
    psi = sum(p.numel() for p in model.parameters())
    recorder = Recorder()
    callbacks: list[pl.Callback] = [recorder]
    if case.get("save_at"):
        callbacks.append(SaveAt(*case["save_at"]))
    strategy = ZeroStrategy(stage=case["stage"], **case.get("strategy", {}))
    trainer = make_trainer(
        WORLD_SIZE, strategy, callbacks=callbacks, **{**_precision(case), **case.get("trainer", {"max_steps": STEPS})}
    )
    out: dict[str, Any] = {"psi": psi}
    try:
        trainer.fit(model, make_loader(), ckpt_path=case.get("ckpt_path"))
    except Exception as error:  # an expected error is asserted by the test, others fail it
        out.update(error=traceback.format_exc(), error_type=type(error).__name__, message=str(error))
        out["is_loss_scale_error"] = isinstance(error, LossScaleError)
        out["is_runtime_error"] = isinstance(error, RuntimeError)
        out["recorder"] = recorder.as_dict()
        return out
    engine = trainer.strategy._engine
    optimizer = trainer.optimizers[0]
    with trainer.strategy.gathered_params():  # stage 3 keeps only shards after fit
        params = state_of(model)
    out.update(
        params=params,
        recorder=recorder.as_dict(),
        global_step=trainer.global_step,
        plugin=type(trainer.precision_plugin).__name__,
        param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        piece_dtypes=sorted({str(e.store.step_view(e.slot).dtype) for e in engine.step_of(optimizer).entries}),
        master_dtypes=sorted(
            {str(s.master.dtype) for s in (g.store for g in engine.model.trained) if hasattr(s, "master")}
        ),
        masters=engine.full_state_dict(keep=True),
        clipped_norms=model.clipped_norms,
        losses=model.losses,
        dtypes=model.dtypes,
        memory=trainer.strategy.memory_report().as_dict(),
        padded=sum(b.layout.padded_numel for b in engine.model.buffers),
        pieces=len(_pieces(optimizer)),
    )
    return out


def fit_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    results = {}
    for case in cases:
        try:
            results[case["name"]] = fit_case(rank, copy.deepcopy(case))
        except Exception:  # reported per case; result_of turns it into a test failure
            results[case["name"]] = {"error": f"rank {rank}, case {case['name']}:\n{traceback.format_exc()}"}
    return results


def _cases(directory: Path) -> list[dict[str, Any]]:
    fp16 = {"precision": "zero16", "scaler": SCALER, "model": {"inject_steps": (INJECT_STEP,)}}
    saves = [
        {
            **fp16,
            "name": f"inject/{stage}/{kind}",
            "stage": stage,
            "strategy": {"state_dict_type": kind},
            "save_at": (SAVE_STEP, str(directory / f"{stage}-{kind}")),
        }
        for stage in STAGES
        for kind in CKPT_TYPES
    ]
    resumes = [
        {
            **fp16,
            "name": f"resume/{stage}/{kind}",
            "stage": stage,
            "strategy": {"state_dict_type": kind},
            "scaler": {**SCALER, "init_scale": RESUME_INIT_SCALE},
            "ckpt_path": str(directory / f"{stage}-{kind}"),
        }
        for stage in STAGES
        for kind in CKPT_TYPES
    ]
    clips = [
        {
            "name": f"clip/{stage}/{mode}/{scale:g}",
            "stage": stage,
            # The larger scale comes through Lightning's MixedPrecision plugin and its GradScaler.
            "precision": "zero16" if scale == CLIP_SCALES[0] else "lightning16",
            "scaler": {"init_scale": scale, "growth_interval": 1000},
            "model": {"optimizer": "sgd", "lr": 0.1, "manual": mode == "manual"},
            "trainer": {"max_steps": 6, **({"gradient_clip_val": CLIP} if mode == "automatic" else {})},
        }
        for stage in STAGES
        for mode in ("manual", "automatic")
        for scale in CLIP_SCALES
    ]
    bf16_true = [
        {
            "name": f"bf16-true/{stage}",
            "stage": stage,
            "precision": "bf16-true",
            "trainer": {"max_steps": BF16_TRUE_STEPS},
        }
        for stage in STAGES
    ]
    memory = [
        {
            "name": f"memory/{stage}",
            "stage": stage,
            "precision": "bf16-mixed",
            "model": {"hidden": MEMORY_HIDDEN},
            "trainer": {"max_steps": 2},
        }
        for stage in STAGES
    ]
    overflows = [  # last: they end in an error
        {
            "name": f"overflow/{stage}",
            "stage": stage,
            "precision": "zero16",
            "scaler": {"init_scale": 8.0, "min_scale": 2.0, "growth_interval": 2},
            "model": {"inject_always": True},
        }
        for stage in STAGES
    ]
    return saves + resumes + clips + bf16_true + memory + overflows


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("mixed")
    per_rank = run_on_ranks(fit_cases, WORLD_SIZE, _cases(directory))
    return {"dir": directory, "per_rank": per_rank}


def _ranks(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [result_of(results[name]) for results in runs["per_rank"]]


def _assert_equal_states(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), what
    different = [key for key in expected if not torch.equal(expected[key], actual[key])]
    assert not different, f"{what}: {different} changed"


def _assert_equal_optimizer(expected: list[dict[str, Tensor]], actual: list[dict[str, Tensor]], what: str) -> None:
    assert len(expected) == len(actual), what
    for index, (before, after) in enumerate(zip(expected, actual, strict=True)):
        assert before.keys() == after.keys(), f"{what}: piece {index} state keys"
        for key in before:
            assert torch.equal(before[key], after[key]), f"{what}: piece {index} {key!r} changed"


def _names(prefix: str) -> list[str]:
    return [f"{prefix}/{stage}/{kind}" for stage in STAGES for kind in CKPT_TYPES]


# ---------------------------------------------------------------------------------------------- 1. one inf
@pytest.mark.parametrize("name", _names("inject"))
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(runs: dict[str, Any], name: str) -> None:
    """Rank 1 alone makes one element of one gradient inf in step 3: every rank skips that step together."""
    ranks = _ranks(runs, name)
    # The inf reaches exactly one rank's fp32 gradient shard (the owner of that element; rank 0 at stages 1 and 2,
    # rank 1 at stage 3): the other rank skips only because the ranks agree.
    seen = [rank["recorder"]["local_inf"] for rank in ranks]
    assert [sum(flags) for flags in zip(*seen, strict=True)] == [int(s == INJECT_STEP) for s in range(1, STEPS + 1)]
    for index, rank in enumerate(ranks):
        record = rank["recorder"]
        assert rank["global_step"] == STEPS
        assert record["global_steps"] == list(range(1, STEPS + 1))
        assert record["history"] == EXPECTED_HISTORY, f"rank {index}: (scale, clean_steps, skipped_steps) per step"
        assert record["step_grad_dtypes"] == ["torch.float32"]
        masters, optimizer = record["masters"], record["optimizer"]  # [k]: after step k ([0]: at train start)
        for step in range(1, STEPS + 1):
            what = f"rank {index}, step {step}"
            if step == INJECT_STEP:  # skipped: fp32 masters and Adam state (exp_avg, exp_avg_sq, step) untouched
                _assert_equal_states(masters[step - 1], masters[step], f"{what}: masters")
                _assert_equal_optimizer(optimizer[step - 1], optimizer[step], f"{what}: optimizer state")
            else:  # a clean step changes every master tensor
                changed = [k for k in masters[step] if not torch.equal(masters[step - 1][k], masters[step][k])]
                assert changed == list(masters[step]), f"{what}: only {changed} changed"
        # Adam counted the 7 steps that ran, in every piece this rank holds (empty pieces included).
        steps = [state["step"].item() for state in optimizer[-1]]
        assert steps == [STEPS - 1] * len(steps), f"rank {index}: Adam step counts {steps}"
    # The ranks hold the same masters after every step.
    for step, (first, second) in enumerate(zip(*(rank["recorder"]["masters"] for rank in ranks), strict=True)):
        _assert_equal_states(first, second, f"step {step}: rank 1 against rank 0")


@pytest.mark.parametrize("name", _names("inject") + [f"clip/{s}/manual/{CLIP_SCALES[0]:g}" for s in STAGES])
def test_fp16_parameters_are_the_masters_rounded(runs: dict[str, Any], name: str) -> None:
    for index, rank in enumerate(_ranks(runs, name)):
        assert rank["plugin"] == "ZeroPrecision"
        assert rank["param_dtypes"] == ["torch.float16"]
        assert rank["piece_dtypes"] == ["torch.float32"]
        assert rank["dtypes"]["output"] == "torch.float16"  # forward ran under fp16 autocast
        for key, master in rank["masters"].items():
            assert rank["params"][key].dtype == torch.float16
            assert torch.equal(rank["params"][key], master.to(torch.float16)), f"rank {index}: {key}"


# ---------------------------------------------------------------------------------------------- 2. persistent inf
@pytest.mark.parametrize("stage", STAGES)
def test_overflow_at_the_minimum_scale_raises_on_every_rank(runs: dict[str, Any], stage: int) -> None:
    """Every step overflows (init_scale 8, min_scale 2): two skipped steps halve the scale to 2, the third raises."""
    results = [per_rank[f"overflow/{stage}"] for per_rank in runs["per_rank"]]
    for index, result in enumerate(results):
        assert "message" in result, f"rank {index} did not raise:\n{result.get('error', result.get('global_step'))}"
        assert result["is_loss_scale_error"], result["error"]
        assert result["is_runtime_error"]
        assert "minimum 2" in result["message"], result["message"]
        assert "after 2 skipped steps" in result["message"], result["message"]
        record = result["recorder"]
        assert record["history"] == [(4.0, 0, 1), (2.0, 0, 2)], f"rank {index}"
        assert record["global_steps"] == [1, 2]
        # No step ran: the masters are the initial ones and the optimizer has no state.
        for masters in record["masters"][1:]:
            _assert_equal_states(record["masters"][0], masters, f"rank {index}: masters")
        assert all(state == {} for snapshot in record["optimizer"] for state in snapshot), f"rank {index}"
    # Each step's inf is seen by one rank only (the owner of the element), yet both raise together.
    assert [a + b for a, b in zip(*(r["recorder"]["local_inf"] for r in results), strict=True)] == [1, 1, 1]


# ---------------------------------------------------------------------------------------------- 3. checkpoints
SAVED_SCALER = dict(zip(("scale", "clean_steps", "skipped_steps"), EXPECTED_HISTORY[SAVE_STEP - 1], strict=True))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", CKPT_TYPES)
def test_checkpoint_holds_the_loss_scaler_state(runs: dict[str, Any], stage: int, kind: str) -> None:
    result_of(runs["per_rank"][0][f"inject/{stage}/{kind}"])
    path = runs["dir"] / f"{stage}-{kind}"
    if kind == "full":
        assert path.is_file()
        extra = torch.load(path, map_location="cpu", weights_only=False)
    else:
        assert path.is_dir()
        extra = ShardedCheckpoint(path).lightning_state()
    assert extra.get("ZeroPrecision") == {"loss_scaler": SAVED_SCALER}, sorted(extra)


@pytest.mark.parametrize("name", _names("resume"))
def test_resume_restores_the_loss_scaler(runs: dict[str, Any], name: str) -> None:
    """The resumed run starts from the saved scaler (not from its own init_scale 8) and continues like the
    uninterrupted run: the same scale history and the same masters."""
    uninterrupted = _ranks(runs, name.replace("resume", "inject"))
    for index, (rank, reference) in enumerate(zip(_ranks(runs, name), uninterrupted, strict=True)):
        record = rank["recorder"]
        assert record["start_scaler"] == SAVED_SCALER, f"rank {index}: scaler state after restore"
        assert record["global_steps"] == list(range(SAVE_STEP + 1, STEPS + 1))
        assert record["history"] == EXPECTED_HISTORY[SAVE_STEP:], f"rank {index}"
        _assert_equal_states(reference["masters"], rank["masters"], f"rank {index}: resumed vs uninterrupted")


# ---------------------------------------------------------------------------------------------- 4. clipping
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mode", ["manual", "automatic"])
def test_clipping_sees_unscaled_gradients(runs: dict[str, Any], stage: int, mode: str) -> None:
    """Clipping by norm at loss scale 2**8 (ZeroPrecision) and 2**12 (Lightning's MixedPrecision plugin) meets
    the same unscaled gradients, clips 4 of the 6 steps to the clip value and gives the same masters."""
    low, high = (_ranks(runs, f"clip/{stage}/{mode}/{scale:g}") for scale in CLIP_SCALES)
    for index, (first, second) in enumerate(zip(low, high, strict=True)):
        for result, scale in ((first, CLIP_SCALES[0]), (second, CLIP_SCALES[1])):
            assert result["plugin"] == "ZeroPrecision"
            assert result["recorder"]["start_scaler"] == {"scale": scale, "clean_steps": 0, "skipped_steps": 0}
            assert result["recorder"]["history"][-1] == (scale, 6, 0), "no step may overflow"
            norms = result["clipped_norms"]  # per step: global norm before and after clipping
            assert len(norms) == 6, norms
            for before, after in norms:  # clipped exactly where the unscaled norm exceeds CLIP
                assert abs(after - min(before, CLIP)) <= 1e-5 * CLIP, f"rank {index}, scale {scale:g}: {norms}"
            assert [before > CLIP for before, _ in norms] == [True] * 4 + [False] * 2, norms
            assert all(0.3 < before < 1.5 for before, _ in norms), f"scaled gradients? {norms}"
        assert first["clipped_norms"] == second["clipped_norms"], f"rank {index}: norms depend on the loss scale"
        diffs = max_rel_diff(first["masters"], second["masters"])
        assert max(diffs.values()) <= 1e-6, f"rank {index}: masters depend on the loss scale: {diffs}"
        assert any(not torch.equal(first["masters"][k], v) for k, v in first["recorder"]["masters"][0].items())
    # Manual clip_gradients before opt.step() and the Trainer's gradient_clip_val do the same thing.
    other = _ranks(runs, f"clip/{stage}/{'automatic' if mode == 'manual' else 'manual'}/{CLIP_SCALES[0]:g}")
    assert max(max_rel_diff(low[0]["masters"], other[0]["masters"]).values()) <= 1e-6


# ---------------------------------------------------------------------------------------------- 5. bf16-true
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_true_trains_bf16_parameters_from_fp32_masters(runs: dict[str, Any], stage: int) -> None:
    for index, rank in enumerate(_ranks(runs, f"bf16-true/{stage}")):
        assert rank["global_step"] == BF16_TRUE_STEPS
        assert rank["dtypes"] == {"input": "torch.bfloat16", "output": "torch.bfloat16", "loss": "torch.bfloat16"}
        assert rank["param_dtypes"] == ["torch.bfloat16"], f"rank {index}: model parameters"
        assert rank["piece_dtypes"] == rank["master_dtypes"] == ["torch.float32"], f"rank {index}: optimizer pieces"
        for key, master in rank["masters"].items():
            assert master.dtype == torch.float32
            # The masters hold updates smaller than a bf16 ulp, and the parameters are their rounding.
            assert not torch.equal(master, master.to(torch.bfloat16).float()), f"rank {index}: {key} is bf16-valued"
            assert torch.equal(rank["params"][key], master.to(torch.bfloat16)), f"rank {index}: {key}"
        # The same 4 batches per epoch, 3 epochs: the loss falls.
        losses = torch.tensor(rank["losses"]).view(3, -1).mean(dim=1)
        assert losses[1] < losses[0], f"rank {index}: epoch losses {losses}"
        assert losses[2] < 0.7 * losses[0], f"rank {index}: epoch losses {losses}"


# ---------------------------------------------------------------------------------------------- 6. memory
# Per-rank bytes in bf16-mixed with AdamW (ZeRO paper: 2 + 2 + 12 per parameter), Ψ parameters, N ranks.
MEMORY_FORMULAS = {1: lambda psi, n: 4 * psi + 12 * psi / n, 2: lambda psi, n: 2 * psi + 14 * psi / n,
                   3: lambda psi, n: 16 * psi / n}  # fmt: skip


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_memory_report_matches_the_zero_formulas(runs: dict[str, Any], stage: int) -> None:
    ranks = _ranks(runs, f"memory/{stage}")
    psi, padded, pieces, n = ranks[0]["psi"], ranks[0]["padded"], ranks[0]["pieces"], WORLD_SIZE
    assert psi == 7 * MEMORY_HIDDEN + MEMORY_HIDDEN + MEMORY_HIDDEN * 3 + 3
    assert 0 <= padded - psi < n
    shard = padded // n
    for index, rank in enumerate(ranks):
        memory = rank["memory"]
        assert memory["params"] == 2 * (padded if stage < 3 else shard), f"rank {index}: {memory}"
        assert memory["gradients"] == 2 * (padded if stage == 1 else shard), f"rank {index}: {memory}"
        # fp32 master shard + Adam's exp_avg and exp_avg_sq for the owned elements + a 4-byte `step` per piece.
        assert abs(memory["optimizer_states"] - 12 * psi / n) <= 12 * n + 4 * pieces, f"rank {index}: {memory}"
        ratio = memory["total"] / MEMORY_FORMULAS[stage](psi, n)
        assert abs(ratio - 1) <= 0.05, f"rank {index}: total / formula = {ratio:.4f}"
    # Over all ranks Adam's element-wise state is exactly 8 bytes per parameter.
    states = sum(rank["memory"]["optimizer_states"] for rank in ranks)
    assert states == 4 * padded + 8 * psi + 4 * pieces * n

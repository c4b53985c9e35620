"""ZeroFabricStrategy's checkpoints: fabric.save/fabric.load (sharded and full) at stages 1-3, resuming at another
world size and stage, checkpoints shared with the Trainer's ZeroStrategy both ways, and memory_report().

Three spawns: 2 ranks (save/load at every stage, the Trainer round trips, the memory report, and a stage-3 run
that saves mid-way); 3 ranks (resume that at stage 1; a stage-2 run that saves mid-way); 2 ranks (resume that at
stage 3). A resumed run sees the same global batches as the run that saved (each rank takes its slice of one batch
of 6 samples), so its steps equal the uninterrupted run's up to the order of float sums.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_zero import ZeroFabricPrecision, ZeroFabricStrategy, ZeroStrategy
from lightning_zero.core.named_state import PARAM_NAMES_KEY
from lightning_zero.precision import unwrap_optimizer
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks
from tests.lightning.models import SaveAt, TwoLayer, assert_every_case_finished, make_loader, make_trainer, state_of

STAGES = (1, 2, 3)
GLOBAL_BATCH = 6  # split evenly over 2 and 3 ranks
STEPS = 4
SAVE_AFTER = 2  # optimizer steps done when the resumable runs save
RTOL = 1e-5
FP32 = 4


# ---------------------------------------------------------------------------------------------------- in the ranks
def _fabric(world_size: int, stage: int, state_dict_type: str = "sharded") -> Fabric:
    strategy = ZeroFabricStrategy(
        stage=stage, state_dict_type=state_dict_type, wrap_policy={nn.Linear} if stage == 3 else None
    )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def _setup(fabric: Fabric, seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = TinyLM()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    return model, optimizer, scheduler


def _states(fabric: Fabric, model: Any, optimizer: Any) -> dict[str, Any]:
    """The model's full state dict, the optimizer's full state and this rank's own optimizer shards."""
    strategy = fabric.strategy
    with strategy.gathered_params():
        module_state = state_of(model.module)
    raw = optimizer.optimizer
    return {
        "model": module_state,
        "optimizer": strategy.session.engine.full_optimizer_state_dict(raw),
        "local": raw.state_dict(),
    }


def _step(fabric: Fabric, model: Any, optimizer: Any, scheduler: Any, step: int, rank: int, world_size: int) -> None:
    """One step on this rank's slice of global batch ``step`` (the same global batches at any world size)."""
    tokens, targets = batch(seed=100 + step, size=GLOBAL_BATCH)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    fabric.backward(loss_fn(model, tokens[rows], targets[rows]))
    fabric.clip_gradients(model, optimizer, max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _resumable_run(rank: int, world_size: int, stage: int, path: str) -> dict[str, Any]:
    """STEPS steps, saving (litgpt's way) after SAVE_AFTER; the full parameters after each step."""
    fabric = _fabric(world_size, stage)
    model, optimizer, scheduler = _setup(fabric, seed=0)
    after: dict[int, dict[str, Tensor]] = {}
    for step in range(STEPS):
        _step(fabric, model, optimizer, scheduler, step, rank, world_size)
        if step + 1 == SAVE_AFTER:
            state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": step + 1}
            fabric.save(path, state)
        with fabric.strategy.gathered_params():
            after[step + 1] = state_of(model.module)
    return after


def _resume(rank: int, world_size: int, stage: int, path: str) -> dict[str, Any]:
    """Load ``path`` into a differently initialised run and go on to STEPS as litgpt's pretrain does."""
    fabric = _fabric(world_size, stage)
    model, optimizer, scheduler = _setup(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0}
    fabric.load(path, state)
    after: dict[int, dict[str, Tensor]] = {}
    for step in range(state["iter_num"], STEPS):
        _step(fabric, model, optimizer, scheduler, step, rank, world_size)
        with fabric.strategy.gathered_params():
            after[step + 1] = state_of(model.module)
    return {"after": after, "iter_num": state["iter_num"]}


def _error_of(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _save_and_load(rank: int, world_size: int, stage: int, state_dict_type: str, path: str) -> dict[str, Any]:
    fabric = _fabric(world_size, stage, state_dict_type)
    model, optimizer, scheduler = _setup(fabric, seed=0)
    for step in range(2):
        _step(fabric, model, optimizer, scheduler, step, rank, world_size)
    saved = _states(fabric, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "iter_num": 2, "scheduler": scheduler, "note": "n"})
    saved["scheduler"] = scheduler.state_dict()

    fabric = _fabric(world_size, stage, state_dict_type)
    model, optimizer, scheduler = _setup(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "scheduler": scheduler}
    remainder = fabric.load(path, state)
    loaded = _states(fabric, model, optimizer)
    loaded.update(scheduler=scheduler.state_dict(), iter_num=state["iter_num"], remainder=remainder)
    loaded["lr"] = optimizer.param_groups[0]["lr"]
    missing = {"model": model, "optimizer": optimizer, "step_count": 0}
    return {
        "saved": saved,
        "loaded": loaded,
        "strict_error": _error_of(lambda: fabric.load(path, missing)),
        "not_strict": fabric.load(path, {"model": model, "step_count": 7}, strict=False),
        "whole": fabric.load(path),
    }


def _plain_states(seed: int) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A TinyLM and its AdamW after one step in one process: their own state dicts, as a user saves them."""
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    loss_fn(model, *batch(seed=7, size=GLOBAL_BATCH)).backward()
    optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def _load_raw(rank: int, world_size: int, stage: int, directory: str) -> dict[str, Any]:
    """``fabric.load_raw`` of a plain model's and a plain optimizer's own state dict files (litgpt loads pretrained
    weights so): what the set-up model and optimizer then hold, in full."""
    model_path, optimizer_path = f"{directory}/raw_model_{stage}.pt", f"{directory}/raw_optimizer_{stage}.pt"
    model_state, optimizer_state = _plain_states(seed=5)
    fabric = _fabric(world_size, stage)
    if rank == 0:
        torch.save(model_state, model_path)
        torch.save(optimizer_state, optimizer_path)
    fabric.barrier()
    model, optimizer, _ = _setup(fabric, seed=1)
    fabric.load_raw(model_path, model)
    fabric.load_raw(optimizer_path, optimizer)
    files = {"model": torch.load(model_path), "optimizer": torch.load(optimizer_path)}
    return {**_states(fabric, model, optimizer), "files": files}


def _two_optimizers(fabric: Fabric, seed: int, swapped: bool) -> tuple[Any, dict[str, Any]]:
    """TinyLM with AdamW over its first layers and SGD over the rest, set up in that order or ``swapped``."""
    torch.manual_seed(seed)
    model = TinyLM()
    first = [*model.emb.parameters(), *model.a.parameters(), *model.b.parameters()]
    adamw = torch.optim.AdamW(first, lr=1e-2, weight_decay=0.05)
    sgd = torch.optim.SGD([*model.c.parameters(), *model.head.parameters()], lr=0.1, momentum=0.9)
    if swapped:
        model, sgd, adamw = fabric.setup(model, sgd, adamw)
    else:
        model, adamw, sgd = fabric.setup(model, adamw, sgd)
    return model, {"adamw": adamw, "sgd": sgd}


def _optimizers_by_key(rank: int, world_size: int, stage: int, path: str) -> dict[str, Any]:
    """Save a model with two optimizers under their keys, then load it where they were set up in the other order:
    each optimizer's full state, saved and loaded, by key."""
    fabric = _fabric(world_size, stage)
    model, optimizers = _two_optimizers(fabric, seed=0, swapped=False)
    for step in range(2):
        tokens, targets = batch(seed=100 + step + rank)
        fabric.backward(loss_fn(model, tokens, targets))
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    engine = fabric.strategy.session.engine
    saved = {key: engine.full_optimizer_state_dict(o.optimizer) for key, o in optimizers.items()}
    fabric.save(path, {"model": model, **optimizers})
    fabric = _fabric(world_size, stage)
    model, optimizers = _two_optimizers(fabric, seed=1, swapped=True)
    fabric.load(path, {"model": model, **optimizers})
    engine = fabric.strategy.session.engine
    loaded = {key: engine.full_optimizer_state_dict(o.optimizer) for key, o in optimizers.items()}
    return {"saved": saved, "loaded": loaded}


def _second_module(rank: int, world_size: int, stage: int, kind: str, path: str) -> dict[str, Any]:
    """The sharded model and a plain copy of it (an EMA) in one state: saved, then loaded into a fresh run. Returns
    both as saved and as loaded (full)."""
    fabric = _fabric(world_size, stage, kind)
    model, optimizer, scheduler = _setup(fabric, seed=0)
    ema = TinyLM()
    with torch.no_grad():
        for index, param in enumerate(ema.parameters()):
            param.fill_(index + 0.5)  # unlike any model's values
    _step(fabric, model, optimizer, scheduler, 0, rank, world_size)
    with fabric.strategy.gathered_params():
        saved = {"model": state_of(model.module), "ema": state_of(ema)}
    fabric.save(path, {"model": model, "optimizer": optimizer, "ema": ema})
    fabric = _fabric(world_size, stage, kind)
    model, optimizer, _ = _setup(fabric, seed=1)
    fresh = TinyLM()
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer, "ema": fresh})
    with fabric.strategy.gathered_params():
        loaded = {"model": state_of(model.module), "ema": state_of(fresh)}
    return {"saved": saved, "loaded": loaded, "remainder": sorted(remainder)}


def _fp16_fabric(world_size: int, kind: str) -> tuple[Fabric, Any, Any]:
    plugin = ZeroFabricPrecision("16-mixed", init_scale=2.0**24)
    strategy = ZeroFabricStrategy(stage=2, state_dict_type=kind)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return fabric, model, optimizer


def _fp16_scale(rank: int, world_size: int, kind: str, path: str) -> dict[str, Any]:
    """16-mixed from a loss scale that overflows (steps skipped, the scale backs off): the scaler's state when saved,
    and after a fresh run loads the checkpoint."""
    fabric, model, optimizer = _fp16_fabric(world_size, kind)
    for _ in range(3):
        fabric.backward(model(torch.full((4, 8), 100.0)).square().sum())
        optimizer.step()
        optimizer.zero_grad()
    saved = fabric.strategy.precision.scaler.state_dict()
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric, model, optimizer = _fp16_fabric(world_size, kind)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    return {"saved": saved, "loaded": fabric.strategy.precision.scaler.state_dict(), "remainder": sorted(remainder)}


def _memory(world_size: int) -> dict[str, Any]:
    fabric = _fabric(world_size, 2)
    torch.manual_seed(0)
    model = TinyLM()
    psi = sum(p.numel() for p in model.parameters())
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    engine = fabric.strategy.session.engine
    padded = sum(b.layout.padded_numel for b in engine.model.buffers)
    at_setup = fabric.strategy.memory_report().as_dict()
    fabric.backward(loss_fn(model, *batch(seed=0)))
    optimizer.step()
    pieces = sum(len(g["params"]) for g in optimizer.param_groups)
    return {"psi": psi, "padded": padded, "setup": at_setup, "step": fabric.strategy.memory_report(), "pieces": pieces}


class _Capture(pl.Callback):
    """At the start of training (after a resume restored the checkpoint): the model and optimizer state."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states = _trainer_states(trainer, pl_module)


def _trainer_states(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    with strategy.gathered_params():
        module_state = state_of(module)
    optimizer = unwrap_optimizer(trainer.optimizers[0])
    return {"model": module_state, "optimizer": strategy.session.engine.full_optimizer_state_dict(optimizer)}


def _fabric_two_layer(world_size: int, stage: int) -> tuple[Fabric, Any, Any]:
    fabric = _fabric(world_size, stage)
    model = TwoLayer()  # seeds itself: the Trainer's model starts alike
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    return fabric, model, optimizer


def _with_trainer(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Fabric (stage 2) saves, a Trainer (stage 3) resumes; a Trainer (stage 1) saves, Fabric (stage 3) loads."""
    fabric, model, optimizer = _fabric_two_layer(world_size, 2)
    x, y = make_loader("two_layer").dataset.tensors
    for step in range(3):
        rows = slice(8 * step + 4 * rank, 8 * step + 4 * rank + 4)
        fabric.backward(nn.functional.mse_loss(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
    with fabric.strategy.gathered_params():
        fabric_saved = {"model": state_of(model.module)}
    fabric_saved["optimizer"] = fabric.strategy.session.engine.full_optimizer_state_dict(optimizer.optimizer)
    fabric.save(f"{directory}/fabric", {"model": model, "optimizer": optimizer, "iter_num": 3})

    capture = _Capture()
    trainer = make_trainer(world_size, ZeroStrategy(stage=3), max_steps=2, callbacks=[capture])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(TwoLayer(), make_loader("two_layer"), ckpt_path=f"{directory}/fabric")
    trainer_resumed = {**capture.states, "global_step": trainer.global_step}
    trainer_resumed["warnings"] = [str(w.message) for w in caught if "fabric.save" in str(w.message)]

    trainer = make_trainer(world_size, ZeroStrategy(stage=1), max_steps=3, callbacks=[SaveAt(3, f"{directory}/tr")])
    module = TwoLayer()
    trainer.fit(module, make_loader("two_layer"))
    trainer_saved = _trainer_states(trainer, module)  # the fit ended right after the save
    fabric, model, optimizer = _fabric_two_layer(world_size, 3)
    remainder = fabric.load(f"{directory}/tr", {"model": model, "optimizer": optimizer}, strict=False)
    fabric_loaded = _states(fabric, model, optimizer)
    fabric_loaded["remainder"] = {k: remainder[k] for k in ("global_step", "epoch") if k in remainder}
    return {
        "fabric_saved": fabric_saved,
        "trainer_resumed": trainer_resumed,
        "trainer_saved": trainer_saved,
        "fabric_loaded": fabric_loaded,
    }


def _guarded(call: Callable[[], Any], rank: int) -> Any:
    """A part that raised is reported (the same on every rank) so that the other parts of the spawn still run."""
    try:
        return call()
    except Exception:
        return {"error": f"rank {rank}:\n{traceback.format_exc()}"}


def _first_two(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in STAGES:
        for kind in ("sharded", "full"):
            path = f"{directory}/s{stage}_{kind}" + (".ckpt" if kind == "full" else "")
            out[(stage, kind)] = _guarded(partial(_save_and_load, rank, world_size, stage, kind, path), rank)
    for kind in ("sharded", "full"):
        out[("fp16", kind)] = _guarded(partial(_fp16_scale, rank, world_size, kind, f"{directory}/fp16_{kind}"), rank)
        for stage in (1, 3):
            path = f"{directory}/second_{kind}_{stage}"
            out[("second", kind, stage)] = _guarded(partial(_second_module, rank, world_size, stage, kind, path), rank)
    for stage in STAGES:
        path = f"{directory}/by_key_{stage}"
        out[("by_key", stage)] = _guarded(partial(_optimizers_by_key, rank, world_size, stage, path), rank)
        out[("raw", stage)] = _guarded(partial(_load_raw, rank, world_size, stage, directory), rank)
    out["run_2_stage3"] = _guarded(lambda: _resumable_run(rank, world_size, 3, f"{directory}/run_2_stage3"), rank)
    out["memory"] = _guarded(lambda: _memory(world_size), rank)
    out["trainer"] = _guarded(lambda: _with_trainer(rank, world_size, directory), rank)
    return out


def _three(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    return {
        "resume_stage1": _guarded(lambda: _resume(rank, world_size, 1, f"{directory}/run_2_stage3"), rank),
        "run_3_stage2": _guarded(lambda: _resumable_run(rank, world_size, 2, f"{directory}/run_3_stage2"), rank),
    }


def _second_two(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    return {"resume_stage3": _guarded(lambda: _resume(rank, world_size, 3, f"{directory}/run_3_stage2"), rank)}


# ---------------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    directory = str(tmp_path_factory.mktemp("fabric_checkpoints"))
    first = run_on_ranks(_first_two, 2, directory)
    three = run_on_ranks(_three, 3, directory)
    second = run_on_ranks(_second_two, 2, directory)
    return {"first": first, "three": three, "second": second, "dir": directory}


def _ok(result: Any) -> Any:
    if isinstance(result, dict) and "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as {path: leaf}."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}/{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}/{i}").items()}
    return {prefix: value}


def _unequal(expected: Any, actual: Any) -> list[str]:
    """Paths where two nested states differ (tensors bit for bit, dtype and shape included)."""
    a, b = _flat(expected), _flat(actual)
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())}"]
    bad = []
    for key, value in a.items():
        other = b[key]
        if isinstance(value, Tensor):
            same = isinstance(other, Tensor) and value.dtype == other.dtype and torch.equal(value, other)
        else:
            same = value == other
        if not same:
            bad.append(key)
    return bad


def _relative(expected: dict[str, Tensor], actual: dict[str, Tensor]) -> dict[str, float]:
    assert expected.keys() == actual.keys()
    return {
        k: ((expected[k].double() - actual[k].double()).abs().max() / expected[k].double().abs().max()).item()
        for k in expected
    }


def test_every_part_finished_on_every_rank(runs: dict) -> None:
    """A part that raised where no other test looks (the uninterrupted runs beyond rank 0) still fails."""
    spawns = ("first", "three", "second")
    assert_every_case_finished({(s, key): [r[key] for r in runs[s]] for s in spawns for key in runs[s][0]})


@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("stage", STAGES)
def test_load_restores_model_optimizer_and_extra_entries_exactly(runs: dict, stage: int, kind: str) -> None:
    for rank, per_rank in enumerate(runs["first"]):
        result = _ok(per_rank[(stage, kind)])
        saved, loaded = result["saved"], result["loaded"]
        assert not _unequal(saved["model"], loaded["model"]), (rank, _unequal(saved["model"], loaded["model"]))
        assert not _unequal(saved["optimizer"], loaded["optimizer"]), rank
        assert not _unequal(saved["local"], loaded["local"]), rank  # this rank's own shards, bit for bit
        # litgpt's use: the int updated in the caller's dict, the scheduler's load_state_dict called.
        assert loaded["iter_num"] == 2
        assert not _unequal(saved["scheduler"], loaded["scheduler"])
        assert loaded["lr"] == pytest.approx(1e-2 * 0.7**2)  # the scheduler's last lr went into the optimizer
        assert loaded["remainder"] == {"note": "n"}  # what the state did not ask for, nothing of the strategy's


@pytest.mark.parametrize("stage", STAGES)
def test_load_raw_loads_a_plain_state_dict_file(runs: dict, stage: int) -> None:
    """``fabric.load_raw(path, model)`` and ``(path, optimizer)`` of files holding a plain model's and optimizer's own
    state dicts load them exactly (it raised "state contains a key 'model' that does not exist", and with
    ``strict=False`` loaded nothing, silently: found in a user's trial)."""
    for rank, result in enumerate(runs["first"]):
        loaded = _ok(result[("raw", stage)])
        model_state, optimizer_state = loaded["files"]["model"], loaded["files"]["optimizer"]
        assert not _unequal(model_state, loaded["model"]), f"rank {rank}: {_unequal(model_state, loaded['model'])}"
        assert not _unequal(optimizer_state["state"], loaded["optimizer"]["state"]), f"rank {rank}"
        assert optimizer_state["state"][0]["step"] == 1


@pytest.mark.parametrize("stage", STAGES)
def test_optimizers_set_up_in_another_order_load_by_their_keys(runs: dict, stage: int) -> None:
    """Fabric's DDP loads each optimizer by its key in the state; a sharded checkpoint loaded where the optimizers
    were set up in the other order refused ("configure_optimizers() here gives ...", found in a user's trial)."""
    for rank, result in enumerate(runs["first"]):
        result = _ok(result[("by_key", stage)])
        for key in ("adamw", "sgd"):
            saved, loaded = result["saved"][key], result["loaded"][key]
            assert not _unequal(saved["state"], loaded["state"]), f"rank {rank}, {key}"
            assert [g["lr"] for g in saved["param_groups"]] == [g["lr"] for g in loaded["param_groups"]]
        assert "momentum_buffer" in next(iter(result["loaded"]["sgd"]["state"].values()))


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_second_plain_module_in_the_state_saves_and_loads_as_itself(runs: dict, kind: str, stage: int) -> None:
    """An EMA copy next to the sharded model in ``fabric.save``'s state: each loads as itself, as under Fabric's DDP
    (the full file held the sharded model's weights under "ema", and a sharded load returned the EMA's entry
    unloaded: found in a user's trial)."""
    for rank, result in enumerate(runs["first"]):
        result = _ok(result[("second", kind, stage)])
        assert not _unequal(result["saved"], result["loaded"]), (
            f"rank {rank}: {_unequal(result['saved'], result['loaded'])}"
        )
        assert "ema" not in result["remainder"]


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_the_fp16_loss_scale_resumes(runs: dict, kind: str) -> None:
    """``fabric.save`` keeps the loss scaler's state (scale, skipped steps) and ``fabric.load`` restores it, under the
    key the Trainer uses (Fabric saves no precision state: the scale went back to its initial value, and the resumed
    run differed from the uninterrupted one; found in a user's trial)."""
    for rank, result in enumerate(runs["first"]):
        result = _ok(result[("fp16", kind)])
        assert result["saved"]["scale"] < 2.0**24, result["saved"]  # the run did back off
        assert result["loaded"] == result["saved"], f"rank {rank}"
        assert result["remainder"] == []


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_strict_loading_names_the_missing_key(runs: dict, kind: str) -> None:
    for per_rank in runs["first"]:
        result = _ok(per_rank[(2, kind)])
        assert result["strict_error"].startswith("KeyError"), result["strict_error"]
        assert "'step_count'" in result["strict_error"]
        assert "strict=False" in result["strict_error"]
        # strict=False: the key the checkpoint lacks is left alone; what the state did not ask for comes back (the
        # optimizer's state too where it is an entry of one file; a sharded checkpoint keeps it in the shards).
        remainder = dict(result["not_strict"])
        assert ("optimizer" in remainder) == (kind == "full")
        remainder.pop("optimizer", None)
        assert remainder == {"iter_num": 2, "scheduler": result["saved"]["scheduler"], "note": "n"}


@pytest.mark.parametrize("stage", STAGES)
def test_load_without_state_returns_the_checkpoint_as_saved(runs: dict, stage: int) -> None:
    """Sharded or full, the same dict: the model's and optimizer's states in full under their names."""
    for per_rank in runs["first"]:
        sharded, full = _ok(per_rank[(stage, "sharded")]), _ok(per_rank[(stage, "full")])
        whole = sharded["whole"]
        assert set(whole) == {"model", "optimizer", "iter_num", "scheduler", "note"}
        assert not _unequal(sharded["saved"]["model"], whole["model"])
        # The full file's optimizer entry also names the parameters of each group (for loading at another layout).
        from_file = {**full["whole"], "optimizer": dict(full["whole"]["optimizer"])}
        assert from_file["optimizer"].pop(PARAM_NAMES_KEY)
        assert not _unequal(whole, from_file), _unequal(whole, from_file)


def _assert_resumed(resumed: dict[str, Any], uninterrupted: dict[int, dict[str, Tensor]]) -> None:
    assert resumed["iter_num"] == SAVE_AFTER
    assert sorted(resumed["after"]) == list(range(SAVE_AFTER + 1, STEPS + 1))
    for step, params in resumed["after"].items():
        diffs = _relative(uninterrupted[step], params)
        assert max(diffs.values()) <= RTOL, (step, diffs)


def test_resume_at_3_ranks_stage_1_from_2_ranks_stage_3(runs: dict) -> None:
    uninterrupted = _ok(runs["first"][0]["run_2_stage3"])
    for per_rank in runs["three"]:
        _assert_resumed(_ok(per_rank["resume_stage1"]), uninterrupted)


def test_resume_at_2_ranks_stage_3_from_3_ranks_stage_2(runs: dict) -> None:
    uninterrupted = _ok(runs["three"][0]["run_3_stage2"])
    for per_rank in runs["second"]:
        _assert_resumed(_ok(per_rank["resume_stage3"]), uninterrupted)


def test_trainer_resumes_a_fabric_checkpoint(runs: dict) -> None:
    """Model and optimizer state as Fabric saved them; the loops start at step 0, with a warning on rank 0."""
    for rank, per_rank in enumerate(runs["first"]):
        result = _ok(per_rank["trainer"])
        saved, resumed = result["fabric_saved"], result["trainer_resumed"]
        assert not _unequal(saved["model"], resumed["model"])
        assert not _unequal(saved["optimizer"], resumed["optimizer"])
        assert resumed["global_step"] == 2
        if rank == 0:
            (message,) = resumed["warnings"]
            assert "loops" in message
            assert "'iter_num'" in message


def test_fabric_loads_a_trainer_checkpoint(runs: dict) -> None:
    for per_rank in runs["first"]:
        result = _ok(per_rank["trainer"])
        saved, loaded = result["trainer_saved"], result["fabric_loaded"]
        assert not _unequal(saved["model"], loaded["model"])
        assert not _unequal(saved["optimizer"], loaded["optimizer"])
        assert loaded["remainder"] == {"global_step": 3, "epoch": 0}


def test_memory_report_after_setup_matches_the_formulas(runs: dict) -> None:
    """Stage 2, fp32 AdamW: after setup 4Ψ of parameters (gradients and Adam's state come with the first step);
    after it 4Ψ + 4Ψ/N + 8Ψ/N, exactly up to padding and Adam's 4-byte `step` per parameter piece."""
    ranks = [_ok(per_rank["memory"]) for per_rank in runs["first"]]
    n, psi, padded = len(ranks), ranks[0]["psi"], ranks[0]["padded"]
    assert 0 <= padded - psi < n
    for r in ranks:
        assert r["setup"]["params"] == FP32 * padded
        assert r["setup"]["gradients"] == r["setup"]["optimizer_states"] == 0
        step = r["step"]
        assert step.params == FP32 * padded
        assert step.gradients == FP32 * padded // n
        assert step.optimizer_states - FP32 * r["pieces"] <= 8 * padded // n
    assert sum(r["step"].optimizer_states - FP32 * r["pieces"] for r in ranks) == 8 * psi  # Adam's two moments


def test_checkpoint_files(runs: dict) -> None:
    directory = Path(runs["dir"])
    assert {p.name for p in (directory / "s3_sharded").iterdir()} == {
        "metadata.json",
        "lightning.pt",
        "rank_0.pt",
        "rank_1.pt",
    }
    assert (directory / "s3_full.ckpt").is_file()

"""Sharded checkpoints between partition="parameter" and "flat", at other world sizes and stages.

Element-wise state (AdamW) moves both ways, also saved with the optimizer paged from NVMe (its state rests in the
swap file, not in the optimizer); Adafactor's row and column factors, saved whole by their owner, resume with
partition="parameter" at another world size and stage, and give a clear error under "flat". Three spawns: 2 ranks
save, 3 ranks load and save, 2 ranks load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks


def _engine(stage: int, partition: str, optimizer_name: str, seed: int = 0, offload: str | bool = False) -> Any:
    import tempfile

    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    torch.manual_seed(seed)
    model = TinyLM(frozen=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer_class = {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor}[optimizer_name]
    optimizer = optimizer_class(params, lr=1e-2, weight_decay=0.05)
    policy = {nn.Linear} if stage == 3 else None
    options = EngineOptions(
        stage=stage,
        bucket_cap_mb=0.0005,
        wrap_policy=policy,
        partition=partition,
        offload_optimizer=offload,
        nvme_path=tempfile.mkdtemp(prefix="lz-partition-") if offload == "nvme" else None,
    )
    return ZeroEngine(model, [optimizer], options, Communicator())


def _train(engine: Any, rank: int, steps: int = 3) -> None:
    optimizer = engine.optimizers[0]
    for step in range(steps):
        optimizer.zero_grad()
        tokens, targets = batch(seed=100 * step + rank)
        loss_fn(engine.module, tokens, targets).backward()
        optimizer.step()


def _full(engine: Any) -> dict[str, Any]:
    with engine.gathered():
        params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"params": params, "optimizer": engine.full_optimizer_state_dict(engine.optimizers[0])}


def _save(engine: Any, path: Path, partition: str) -> None:
    from lightning_zero.checkpoint.saving import save_sharded

    save_sharded(engine.named_state(), path, extra={}, version="test", partition=partition)


def _load(engine: Any, path: Path) -> dict[str, Any] | str:
    from lightning_zero.checkpoint.sharded import ShardedCheckpoint, load_sharded_optimizers, load_sharded_params

    try:
        checkpoint = ShardedCheckpoint(path)
        load_sharded_params(engine.named_state(), checkpoint)
        load_sharded_optimizers(engine.named_state(), checkpoint)
    except Exception as error:  # the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return _full(engine)


def _first(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """2 ranks: save by owner (stage 2, AdamW, in memory, offloaded and paged from NVMe; stage 3, Adafactor)."""
    out = {}
    for name, stage, optimizer, offload in (
        ("owner_adamw", 2, "adamw", False),
        ("owner_adamw_cpu", 2, "adamw", "cpu"),
        ("owner_adamw_nvme", 2, "adamw", "nvme"),
        ("owner_adafactor", 3, "adafactor", False),
    ):
        engine = _engine(stage, "parameter", optimizer, offload=offload)
        _train(engine, rank)
        _save(engine, root / name, "parameter")
        out[name] = _full(engine)
    return out


def _second(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """3 ranks: load by owner into flat stage 3 and into owners at stage 1; save a flat stage-3 run."""
    out: dict[str, Any] = {
        "owner_adamw->flat3": _load(_engine(3, "flat", "adamw", seed=1), root / "owner_adamw"),
        "owner_adamw_nvme->flat3": _load(_engine(3, "flat", "adamw", seed=1), root / "owner_adamw_nvme"),
        "owner_adafactor->owner1": _load(_engine(1, "parameter", "adafactor", seed=1), root / "owner_adafactor"),
    }
    engine = _engine(3, "flat", "adamw")
    _train(engine, rank)
    _save(engine, root / "flat_adamw", "flat")
    out["flat_adamw"] = _full(engine)
    return out


def _third(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """2 ranks: flat into owners; Adafactor's factors into flat pieces (an error)."""
    return {
        "flat_adamw->owner1": _load(_engine(1, "parameter", "adamw", seed=1), root / "flat_adamw"),
        "owner_adafactor->flat2": _load(_engine(2, "flat", "adamw", seed=1), root / "owner_adafactor"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("partition_checkpoints")
    return {
        "root": root,
        "first": run_on_ranks(_first, 2, root),
        "second": run_on_ranks(_second, 3, root),
        "third": run_on_ranks(_third, 2, root),
    }


def _assert_same(saved: dict[str, Any], loaded: dict[str, Any] | str) -> None:
    assert not isinstance(loaded, str), loaded
    assert saved["params"].keys() == loaded["params"].keys()
    for key, value in saved["params"].items():
        assert torch.equal(value, loaded["params"][key]), key
    ours, theirs = saved["optimizer"], loaded["optimizer"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in ours["state"].items():
        assert state.keys() == theirs["state"][index].keys(), index
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs["state"][index][key])), (index, key)


@pytest.mark.parametrize(
    ("saved_in", "saved", "loaded_in", "loaded"),
    [
        ("first", "owner_adamw", "second", "owner_adamw->flat3"),
        ("first", "owner_adamw_nvme", "second", "owner_adamw_nvme->flat3"),
        ("first", "owner_adafactor", "second", "owner_adafactor->owner1"),
        ("second", "flat_adamw", "third", "flat_adamw->owner1"),
    ],
)
def test_resume_across_partitions_world_sizes_and_stages(
    runs: dict[str, list[Any]], saved_in: str, saved: str, loaded_in: str, loaded: str
) -> None:
    reference = runs[saved_in][0][saved]
    for per_rank in runs[loaded_in]:
        _assert_same(reference, per_rank[loaded])


def test_owner_state_paged_from_nvme_is_the_state_in_memory(runs: dict[str, list[Any]]) -> None:
    """The full state of the run paged from NVMe equals the run offloaded to the CPU's (the same host step), in the
    parameters' shapes."""
    for per_rank in runs["first"]:
        _assert_same(per_rank["owner_adamw_cpu"], per_rank["owner_adamw_nvme"])


@pytest.mark.parametrize("saved", ["owner_adamw", "owner_adamw_cpu", "owner_adamw_nvme"])
def test_consolidated_owner_checkpoint_holds_state_in_the_parameters_shapes(
    runs: dict[str, list[Any]], tmp_path_factory: pytest.TempPathFactory, saved: str
) -> None:
    import lightning_zero

    out = tmp_path_factory.mktemp("consolidated") / f"{saved}.ckpt"
    lightning_zero.consolidate(Path(runs["root"]) / saved, out)
    consolidated = torch.load(out, weights_only=False)
    reference = runs["first"][0][saved]
    _assert_same(reference, {"params": consolidated["state_dict"], "optimizer": consolidated["optimizer_states"][0]})


def test_consolidated_adafactor_checkpoint_holds_the_whole_factors(
    runs: dict[str, list[Any]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    import lightning_zero

    root = Path(runs["root"])
    out = tmp_path_factory.mktemp("consolidated") / "adafactor.ckpt"
    lightning_zero.consolidate(root / "owner_adafactor", out)
    consolidated = torch.load(out, weights_only=False)
    saved = runs["first"][0]["owner_adafactor"]
    _assert_same(saved, {"params": consolidated["state_dict"], "optimizer": consolidated["optimizer_states"][0]})


def test_adafactor_factors_are_saved_whole_and_refused_by_flat_pieces(runs: dict[str, list[Any]]) -> None:
    factors = runs["first"][0]["owner_adafactor"]["optimizer"]["state"]
    assert any("row_var" in state and state["row_var"].dim() == 2 for state in factors.values())
    for per_rank in runs["third"]:
        message = per_rank["owner_adafactor->flat2"]
        assert message.startswith("CheckpointError"), message
        assert "row_var" in message or "col_var" in message
        assert "partition='parameter'" in message

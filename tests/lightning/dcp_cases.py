"""Rank-side cases of test_dcp_bridge.py: ZeroStrategy <-> torch.distributed.checkpoint (DCP) <-> FSDP2, all in one
spawn of 2 ranks. Each function returns plain data for the test to assert on."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler

from tests.lightning.models import BATCH_SIZE, TwoLayer, fit_case, make_loader

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LR = 1e-2


def run_all(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Every case in turn; a case that raises is reported by name with its traceback."""
    root = Path(directory)
    out: dict[str, Any] = {}
    for name, case in [
        ("zero_to_dcp", _zero_to_dcp),
        ("dcp_resume", _dcp_resume),
        ("fsdp_to_zero", _fsdp_to_zero),
        ("mps_to_zero", _mps_to_zero),
        ("zero_to_mps", _zero_to_mps),
        ("tied", _tied),
        ("mismatch", _mismatch),
    ]:
        try:
            out[name] = case(rank, world_size, root)
        except Exception:
            out[name] = {"error": f"rank {rank}, {name}:\n{traceback.format_exc()}"}
        dist.barrier()
    return out


SAMPLES = 16  # 2 steps per epoch on 2 ranks: a save after step 2 ends an epoch, so a resumed run continues exactly


def _two_layer_case(**kwargs: Any) -> dict[str, Any]:
    return {"model": "two_layer", "strategy": 3, "samples": SAMPLES, **kwargs}


def _zero_to_dcp(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """ZeroStrategy stage 3 (4 steps, saved sharded after 2) -> convert -> FSDP2 on 2 ranks and a plain model."""
    from lightning_zero import convert
    from lightning_zero.checkpoint import ShardedCheckpoint, full_checkpoint

    sharded, converted = root / "zero3.ckpt", root / "zero3-dcp"
    uninterrupted = fit_case(world_size, _two_layer_case(trainer={"max_steps": 4}, save_at=(2, str(sharded))))
    if rank == 0:
        convert(sharded, converted, to="dcp")
    dist.barrier()
    expected = full_checkpoint(ShardedCheckpoint(sharded))
    fsdp_model = TwoLayer()
    optimizer = _fsdp(fsdp_model)
    model_sd, optim_sd = get_state_dict(fsdp_model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=converted)
    set_state_dict(fsdp_model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded, loaded_optim = get_state_dict(fsdp_model, optimizer, options=FULL)  # collective; rank 0 gets the values
    out: dict[str, Any] = {"uninterrupted": uninterrupted["state"], "expected": expected["state_dict"]}
    if rank == 0:  # the full state dicts (cpu_offload) are rank 0's only; then a plain model, no process group used
        names = [name for name, _ in TwoLayer().named_parameters()]
        saved_optim = expected["optimizer_states"][0]
        out["fsdp"] = loaded
        out["fsdp_optim"] = {n: dict(loaded_optim["state"][n]) for n in names}
        out["expected_optim"] = {n: saved_optim["state"][i] for i, n in enumerate(names)}
        out["fsdp_lr"] = [g["lr"] for g in loaded_optim["param_groups"]]
        plain = TwoLayer()
        with torch.no_grad():
            for p in plain.parameters():
                p.zero_()
        plain_sd = {"model": plain.state_dict()}
        dcp.load(plain_sd, checkpoint_id=converted, no_dist=True)
        plain.load_state_dict(plain_sd["model"])
        out["plain"] = {k: v.clone() for k, v in plain.state_dict().items()}
    return out


def _dcp_resume(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """The converted directory (with Lightning's loop state in meta.pt) resumed by ZeroStrategy stage 1."""
    case = _two_layer_case(strategy=1, trainer={"max_steps": 4}, ckpt_path=str(root / "zero3-dcp"))
    resumed = fit_case(world_size, case)
    return {"state": resumed["state"], "global_step": resumed["global_step"]}


def _fsdp(model: torch.nn.Module) -> torch.optim.Optimizer:
    """FSDP2 as Lightning's ModelParallelStrategy applies it: each block, then the root; AdamW as TwoLayer's."""
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _batches(rank: int, world_size: int, steps: int, samples: int) -> list[tuple[Tensor, Tensor]]:
    """The batches Lightning feeds rank ``rank`` in its first ``steps`` steps (its DistributedSampler: shuffled with
    seed 0, epoch 0)."""
    dataset = make_loader("two_layer", samples).dataset
    indices = list(DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0))
    out = []
    for step in range(steps):
        chosen = indices[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
        x, y = zip(*(dataset[i] for i in chosen), strict=True)
        out.append((torch.stack(x), torch.stack(y)))
    return out


def _fsdp_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any]) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _fsdp_to_zero(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """FSDP2 trains 3 steps and saves with dcp.save(get_state_dict(...)) in torch's layout and in Lightning's; then
    FSDP2 and ZeroStrategy at stages 1, 2 and 3 each take 2 more steps on the batches Lightning feeds first."""
    model = TwoLayer()
    optimizer = _fsdp(model)
    gen = torch.Generator().manual_seed(5 + rank)
    _fsdp_steps(model, optimizer, [(torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen))] * 3)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "fsdp-torch")
    dcp.save({"state_dict": model_sd, "optimizer_0": optim_sd}, checkpoint_id=root / "fsdp-lightning")
    _fsdp_steps(model, optimizer, _batches(rank, world_size, 2, SAMPLES))
    reference = get_state_dict(model, optimizer, options=FULL)[0]
    resumed = {}
    for stage, layout in [(1, "torch"), (2, "lightning"), (3, "torch")]:
        case = _two_layer_case(strategy=stage, trainer={"max_steps": 2}, ckpt_path=str(root / f"fsdp-{layout}"))
        resumed[stage] = fit_case(world_size, case)["state"]
    return {"reference": reference, "resumed": resumed}


GROUPS = {"param_groups": True}  # TwoLayer with two param groups (own lr, weight decay) and a per-step LambdaLR
_KEEP = ("state", "start_step", "global_step")


def _mps_case(**kwargs: Any) -> dict[str, Any]:
    return {"model": "two_layer_fsdp", "strategy": "model_parallel", "samples": SAMPLES, **kwargs}


def _mps_to_zero(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """Lightning's ModelParallelStrategy (FSDP2) trains 4 steps, saving with trainer.save_checkpoint after 2 (a DCP
    directory with meta.pt); resumed from it by ModelParallelStrategy itself and by ZeroStrategy at stages 1-3; and
    the same with two param groups and an LR scheduler (GROUPS), resumed at stage 3."""
    out: dict[str, Any] = {}
    for label, kwargs, resumers in [("one_group", {}, ["model_parallel", 1, 2, 3]), ("groups", GROUPS, [3])]:
        saved = root / f"mps-{label}.ckpt"
        mps = _mps_case(trainer={"max_steps": 4}, model_kwargs=kwargs)
        uninterrupted = fit_case(world_size, {**mps, "save_at": (2, str(saved))})["state"]
        resumed = {}
        for resumer in resumers:
            # the same LightningModule class under either strategy ("model_parallel" or a ZeRO stage)
            run = fit_case(world_size, {**mps, "strategy": resumer, "ckpt_path": str(saved)})
            resumed[resumer] = {k: run[k] for k in _KEEP}
        out[label] = {"uninterrupted": uninterrupted, "resumed": resumed}
    return out


def _zero_to_mps(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """ZeroStrategy stage 3 saves after 2 of 4 steps (_zero_to_dcp's directory; here also with two param groups and
    an LR scheduler), convert writes it as DCP, ModelParallelStrategy resumes with fit(ckpt_path=...)."""
    from lightning_zero import convert

    sharded, converted = root / "zero3-groups.ckpt", root / "zero3-groups-dcp"
    case = _mps_case(strategy=3, trainer={"max_steps": 4}, model_kwargs=GROUPS)  # the class ModelParallel resumes
    uninterrupted = fit_case(world_size, {**case, "save_at": (2, str(sharded))})["state"]
    if rank == 0:
        convert(sharded, converted, to="dcp")
    dist.barrier()
    out: dict[str, Any] = {"groups_uninterrupted": uninterrupted}
    for label, directory, kwargs in [("one_group", root / "zero3-dcp", {}), ("groups", converted, GROUPS)]:
        run = fit_case(world_size, _mps_case(trainer={"max_steps": 4}, model_kwargs=kwargs, ckpt_path=str(directory)))
        out[label] = {k: run[k] for k in _KEEP}
    return out


def _tied(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    """TiedLM (head tied to the embedding; DCP holds both keys) at stage 3 -> convert -> resumed at stage 2."""
    from lightning_zero import convert

    case = {"model": "tied", "strategy": 3, "samples": SAMPLES, "trainer": {"max_steps": 4}}
    uninterrupted = fit_case(world_size, {**case, "save_at": (2, str(root / "tied.ckpt"))})["state"]
    if rank == 0:
        convert(root / "tied.ckpt", root / "tied-dcp", to="dcp")
    dist.barrier()
    resumed = fit_case(world_size, {**case, "strategy": 2, "ckpt_path": str(root / "tied-dcp")})["state"]
    return {"uninterrupted": uninterrupted, "resumed": resumed}


def _mismatch(rank: int, world_size: int, root: Path) -> str:
    """A DCP directory of TwoLayer resumed into TiedLM: the error, as each rank sees it."""
    case = {"model": "tied", "strategy": 3, "samples": 16, "ckpt_path": str(root / "fsdp-torch")}
    try:
        fit_case(world_size, case)
    except Exception as error:
        return str(error)
    return "no error"

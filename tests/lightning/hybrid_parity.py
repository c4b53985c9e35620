"""Hybrid sharding across nodes at the Lightning level: DDP, ZeRO 1-3 with ``shard_size`` and flat ZeRO-3, one launch.

tests/lightning/test_multinode.py runs this script with the torchrun recipe of docs/launching.md (2 nodes x 2
processes on two network hosts), passing the recipe's ``--trainer.strategy.init_args.shard_size=K``. In one process
group every rank fits, in turn, Lightning's ``DDPStrategy``, ``ZeroStrategy(stage=s, shard_size=K)`` for s = 1, 2, 3,
the flat ``ZeroStrategy(stage=3)``, and that with ZeRO++'s options (``secondary_shard_size`` alone, then with
``quantize_weights`` and ``quantize_gradients`` too): each from the same initial weights (the model seeds itself) on
the same per-rank data (Lightning's ``DistributedSampler``), fp32, accumulating 2 batches, clipping the gradient
norm, SGD with momentum (an element-wise optimizer that does not amplify last-bit differences as Adam's
``1/(sqrt(v)+eps)`` does on near-zero gradients). Every rank also trains a reordered DDP equivalent alone (every
rank's samples one by one, in reverse order): its distance to DDP is the spread that rounding alone gives, so a
tolerance above it is meaningful.

Per fit every rank records the final parameters' largest relative difference to DDP's, ``comm_report()`` of the
last optimizer step and the bytes its node's link interface received and sent during the fit (``/proc/net/dev``:
the counters of this process's network namespace). Global rank 0 writes them all to :data:`RESULT` in its working
directory.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from lightning_zero import ZeroStrategy
from tests.lightning.models import (
    BATCH_SIZE,
    TwoLayer,
    make_loader,
    make_strategy,
    make_trainer,
    max_rel_diff,
    state_of,
)

RESULT = "hybrid_parity.json"
NODES, DEVICES = 2, 2
STEPS, ACCUMULATE, CLIP = 4, 2, 0.05
# Linear(7, 2048) + Linear(2048, 3): 22531 elements (odd, so the shards end in padding), enough that the steps'
# traffic, not the fits' setup, dominates the link's counters.
MODEL = {"hidden": 2048, "optimizer": "sgd", "lr": 0.1}
# The stage-3 units of wrap_policy={nn.Linear}: each Linear's buffer, as (numel, dims) of its weight and bias.
UNIT_TENSORS = (((7 * 2048, 2), (2048, 1)), ((2048 * 3, 2), (3, 1)))
SAMPLES = NODES * DEVICES * BATCH_SIZE * ACCUMULATE * STEPS  # one epoch


def _link_bytes() -> tuple[int, int]:
    """(received, sent) bytes of this namespace's link interface (``GLOO_SOCKET_IFNAME``)."""
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    with open("/proc/self/net/dev") as handle:
        for line in handle:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    raise RuntimeError(f"interface {interface!r} (GLOO_SOCKET_IFNAME) is not in /proc/self/net/dev")


def _fit(strategy: Any) -> dict[str, Any]:
    """Fit a fresh model under ``strategy`` (``"ddp"`` or a ``ZeroStrategy``); its parameters, step and traffic."""
    model = TwoLayer(**MODEL)
    trainer = make_trainer(
        DEVICES,
        make_strategy({"strategy": "ddp"}) if strategy == "ddp" else strategy,
        num_nodes=NODES,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        precision="32-true",
    )
    if dist.is_initialized():  # the first fit creates the process group
        dist.barrier()
    before = _link_bytes()
    trainer.fit(model, make_loader("two_layer", SAMPLES))
    dist.barrier()
    after = _link_bytes()
    record: dict[str, Any] = {
        "global_step": trainer.global_step,
        "link_rx": after[0] - before[0],
        "link_tx": after[1] - before[1],
    }
    if isinstance(trainer.strategy, ZeroStrategy):
        with trainer.strategy.gathered_params():  # stage 3 keeps only shards after fit
            record["state"] = state_of(model)
        stats = trainer.strategy.comm_report()
        record["comm"] = {
            "nbytes": stats.nbytes,
            "calls": stats.calls,
            "by_op": dict(stats.by_op),
            "intra_node_bytes": stats.intra_node_bytes,
            "inter_node_bytes": stats.inter_node_bytes,
        }
    else:
        record["state"] = state_of(model)
    return record


def _reordered(world_size: int) -> tuple[dict[str, Tensor], list[float]]:
    """DDP's training in one process, summing the same gradients in another order; the parameters and the gradient
    norms before clipping (clipping must act for the runs to test it)."""
    model = TwoLayer(**MODEL)
    optimizer = model.configure_optimizers()
    dataset = make_loader("two_layer", SAMPLES).dataset
    # Lightning gives each rank of a fit a DistributedSampler, shuffled (the training data always is) with the seed
    # PL_GLOBAL_SEED or 0, epoch 0: rank r's batch b is its samples 4b..4b+3.
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    per_rank = [list(DistributedSampler(dataset, world_size, rank, seed=seed)) for rank in range(world_size)]
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in reversed(range(world_size)):
            for micro in reversed(range(ACCUMULATE)):
                start = (step * ACCUMULATE + micro) * BATCH_SIZE
                for index in reversed(per_rank[rank][start : start + BATCH_SIZE]):
                    x, y = dataset[index]
                    loss = nn.functional.mse_loss(model(x[None]), y[None])
                    (loss / (BATCH_SIZE * ACCUMULATE * world_size)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
    return state_of(model), norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer.strategy.init_args.shard_size", dest="shard_size", type=int, required=True)
    shard_size = parser.parse_args().shard_size
    runs = {"ddp": _fit("ddp")}
    for stage in (1, 2, 3):
        policy = {"wrap_policy": {nn.Linear}} if stage == 3 else {}
        runs[f"hybrid{stage}"] = _fit(ZeroStrategy(stage=stage, shard_size=shard_size, **policy))
    runs["flat3"] = _fit(ZeroStrategy(stage=3, wrap_policy={nn.Linear}))
    # ZeRO++ on flat stage 3: the secondary shard alone (bit for bit flat3), then all three of its options.
    zeropp = {"stage": 3, "wrap_policy": {nn.Linear}, "secondary_shard_size": DEVICES}
    runs["hpz3"] = _fit(ZeroStrategy(**zeropp))
    runs["zeropp3"] = _fit(ZeroStrategy(**zeropp, quantize_weights=True, quantize_gradients=True))
    reference = runs["ddp"]["state"]
    reordered, norms = _reordered(dist.get_world_size())
    mine = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "spread": max(max_rel_diff(reference, reordered).values()),
        "grad_norms": norms,
        "runs": {
            name: {
                **{key: value for key, value in run.items() if key != "state"},
                "difference": max(max_rel_diff(reference, run["state"]).values()),
                "equals_flat3": all(torch.equal(t, runs["flat3"]["state"][k]) for k, t in run["state"].items()),
            }
            for name, run in runs.items()
        },
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        result = {"shard_size": shard_size, "numel": sum(t.numel() for t in reference.values()), "ranks": everyone}
        with open(RESULT, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()

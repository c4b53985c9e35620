"""The systems of ``benchmarks/hybrid_link.py``: the ones of ``systems`` (DDP, FSDP2, the engine at stages 2 and 3)
and two that shard inside a node and replicate across nodes: FSDP2's HSDP and the engine with ``shard_size``.

Nodes are blocks of consecutive ranks (ranks 0 and 1 on node 0, 2 and 3 on node 1), as torchrun and SLURM number
them. FSDP2's HSDP takes a 2-D mesh ``(replicate, shard)``: ``init_device_mesh`` lays the ranks out row-major, so
mesh ``[[0, 1], [2, 3]]`` puts each shard group (a row) inside a node and each replicate group (a column) across
the nodes.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.distributed as dist

from examples.gpt import GPTConfig
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions

from .systems import DDPSystem, FSDP2System, System, ZeroSystem, make_adamw, make_model

# ZeRO++ (issue 27): flat stage 3 with quantized weight gathers (qw), quantized gradients (qg), the secondary shard
# inside a node (hp), or all three (pp); the secondary groups are a node's ranks (--shard-size).
ZEROPP_SYSTEMS = {
    "zero3_qw": {"quantize_weights": True},
    "zero3_qg": {"quantize_gradients": True},
    "zero3_hp": {"secondary_shard_size": "node"},
    "zero3_pp": {"quantize_weights": True, "quantize_gradients": True, "secondary_shard_size": "node"},
}
# quantize_gradients beside zero3_qg, on request: at stage 2, with shard_size (its replicas' exchange quantized), and
# with quantize_weights
QG_VARIANTS = {
    "zero2_qg": {"quantize_gradients": True},
    "zero3_hybrid_qg": {"shard_size": "node", "quantize_gradients": True},
    "zero3_qwqg": {"quantize_weights": True, "quantize_gradients": True},  # all three less the (exact) secondary
}
HYBRID_SYSTEMS = (
    *("ddp", "fsdp2", "fsdp2_hsdp", "zero2", "zero3", "zero2_hybrid", "zero3_hybrid"),
    *ZEROPP_SYSTEMS,
    *QG_VARIANTS,
)
DEFAULT_SYSTEMS = ("ddp", "fsdp2", "fsdp2_hsdp", "zero2", "zero3", "zero3_hybrid", *ZEROPP_SYSTEMS)
REFERENCE = "zero3"  # the ratios of the table are to flat stage 3's step time


class HSDPSystem(FSDP2System):
    """``fsdp2_hsdp``: ``fully_shard`` per block and on the root over a 2-D mesh (replicate across nodes, shard
    inside one): parameters gathered inside the node, gradients reduce-scattered inside it and then all-reduced
    across the nodes, shard by shard."""

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        world = dist.get_world_size()
        shape = (world // args.shard_size, args.shard_size)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("replicate", "shard"))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = make_adamw(self.model, args.lr)
        self.numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)


class HybridZeroSystem(ZeroSystem):
    """``zero2_hybrid``, ``zero3_hybrid``: the engine with ``EngineOptions(stage=..., shard_size=...)``, fp32; the
    ZeRO++ systems (:data:`ZEROPP_SYSTEMS`): flat stage 3 with their options.

    Cores without the option raise here (``TypeError``: no such field; ``NotImplementedError``: declared, not
    built yet); ``hybrid_link.py`` reports the row as unavailable and goes on.
    """

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        self.optimizer = make_adamw(self.model, args.lr)
        stage = int(name[4])
        extra: dict[str, Any] = {"shard_size": args.shard_size} if name.endswith("_hybrid") else {}
        for option, value in {**ZEROPP_SYSTEMS, **QG_VARIANTS}.get(name, {}).items():
            extra[option] = args.shard_size if value == "node" else value
        options = EngineOptions(stage=stage, bucket_cap_mb=args.bucket_cap_mb, **extra)
        self.policy = None
        self.engine = ZeroEngine(self.model, [self.optimizer], options, Communicator(group), device=self.device)
        self.last_comm = {}


def build_hybrid_system(name: str, cfg: GPTConfig, args: argparse.Namespace) -> System:
    """``name`` over the world group (all of them are fp32)."""
    if name not in HYBRID_SYSTEMS:
        raise ValueError(f"unknown system {name!r}; choose from {HYBRID_SYSTEMS}")
    group = dist.group.WORLD
    if name == "ddp":
        return DDPSystem(name, cfg, args, group)
    if name == "fsdp2":
        return FSDP2System(name, cfg, args, group)
    if name == "fsdp2_hsdp":
        return HSDPSystem(name, cfg, args, group)
    if name.endswith("_hybrid") or name in ZEROPP_SYSTEMS or name in QG_VARIANTS:
        return HybridZeroSystem(name, cfg, args, group)
    return ZeroSystem(name, cfg, args, group)

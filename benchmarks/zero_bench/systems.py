"""How each compared system is built and stepped: DDP, torch's ZeroRedundancyOptimizer, FSDP2, the engine at stages
1-3 (with offload, whole-tensor owners, bf16-mixed) and an earlier commit's engine (``base1``-``base3``).

Every system starts from the same seeded GPT and steps the same AdamW (``make_adamw``); ``step`` returns its phase
times, ``memory`` its model-state bytes counted from the tensors, ``comm_bytes`` the bytes its collectives moved.
The engine is driven directly in a plain PyTorch loop (no Trainer), so the numbers measure the sharding.
"""

from __future__ import annotations

import argparse
import os
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from examples.gpt import GPT, GPTConfig
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions

from .names import BASELINE_ENV, FUSED_ENV, base_system, device_for, is_bf16, now, offload_of, partition_of


def make_model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def make_adamw(model: nn.Module, lr: float, matrices: set[int] | None = None) -> torch.optim.AdamW:
    """AdamW as in examples/gpt.py: weight decay on matrices only.

    ``matrices``: the ``id``s of the matrices, read before a wrapper flattened them (Lightning's FSDP with
    ``use_orig_params=True`` keeps the parameters, as 1-D views of its shards); ``None``: ``p.dim() >= 2`` now.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if matrices is None:
        matrices = {id(p) for p in params if p.dim() >= 2}
    decay = [p for p in params if id(p) in matrices]
    no_decay = [p for p in params if id(p) not in matrices]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = True if os.environ.get(FUSED_ENV) == "1" else None  # --adamw-fused (offload picks it itself otherwise)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


class System:
    """One way of training the GPT; ``step`` runs one optimizer step and returns its phase times.

    Systems named ``*_bf16`` run their forward (and loss) under ``torch.autocast(dtype=torch.bfloat16)``.
    """

    name: str
    model: nn.Module  # the GPT itself (not a wrapper)
    optimizer: Any
    device: torch.device  # where the model and the batches live
    autocast_cache = True  # torch.autocast's default, as Lightning's MixedPrecision

    def _setup(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.bf16 = is_bf16(name)
        self.device = device_for(dist.get_rank(), args)

    def forward_context(self) -> AbstractContextManager:
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=self.autocast_cache)

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        raise NotImplementedError

    def comm_bytes(self) -> int:
        raise NotImplementedError

    def full_state(self) -> dict[str, Tensor]:
        """Every parameter in full (a collective for the sharded systems)."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _timed_step(system: System, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """zero_grad, forward, backward and step of a system whose wrapper does all its communication itself."""
    device, optimizer = system.device, system.optimizer
    t0 = now(device)
    optimizer.zero_grad()
    with system.forward_context():
        loss = lm_loss(model, x, y)
    t1 = now(device)
    loss.backward()
    t2 = now(device)
    optimizer.step()
    t3 = now(device)
    return {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}


class DDPSystem(System):
    """``ddp``, ``ddp_bf16`` (``gradient_as_bucket_view=True``) and ``ddp_copy`` (DDP's defaults).

    ``ddp_bf16`` is what Lightning's DDP does for ``precision="bf16-mixed"``: fp32 parameters, gradients and
    AdamW states, the forward under bf16 autocast, and the fp32 gradients all-reduced.
    """

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        self.ddp = DistributedDataParallel(
            self.model,
            process_group=group,
            gradient_as_bucket_view=(base_system(name) == "ddp"),
            bucket_cap_mb=args.bucket_cap_mb,
        )
        self.optimizer = make_adamw(self.model, args.lr)
        self.numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        return _timed_step(self, self.ddp, x, y)  # the all-reduce overlaps backward, waited at its end

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        states = [v for s in self.optimizer.state.values() for v in s.values()]
        return {
            "params": tensor_bytes(params),
            "gradients": tensor_bytes(p.grad for p in params),
            "optimizer_states": tensor_bytes(states),
        }

    def comm_bytes(self) -> int:
        # [Note: counting communication]: an all-reduce of a 4Ψ-byte fp32 buffer counts 2 x 4Ψ (also ddp_bf16,
        # whose gradients are fp32).
        return 2 * 4 * self.numel


class TorchZero1System(DDPSystem):
    """PyTorch's own stage 1: DDP (``gradient_as_bucket_view=True``) + ``ZeroRedundancyOptimizer`` over AdamW.

    ``ZeroRedundancyOptimizer`` shards whole parameters (each rank owns a subset of the tensors, balanced by
    size), not flat slices, so its optimizer state per rank is only about 8Ψ/N. After its local step it
    broadcasts each rank's updated parameters to the others.
    """

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        self.ddp = DistributedDataParallel(
            self.model, process_group=group, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_cap_mb
        )
        groups = make_adamw(self.model, args.lr).param_groups  # the same two groups and hyper-parameters
        hyper = {"lr": groups[0]["lr"], "betas": groups[0]["betas"]}  # as make_adamw; the rest are AdamW's defaults
        kwargs = {"optimizer_class": torch.optim.AdamW, "process_group": group, **hyper}
        try:
            self.optimizer = ZeroRedundancyOptimizer(
                [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups], **kwargs
            )
        except (TypeError, ValueError):  # older torch: no param groups at construction
            self.optimizer = ZeroRedundancyOptimizer(
                groups[0]["params"], weight_decay=groups[0]["weight_decay"], **kwargs
            )
            self.optimizer.add_param_group({"params": groups[1]["params"], "weight_decay": groups[1]["weight_decay"]})
        self.numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        states = [v for s in self.optimizer.optim.state.values() for v in s.values()]  # this rank's shard only
        return {
            "params": tensor_bytes(params),
            "gradients": tensor_bytes(p.grad for p in params),
            "optimizer_states": tensor_bytes(states),
        }

    def comm_bytes(self) -> int:
        # Not measured: DDP's gradient all-reduce (2 x 4Ψ) plus the parameter broadcasts after the step (4Ψ).
        return 2 * 4 * self.numel + 4 * self.numel


class ZeroSystem(System):
    """``zero1``-``zero3`` (fp32) and ``zero1_bf16``-``zero3_bf16``: the engine with
    ``PrecisionPolicy(bfloat16, float32, float32)`` (bf16 parameters and gradients, gradients reduced in fp32,
    fp32 masters), the forward under bf16 autocast as ``ZeroPrecision("bf16-mixed")`` runs it."""

    autocast_cache = False  # as ZeroPrecision.forward_context

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        self.optimizer = make_adamw(self.model, args.lr)
        target, params = offload_of(name)
        config = EngineOptions(
            stage=int(base_system(name)[4]),
            bucket_cap_mb=args.bucket_cap_mb,
            offload_optimizer=target,
            offload_params=params,
            nvme_path=getattr(args, "nvme_path", None),
            partition=partition_of(name),
        )
        self.policy = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32) if self.bf16 else None
        self.engine = ZeroEngine(
            self.model, [self.optimizer], config, Communicator(group), device=self.device, precision=self.policy
        )
        self.last_comm: dict[str, Any] = {}

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        device = self.device
        t0 = now(device)
        self.engine.begin_iteration()  # what ZeroStrategy runs before each training_step (one small all-reduce)
        t1 = now(device)
        self.optimizer.zero_grad()
        with self.forward_context():
            loss = lm_loss(self.model, x, y)
        t2 = now(device)
        # announced, as ZeroStrategy and ZeroFabricStrategy do: stage 3's backward plan and its prefetch
        self.engine.scale_loss(loss).backward()  # hooks fill the buckets; reduce-scatters overlap backward
        self.engine.finish_backward()  # a no-op here: every rank's backward reached the hooks
        t3 = now(device)
        self.engine.step_of(self.optimizer).prepare()  # bf16: fp32 gradients for the masters; fp32: the held ones
        t4 = now(device)
        self.optimizer.step()  # the step window, then masters rounded and (stages 1, 2) the new shards gathered
        t5 = now(device)
        self.last_comm = comm_counts(self.engine.last_step_comm)
        return phase_times(t0, t1, t2, t3, t4, t5)

    def memory(self) -> dict[str, int]:
        report = self.engine.memory_report()  # bf16: the fp32 masters are counted under optimizer_states
        return {"params": report.params, "gradients": report.gradients, "optimizer_states": report.optimizer_states}

    def comm_bytes(self) -> int:
        return self.last_comm["nbytes"]

    def owned_elements(self) -> tuple[int, int]:
        """Trained elements of the most and least loaded rank (their AdamW state is 8 bytes each)."""
        report = self.engine.memory_report()
        return report.owned_max, report.owned_min

    def full_state(self) -> dict[str, Tensor]:
        if self.policy is None:
            with self.engine.gathered():  # stage 3 holds shards only; a no-op for stages 1 and 2
                return super().full_state()
        # bf16: the fp32 masters, which the optimizer updates (the module holds their bf16 rounding).
        state = self.engine.full_state_dict(keep=True)  # a collective; every rank keeps the result
        return {name: state[name] for name, _ in self.model.named_parameters()}  # the tied lm_head once


class FSDP2System(System):
    """PyTorch FSDP2: ``fully_shard`` per transformer block and on the root, the same units as zero3's default.

    ``fsdp2_bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (fp32 sharded
    parameters, gathered and computed in bf16, gradients reduced in fp32) and the forward under bf16 autocast.
    """

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, self.device.type)
        dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if self.bf16 else {}
        mp_policy = MixedPrecisionPolicy(**dtypes)  # no dtypes: the default policy, plain fp32
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
        fully_shard(self.model, mesh=mesh, mp_policy=mp_policy)
        self.optimizer = make_adamw(self.model, args.lr)
        self.numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        return _timed_step(self, self.model, x, y)

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        states = [v for s in self.optimizer.state.values() for v in s.values()]
        return {
            "params": tensor_bytes(p.to_local() for p in params),
            "gradients": tensor_bytes(p.grad.to_local() for p in params if p.grad is not None),
            "optimizer_states": tensor_bytes(v.to_local() if hasattr(v, "to_local") else v for v in states),
        }

    def comm_bytes(self) -> int:
        # Not measured: forward all-gather and backward all-gather of the parameters (4Ψ bytes each, bf16: 2Ψ)
        # and the reduce-scatter of the gradients (4Ψ, fp32 in both), as in the ZeRO paper.
        gathered = 2 if self.bf16 else 4
        return (2 * gathered + 4) * self.numel

    def full_state(self) -> dict[str, Tensor]:
        return {name: p.full_tensor().detach().clone() for name, p in self.model.named_parameters()}


class BaselineZeroSystem(ZeroSystem):
    """``base1``-``base3`` (and ``*_bf16``): the core of an earlier commit, prepared by ``benchmarks/ab_core.py``
    under another package name, in the same interleaved run as the current one. Older cores took a ``ZeroConfig``
    and finished a step with ``finish_step``; the calls they lack are skipped, the figures they lack are ``None``."""

    def __init__(self, name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> None:
        import importlib

        package = os.environ[BASELINE_ENV]
        engine_module = importlib.import_module(f"{package}.core.engine")
        comm_module = importlib.import_module(f"{package}.core.comm")
        precision_module = importlib.import_module(f"{package}.core.mixed_precision")
        try:
            options = importlib.import_module(f"{package}.core.options").EngineOptions
        except ImportError:
            options = importlib.import_module(f"{package}.config").ZeroConfig
        self._setup(name, args)
        self.model = make_model(cfg, args.seed).to(self.device)
        self.optimizer = make_adamw(self.model, args.lr)
        config = options(stage=int(base_system(name)[-1]), bucket_cap_mb=args.bucket_cap_mb)
        policy_type = precision_module.PrecisionPolicy
        self.policy = policy_type(torch.bfloat16, torch.float32, torch.float32) if self.bf16 else None
        communicator = comm_module.Communicator(group)
        self.engine = engine_module.ZeroEngine(
            self.model, [self.optimizer], config, communicator, device=self.device, precision=self.policy
        )
        self.last_comm = {}

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        device, engine = self.device, self.engine
        t0 = now(device)
        getattr(engine, "begin_iteration", lambda: None)()
        t1 = now(device)
        self.optimizer.zero_grad()
        with self.forward_context():
            loss = lm_loss(self.model, x, y)
        t2 = now(device)
        getattr(engine, "scale_loss", lambda loss: loss)(loss).backward()
        getattr(engine, "finish_backward", lambda: None)()
        t3 = now(device)
        engine.step_of(self.optimizer).prepare()
        t4 = now(device)
        self.optimizer.step()
        getattr(engine, "finish_step", lambda optimizer: None)(self.optimizer)
        t5 = now(device)
        self.last_comm = comm_counts(engine.last_step_comm)
        return phase_times(t0, t1, t2, t3, t4, t5)

    def owned_elements(self) -> tuple[int, int] | None:
        """As the current core's; ``None`` from cores whose memory report does not count them (before 5954420)."""
        report = self.engine.memory_report()
        return (report.owned_max, report.owned_min) if hasattr(report, "owned_max") else None


def build_system(name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> System:
    base = base_system(name)
    if base.startswith("base"):
        return BaselineZeroSystem(name, cfg, args, group)
    if base.startswith("ddp"):
        return DDPSystem(name, cfg, args, group)
    if base == "zero1_torch":
        return TorchZero1System(name, cfg, args, group)
    return FSDP2System(name, cfg, args, group) if base == "fsdp2" else ZeroSystem(name, cfg, args, group)


def comm_counts(stats: Any) -> dict[str, Any]:
    """The engine's bytes of the last step, as the report stores them."""
    return {"nbytes": stats.nbytes, "calls": stats.calls, "by_op": dict(stats.by_op)}


def phase_times(t0: float, t1: float, t2: float, t3: float, t4: float, t5: float) -> dict[str, float]:
    """Seconds of each phase of a ZeRO step, from the clock readings between them."""
    return {
        "begin_iteration": t1 - t0,
        "forward": t2 - t1,
        "backward": t3 - t2,
        "prepare_step": t4 - t3,
        "optimizer": t5 - t4,
    }

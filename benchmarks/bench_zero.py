"""Benchmark: DDP, lightning-zero stages 1-3 and FSDP2 on one GPT, fp32 and bf16-mixed, in one run, interleaved.

Run on demand (never from the tests), from the repository root with the package installed::

    python benchmarks/bench_zero.py                        # ~25M-parameter GPT, 2 gloo ranks
    python benchmarks/bench_zero.py --out benchmarks/out/zero.json
    python benchmarks/bench_zero.py --params 5e6 --steps 5 --warmup 2 --rss-steps 2   # quick smoke run
    python benchmarks/bench_zero.py --systems ddp,zero2,ddp_bf16,zero2_bf16,zero3_bf16,fsdp2_bf16
    python benchmarks/bench_zero.py --device cuda          # NCCL, rank r on cuda:r (NOT RUN YET, see below)

What it does
------------
1. **Timing run.** ``--world-size`` processes are spawned once (``torch.multiprocessing``, gloo, one
   torch thread each). Every rank builds every system in ``--systems`` from the same seed, so all
   start from identical weights, and draws one fixed stream of batches (seed + rank) that every
   system trains on. The systems are *interleaved*: step ``i`` of every system runs in round ``i``,
   and the order inside a round rotates, so machine noise hits all of them alike. Each timed step
   starts after a barrier; a step's time is the slowest rank's. AdamW, in the precision of each system
   (fp32, or bf16-mixed for the ``*_bf16`` systems). The core
   :class:`~lightning_zero.core.engine.ZeroEngine` is driven directly in a plain PyTorch loop (no
   Trainer), so the numbers measure the sharding, not Lightning.
2. **Shared machines.** After each round the ranks compare the machine's busy CPU time
   (``/proc/stat``) with their own: a round in which other processes used more than
   ``--max-foreign`` of the CPUs is *disturbed*. Rounds go on until ``--steps`` undisturbed ones were
   measured (at most ``--max-rounds``), and the statistics use only those when there are enough
   (else all rounds, flagged NOISY in the output).
3. **RSS runs.** Peak RSS (``ru_maxrss``) is per process, so it cannot be split between systems that
   share one. For each system the ranks are spawned again, build only that system and run
   ``--rss-steps`` steps; this is done once with the environment as is and once with
   ``MALLOC_MMAP_THRESHOLD_=65536``. A fixed glibc mmap threshold turns off glibc's dynamic threshold,
   which otherwise (after the first free of a large block) serves blocks of up to 32 MiB from the
   heap, where freed memory may stay resident: with it the peak follows live memory instead of the
   allocator's history. Both variants are reported (``--rss-variants``).

Systems, fp32: ``ddp`` (``DistributedDataParallel``, ``gradient_as_bucket_view=True``: gradients live in
its buckets, 16Ψ bytes of model states), ``ddp_copy`` (DDP defaults: a separate bucket copy of the
gradients, 4Ψ more that the tensor count does not see), ``zero1``, ``zero2``, ``zero3``, ``fsdp2``, and
``zero1_torch`` (DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` over AdamW, PyTorch's stage 1).

Systems with whole-tensor owners (``partition="parameter"``): ``zero1_owner``-``zero3_owner`` and their
``_bf16`` variants; the summary adds the trained elements of the most and least loaded rank
(``owned_elements_max_min``); their formula is the flat one (the most loaded rank's excess is the imbalance).

Systems, bf16-mixed (forward and loss under ``torch.autocast(dtype=torch.bfloat16)``, gradients reduced
in fp32, AdamW updating fp32 values): ``ddp_bf16`` (as ``ddp``, with fp32 parameters: what Lightning's
DDP does for ``precision="bf16-mixed"``; 16Ψ), ``zero1_bf16``, ``zero2_bf16``, ``zero3_bf16`` (the
engine with ``PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)``: bf16 parameters and
gradients, fp32 master shards; ``prepare_step`` makes the masters' fp32 gradients) and ``fsdp2_bf16``
(``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
fp32 shards, gathered in bf16). Each system is compared with the DDP of its own precision: step-time
ratios with ``ddp_bf16`` (and, as for every system, with ``ddp``), final parameters with ``ddp_bf16``
(with ``ddp``, said so, if ``ddp_bf16`` is not in the run). ZeRO's parameters there are its fp32
masters (``engine.full_state_dict(keep=True)``). ``ddp_bf16`` is not the same maths as ``zero*_bf16``
either: its LayerNorms, embeddings and residual stream stay in fp32, theirs hold bf16 parameters; so
only the zero*_bf16 systems are bit-equal among themselves.

Reported per system: median step time, its ratio to ``ddp``'s median and the median of the per-round
ratios, the same two against the same-precision DDP, tokens/s, per-phase times and minor page faults
per step, per-rank model-state bytes counted from the tensors (ZeRO: ``engine.memory_report()``, which
counts the fp32 masters under optimizer states; DDP and FSDP2: param + grad + optimizer-state bytes),
the ZeRO-paper formula (fp32 Adam: DDP 16Ψ, stage 1 4Ψ+4Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 and FSDP2
16Ψ/N; bf16-mixed, section 3.1: DDP 16Ψ, stage 1 4Ψ+12Ψ/N, stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N, FSDP2's
fp32 shards 16Ψ/N; Ψ trainable parameters, N ranks) and measured/formula, bytes moved by collectives
per step (ZeRO: ``engine.last_step_comm.nbytes``; DDP, ``ddp_bf16`` too: 2 x 4Ψ, the all-reduce of the
fp32 gradients counted as in [Note: counting communication] of ``lightning_zero/core/comm/communicator.py``; FSDP2,
not measured: 3 x 4Ψ, bf16 2Ψ + 2Ψ + 4Ψ), RSS per rank (peak, and after the last step) and, after the
run, the largest per-tensor relative parameter difference and the relative L2 difference of all
parameters from the same-precision DDP. See docs/benchmarks.md for results.

GPUs (``--device cuda``; NOT RUN YET: written and read, never executed, as no GPU was at hand): NCCL for
the world group and every per-system group, ``torch.cuda.set_device(rank)`` before it starts, models and
batches on ``cuda:{rank}`` (one node, a GPU per rank), ``torch.cuda.synchronize()`` before every reading of
the clock in a step (so step and phase times include the GPU work), FSDP2's mesh and autocast on
``"cuda"``, and the RSS runs also report ``torch.cuda.max_memory_allocated()`` (reset before the system is
built) as the GPU peak. The ``/proc/stat`` filter still measures the CPUs. All of it lives in the helpers
under "names and devices" (``device_for``, ``backend_for``, ``sync``, ``now``, ...) and ``bind_device``;
with ``--device cpu`` (the default) they change nothing.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import queue as queue_module
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # for `examples.gpt` (also in the spawned ranks, which re-import this file)
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from examples.gpt import DEFAULT_DATA, GPT, GPTConfig, gpt_config_for_params  # noqa: E402
from lightning_zero.core.comm import Communicator  # noqa: E402
from lightning_zero.core.engine import ZeroEngine  # noqa: E402
from lightning_zero.core.mixed_precision import PrecisionPolicy  # noqa: E402
from lightning_zero.core.options import EngineOptions  # noqa: E402

BF16 = "_bf16"  # suffix of the bf16-mixed systems
SYSTEMS = (
    "ddp",
    "ddp_copy",
    "zero1",
    "zero2",
    "zero3",
    "fsdp2",
    "zero1_torch",
    "base1",
    "base2",
    "base3",
    *(f"{base}{BF16}" for base in ("ddp", "zero1", "zero2", "zero3", "fsdp2", "base1", "base2", "base3")),
)
# Offload systems: the engine with the optimizer on the CPU ("_cpu"), paged from a swap file in --nvme-path
# ("_nvme"), and at stage 3 with the parameter shards on the host ("_cpuparams") or on NVMe too ("_nvmeparams");
# "_bf16" after that.
OFFLOADS = {
    "_cpu": ("cpu", False),
    "_nvme": ("nvme", False),
    "_cpuparams": ("cpu", "cpu"),
    "_nvmeparams": ("nvme", "nvme"),
}
_OFFLOADED = tuple(
    f"zero{stage}{suffix}" for suffix in OFFLOADS for stage in (1, 2, 3) if stage == 3 or "params" not in suffix
)
SYSTEMS = (*SYSTEMS, *_OFFLOADED, *(f"{name}{BF16}" for name in _OFFLOADED))
# Whole-tensor owners (partition="parameter"): "zero2_owner", "zero2_owner_bf16", ...
OWNER = "_owner"
_OWNERS = tuple(f"zero{stage}{OWNER}" for stage in (1, 2, 3))
SYSTEMS = (*SYSTEMS, *_OWNERS, *(f"{name}{BF16}" for name in _OWNERS))
# base1-base3: an earlier commit's core, imported under the package name in this variable (see ab_core.py).
BASELINE_ENV = "BENCH_BASELINE_PACKAGE"
RSS_VARIANTS = {"as-is": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}  # process-group backend per --device
_TIMEOUT_S = 1800


# ----------------------------------------------------------------------------- names and devices


def is_bf16(name: str) -> bool:
    return name.endswith(BF16)


def base_system(name: str) -> str:
    """``zero2_bf16`` -> ``zero2``: how the system shards, whatever its precision."""
    return name.removesuffix(BF16)


def offload_of(name: str) -> tuple[str | bool, str | bool]:
    """``zero2_nvme_bf16`` -> ``("nvme", False)``: the system's (offload_optimizer, offload_params)."""
    base = base_system(name)
    for suffix, offload in OFFLOADS.items():
        if base.endswith(suffix):
            return offload
    return False, False


def partition_of(name: str) -> str:
    """``zero2_owner_bf16`` -> ``"parameter"``; every other system shards ``"flat"``."""
    return "parameter" if base_system(name).endswith(OWNER) else "flat"


def same_precision_ddp(name: str) -> str:
    """The DDP of ``name``'s precision: what its step time and parameters are compared with."""
    return f"ddp{BF16}" if is_bf16(name) else "ddp"


def device_type(args: argparse.Namespace) -> str:
    return getattr(args, "device", "cpu")  # benchmarks/sweep.py builds systems with a namespace of its own


def backend_for(args: argparse.Namespace) -> str:
    return BACKENDS[device_type(args)]


def device_for(rank: int, args: argparse.Namespace) -> torch.device:
    """Where rank ``rank`` keeps its model and batches: ``cuda:{rank}`` (one node, one GPU per rank) or the CPU."""
    return torch.device("cuda", rank) if device_type(args) == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a GPU step is over when its kernels are, not when they are queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` is done; every step time is read with it."""
    sync(device)
    return time.perf_counter()


def reset_accelerator_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def accelerator_bytes(device: torch.device, peak: bool) -> int | None:
    """``torch.cuda.max_memory_allocated`` (``peak``) or ``memory_allocated``; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


# ----------------------------------------------------------------------------- systems


def make_model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def make_adamw(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW as in examples/gpt.py: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    fused = True if os.environ.get(FUSED_ENV) == "1" else None  # --adamw-fused (offload picks it itself otherwise)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused)


FUSED_ENV = "BENCH_ADAMW_FUSED"


def disk_bandwidth(path: str, nbytes: int = 256 * 2**20, chunk: int = 8 * 2**20) -> dict[str, float]:
    """Write then read ``nbytes`` through the offload's own swap file (O_DIRECT where the file system takes it)
    in ``chunk``-sized transfers: the bandwidth an *_nvme system can expect, in bytes/s."""
    from lightning_zero.core.store.swap import SwapFile, aligned_empty

    swap = SwapFile(path, rank=0)
    regions = [swap.allocate(chunk) for _ in range(nbytes // chunk)]
    page = aligned_empty(chunk)
    start = time.perf_counter()
    for region in regions:
        swap.write(region, page)
    written = time.perf_counter() - start
    start = time.perf_counter()
    for region in regions:
        swap.read(region)
    read = time.perf_counter() - start
    swap.close()
    return {"write_bytes_per_s": nbytes / written, "read_bytes_per_s": nbytes / read, "direct_io": swap.direct}


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


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _timed_step(system: System, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """zero_grad, forward, backward and step of a system whose wrapper does all its communication itself."""
    device, optimizer = system.device, system.optimizer
    t0 = now(device)
    optimizer.zero_grad()
    with system.forward_context():
        loss = _loss(model, x, y)
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
            loss = _loss(self.model, x, y)
        t2 = now(device)
        loss.backward()  # hooks fill the buckets; reduce-scatters overlap backward and are waited for at its end
        self.engine.finish_backward()  # a no-op here: every rank's backward reached the hooks
        t3 = now(device)
        self.engine.step_of(self.optimizer).prepare()  # bf16: fp32 gradients for the masters; fp32: the held ones
        t4 = now(device)
        self.optimizer.step()  # the step window, then masters rounded and (stages 1, 2) the new shards gathered
        t5 = now(device)
        stats = self.engine.last_step_comm
        self.last_comm = {"nbytes": stats.nbytes, "calls": stats.calls, "by_op": dict(stats.by_op)}
        return {
            "begin_iteration": t1 - t0,
            "forward": t2 - t1,
            "backward": t3 - t2,
            "prepare_step": t4 - t3,
            "optimizer": t5 - t4,
        }

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
    and finished a step with ``finish_step``; the calls they lack are skipped."""

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
            loss = _loss(self.model, x, y)
        t2 = now(device)
        loss.backward()
        getattr(engine, "finish_backward", lambda: None)()
        t3 = now(device)
        engine.step_of(self.optimizer).prepare()
        t4 = now(device)
        self.optimizer.step()
        getattr(engine, "finish_step", lambda optimizer: None)(self.optimizer)
        t5 = now(device)
        stats = engine.last_step_comm
        self.last_comm = {"nbytes": stats.nbytes, "calls": stats.calls, "by_op": dict(stats.by_op)}
        return {
            "begin_iteration": t1 - t0,
            "forward": t2 - t1,
            "backward": t3 - t2,
            "prepare_step": t4 - t3,
            "optimizer": t5 - t4,
        }


def build_system(name: str, cfg: GPTConfig, args: argparse.Namespace, group: Any) -> System:
    base = base_system(name)
    if base.startswith("base"):
        return BaselineZeroSystem(name, cfg, args, group)
    if base.startswith("ddp"):
        return DDPSystem(name, cfg, args, group)
    if base == "zero1_torch":
        return TorchZero1System(name, cfg, args, group)
    return FSDP2System(name, cfg, args, group) if base == "fsdp2" else ZeroSystem(name, cfg, args, group)


def formula_bytes(name: str, numel: int, world_size: int) -> float:
    """Model-state bytes per rank for AdamW in the ZeRO paper's accounting (fp32; bf16-mixed: section 3.1)."""
    psi, n = numel, world_size
    target, params = offload_of(name)
    if target:  # what stays on the device: parameters and gradients (the master and AdamW states are offloaded)
        width = 2 if is_bf16(name) else 4
        stage = int(base_system(name)[4])
        on_device = 0 if params else (width * psi / n if stage == 3 else width * psi)
        return on_device + (width * psi / n if stage >= 2 else width * psi)
    base = base_system(name).replace("base", "zero").removesuffix(OWNER)  # a baseline core / owners: the stage
    if base.startswith("ddp"):  # ddp_bf16 too: fp32 parameters, gradients and AdamW states
        return 16 * psi
    if is_bf16(name):  # bf16 parameters (2) and gradients (2); fp32 master (4) and AdamW states (8)
        if base == "zero1":
            return 2 * psi + 2 * psi + 12 * psi / n
        if base == "zero2":
            return 2 * psi + 14 * psi / n
        return 16 * psi / n  # zero3_bf16; fsdp2_bf16, whose persistent states are fp32 shards (4 + 4 + 8)
    if base in ("zero1", "zero1_torch"):  # zero1_torch shards whole tensors: near, not exactly, 8Ψ/N
        return 4 * psi + 4 * psi + 8 * psi / n
    if base == "zero2":
        return 4 * psi + 12 * psi / n
    return 16 * psi / n  # zero3, fsdp2


# ----------------------------------------------------------------------------- data and config


def model_config(args: argparse.Namespace) -> GPTConfig:
    return gpt_config_for_params(int(args.params), vocab_size=256, block_size=args.block_size)


def batch_stream(args: argparse.Namespace, rank: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Random windows of the corpus, ``(x, y)`` with ``y`` shifted by one; a fixed stream per rank (seed + rank),
    drawn on the CPU and placed on the rank's device."""
    data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(args.seed + rank)
    device = device_for(rank, args)
    while True:
        starts = torch.randint(0, data.numel() - args.block_size - 1, (args.batch_size,), generator=generator)
        chunk = torch.stack([data[s : s + args.block_size + 1] for s in starts.tolist()])
        yield chunk[:, :-1].contiguous().to(device), chunk[:, 1:].contiguous().to(device)


def _cpus() -> int:
    return os.cpu_count() or 1


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_busy_s() -> float:
    """CPU seconds all processes on this machine spent busy since boot (user+nice+system+irq+softirq+steal)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


# ----------------------------------------------------------------------------- rank bodies


def timing_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build every system, train them interleaved, return per-step times, bytes and final parameter gaps.

    After ``--warmup`` rounds, rounds go on until ``--steps`` of them were clean (other processes used at
    most ``--max-foreign`` of the CPUs) or ``--max-rounds`` were measured, so that a shared machine
    still yields ``--steps`` undisturbed rounds where it can.
    """
    cfg = model_config(args)
    names = list(args.systems)
    device = device_for(rank, args)
    batches = batch_stream(args, rank)
    systems = {}
    for name in names:  # one process group each, created in the same order on every rank
        systems[name] = build_system(name, cfg, args, dist.new_group(backend=backend_for(args)))
    reference = systems[names[0]].full_state()
    for name in names[1:]:  # identical starting weights
        for key, value in systems[name].full_state().items():
            assert torch.equal(value, reference[key]), f"{name} starts from other weights than {names[0]} ({key})"

    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    page_faults: dict[str, list[int]] = {name: [] for name in names}  # minor faults: pages the step touched fresh
    load: list[float] = []  # per round: share of the CPUs used by other processes (rank 0's reading)
    clean = 0
    while len(load) < args.warmup or (clean < args.steps and len(load) < args.warmup + args.max_rounds):
        index = len(load)
        x, y = next(batches)
        dist.barrier()
        mark = (time.perf_counter(), machine_busy_s(), time.process_time())
        for name in names[index % len(names) :] + names[: index % len(names)]:  # the order rotates every round
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = now(device)
            phases[name].append(systems[name].step(x, y))
            times[name].append(now(device) - start)
            page_faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        load.append(foreign_share_since(*mark, device=device))
        clean += index >= args.warmup and load[-1] <= args.max_foreign

    result: dict[str, Any] = {"times": times, "phases": phases, "page_faults": page_faults, "load": load, "systems": {}}
    bases = {ref: systems[ref].full_state() for ref in ("ddp", f"ddp{BF16}") if ref in systems}  # not collectives
    for name, system in systems.items():
        full = system.full_state()  # a collective for the sharded systems: every rank, in the same order
        reference = diff_reference(name, names)
        entry: dict[str, Any] = {
            "memory": system.memory(),
            "comm_nbytes": system.comm_bytes(),
            "comm_detail": getattr(system, "last_comm", None),
            "owned_elements": system.owned_elements() if hasattr(system, "owned_elements") else None,
            "numel": sum(t.numel() for t in full.values()),
            "param_diff_reference": reference,
        }
        if reference is not None:
            entry.update(parameter_gap(full, bases[reference]))
        result["systems"][name] = entry
    result["combined_peak_rss"] = peak_rss_bytes()
    return result


def diff_reference(name: str, names: list[str]) -> str | None:
    """The DDP whose final parameters ``name``'s are compared with: the same precision's if it ran, else ``ddp``."""
    return next((ref for ref in (same_precision_ddp(name), "ddp") if ref in names), None)


def foreign_share_since(wall: float, busy: float, own: float, device: torch.device) -> float:
    """Share of the CPUs that other processes used since the mark (collective: rank 0's verdict for all).

    The tensors live on ``device``: the world group is NCCL's with ``--device cuda``.
    """
    dist.barrier()
    own_total = torch.tensor([time.process_time() - own], dtype=torch.float64, device=device)
    dist.all_reduce(own_total)  # every rank's CPU time (all its threads)
    foreign = max(0.0, machine_busy_s() - busy - own_total.item())
    share = torch.tensor([foreign / ((time.perf_counter() - wall) * _cpus())], dtype=torch.float64, device=device)
    dist.broadcast(share, src=0)
    return share.item()


def parameter_gap(state: dict[str, Tensor], base: dict[str, Tensor]) -> dict[str, Any]:
    """max over tensors of max|a - b| / max|b|, the largest absolute gap, whether all are bit-equal, and
    ||a - b|| / ||b|| over all parameters together.

    The per-tensor maximum is at the mercy of tensors that start at zero (biases): after a few steps they hold
    about steps x lr, and where their gradient is only rounding noise (the attention's key bias, whose true
    gradient is zero) Adam's normalised steps go either way. The global norm ratio is not.
    """
    rel, absolute, equal = 0.0, 0.0, True
    diff_sq, base_sq = 0.0, 0.0
    assert list(state) == list(base)
    for name, a in state.items():
        b = base[name]
        gap = (a.detach() - b.detach()).abs().max().item()
        absolute = max(absolute, gap)
        rel = max(rel, gap / max(b.detach().abs().max().item(), 1e-30))
        equal = equal and torch.equal(a, b)
        diff_sq += (a.detach().double() - b.detach().double()).square().sum().item()
        base_sq += b.detach().double().square().sum().item()
    return {
        "max_rel_param_diff": rel,
        "max_abs_param_diff": absolute,
        "bitwise_equal": equal,
        "rel_l2_param_diff": (diff_sq / max(base_sq, 1e-300)) ** 0.5,
    }


def rss_rank(rank: int, world_size: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Only ``name`` in this process: baseline RSS, then peak RSS over ``--rss-steps`` steps.

    With ``--device cuda`` also the peak of ``torch.cuda.max_memory_allocated`` over the same span (``None`` on the
    CPU), and the allocated bytes at the baseline (the batches).
    """
    cfg = model_config(args)
    device = device_for(rank, args)
    stream = batch_stream(args, rank)
    batches = [next(stream) for _ in range(args.rss_steps)]
    baseline = current_rss_bytes()
    reset_accelerator_peak(device)
    baseline_accelerator = accelerator_bytes(device, peak=False)
    system = build_system(name, cfg, args, None)
    times = []
    for x, y in batches:
        dist.barrier()
        start = now(device)
        system.step(x, y)
        times.append(now(device) - start)
    return {
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "end_rss": current_rss_bytes(),
        "baseline_accelerator": baseline_accelerator,
        "peak_accelerator": accelerator_bytes(device, peak=True),
        "times": times,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


# ----------------------------------------------------------------------------- process launch


def _own_cpu_s() -> float:
    """CPU seconds of this process and its joined children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn, rank, world_size, port, threads, args, queue, device_type) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        bind_device(rank, device_type)
        dist.init_process_group(
            BACKENDS[device_type], rank=rank, world_size=world_size, timeout=timedelta(seconds=_TIMEOUT_S)
        )
        result = fn(rank, world_size, *args)
        payload = io.BytesIO()
        torch.save(result, payload)
        queue.put((rank, True, payload.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def bind_device(rank: int, device_type: str) -> None:
    """``cuda``: make ``cuda:{rank}`` this process's current device before NCCL starts (one node, a GPU per rank)."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_on_ranks(
    fn: Any, world_size: int, threads: int, *args: Any, env: dict[str, str] | None = None, device_type: str = "cpu"
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on freshly spawned ranks, with ``env`` added to their environment; the world
    group is gloo's (``device_type="cpu"``) or NCCL's (``"cuda"``, rank ``r`` on ``cuda:r``)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, threads, args, queue, device_type))
        for rank in range(world_size)
    ]
    with _environment(env or {}):  # spawned interpreters inherit it; glibc reads MALLOC_* at their start
        for proc in procs:
            proc.start()
    try:
        results, errors = _collect(procs, queue)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[rank] for rank in range(world_size)]


def _collect(procs: list[Any], queue: Any) -> tuple[dict[int, Any], dict[int, str]]:
    """Each rank's answer, or an error as soon as a rank died without one."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + _TIMEOUT_S
    while len(results) + len(errors) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=5)
        except queue_module.Empty:
            dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                errors[-1] = f"ranks died without an answer (pids {dead}) or timed out; see their stderr above"
                break
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors[rank] = payload
    return results, errors


# ----------------------------------------------------------------------------- report


def select_rounds(args: argparse.Namespace, load: list[float]) -> tuple[list[int], dict[str, Any]]:
    """The measured rounds the statistics use, and a description of the choice.

    Rounds in which other processes left the machine alone (at most ``--max-foreign`` of the CPUs), if there are
    enough of them; else every measured round (flagged by ``used_clean_only=False``).
    """
    measured = range(args.warmup, len(load))
    clean = [i for i in measured if load[i] <= args.max_foreign]
    rounds = clean if len(clean) >= max(3, args.steps // 2) else list(measured)
    info = {
        "foreign_share_per_round": load,
        "measured_rounds": len(measured),
        "clean_rounds": clean,
        "used_rounds": rounds,
        "used_clean_only": rounds == clean,
    }
    return rounds, info


def rounds_sentence(args: argparse.Namespace, rounds: dict[str, Any]) -> str:
    """How the statistics chose their rounds (see :func:`select_rounds`), for the report's header."""
    if rounds["used_clean_only"]:
        used, share = len(rounds["used_rounds"]), 100 * args.max_foreign
        return f"statistics over the {used} rounds in which other processes used <= {share:.0f}% of the CPUs."
    return f"statistics over all of them (only {len(rounds['clean_rounds'])} were free of other load: NOISY)."


def summarize(args: argparse.Namespace, timing: list[dict[str, Any]], rss: dict[str, dict[str, list]]) -> dict:
    names = list(args.systems)
    world = args.world_size
    tokens = args.batch_size * args.block_size * world  # tokens per optimizer step, all ranks
    rounds, rounds_info = select_rounds(args, timing[0]["load"])
    summary: dict[str, Any] = {"_rounds": rounds_info}
    for name in names:
        # A step lasts as long as its slowest rank; warmup rounds are dropped.
        per_step = [max(r["times"][name][i] for r in timing) for i in rounds]
        phase_names = timing[0]["phases"][name][0].keys()
        phases = {
            p: statistics.median(max(r["phases"][name][i][p] for r in timing) for i in rounds) for p in phase_names
        }
        info = timing[0]["systems"][name]
        memory = [r["systems"][name]["memory"] for r in timing]
        totals = [sum(m.values()) for m in memory]
        formula = formula_bytes(name, info["numel"], world)
        summary[name] = {
            "step_ms_median": 1e3 * statistics.median(per_step),
            "step_ms_min": 1e3 * min(per_step),
            "step_ms_max": 1e3 * max(per_step),
            "step_ms_all": [1e3 * t for t in per_step],
            "phase_ms_median": {p: 1e3 * v for p, v in phases.items()},
            "page_faults_per_step_median": statistics.median(
                max(r["page_faults"][name][i] for r in timing) for i in rounds
            ),
            "tokens_per_s": tokens / statistics.median(per_step),
            "model_state_bytes_per_rank": memory,
            "model_state_total_max_rank": max(totals),
            "formula_bytes": formula,
            "measured_over_formula": max(totals) / formula,
            "comm_bytes_per_step": [r["systems"][name]["comm_nbytes"] for r in timing],
            "comm_detail": info["comm_detail"],
            "owned_elements_max_min": info.get("owned_elements"),
            "max_rel_param_diff": max(r["systems"][name].get("max_rel_param_diff", float("nan")) for r in timing),
            "max_abs_param_diff": max(r["systems"][name].get("max_abs_param_diff", float("nan")) for r in timing),
            "bitwise_equal": all(r["systems"][name].get("bitwise_equal", False) for r in timing),
            "rel_l2_param_diff": max(r["systems"][name].get("rel_l2_param_diff", float("nan")) for r in timing),
            "param_diff_reference": info["param_diff_reference"],
            "precision": "bf16-mixed" if is_bf16(name) else "fp32",
            "numel": info["numel"],
            "rss": {variant: per_system[name] for variant, per_system in rss.items() if name in per_system},
        }
    if "ddp" in summary:
        for name in names:
            ratio, paired = step_ratios(summary, name, "ddp")
            summary[name]["ratio_to_ddp"] = ratio
            summary[name]["paired_ratio_median"] = paired
    for name in names:  # bf16 systems against ddp_bf16, fp32 ones against ddp (then the same as above)
        reference = same_precision_ddp(name)
        if reference in summary:
            ratio, paired = step_ratios(summary, name, reference)
            summary[name]["same_precision_ddp"] = reference
            summary[name]["ratio_to_same_precision_ddp"] = ratio
            summary[name]["paired_ratio_same_precision_ddp"] = paired
    return summary


def step_ratios(summary: dict[str, Any], name: str, reference: str) -> tuple[float, float]:
    """``name``'s median step / ``reference``'s, and the median over rounds of the ratio within each round."""
    ratio = summary[name]["step_ms_median"] / summary[reference]["step_ms_median"]
    # Robust to slow drifts of machine speed: the ratio within each round, then the median.
    paired = [a / b for a, b in zip(summary[name]["step_ms_all"], summary[reference]["step_ms_all"], strict=True)]
    return ratio, statistics.median(paired)


def diff_cell(name: str, s: dict[str, Any]) -> str:
    """The parameter-difference cell: against the same-precision DDP, else against ``ddp`` (said so)."""
    reference = s["param_diff_reference"]
    if name == reference:
        return "(reference)"
    cell = f"{s['max_rel_param_diff']:.1e}" + (" (bit-equal)" if s["bitwise_equal"] else "")
    if reference is not None and reference != same_precision_ddp(name):
        cell += f" (vs {reference}: {same_precision_ddp(name)} did not run)"
    return cell


def precision_text(names: list[str]) -> str:
    """Which systems train in which precision, for the header line."""
    groups = {
        "fp32": [name for name in names if not is_bf16(name)],
        "bf16-mixed": [name for name in names if is_bf16(name)],
    }
    return "; ".join(f"{label}: {', '.join(members)}" for label, members in groups.items() if members)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def markdown(args: argparse.Namespace, summary: dict[str, Any], combined_rss: list[int], load: dict) -> str:
    names = [name for name in summary if not name.startswith("_")]
    rounds = summary["_rounds"]
    numel = summary[names[0]]["numel"]
    lines = [
        f"GPT {numel / 1e6:.2f}M trainable parameters (Ψ = {numel:,}), N = {args.world_size} {backend_for(args)} "
        f"ranks{' on cuda:0-' + str(args.world_size - 1) if device_type(args) == 'cuda' else ''}, "
        f"batch {args.batch_size} x block {args.block_size} per rank, AdamW, precision per system "
        f"({precision_text(names)}), "
        f"{args.warmup} warmup + {rounds['measured_rounds']} measured rounds of one step per system, interleaved; "
        + rounds_sentence(args, rounds),
        "",
        "| system | median step ms (min-max) | vs ddp | paired | vs same-precision ddp (paired) | tokens/s "
        "| params MiB | grads MiB | optim MiB | total MiB | formula MiB | measured/formula | comm MiB/step "
        "| max rel param diff vs same-precision ddp | rel L2 param diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for name in names:
        s = summary[name]
        mem = max(s["model_state_bytes_per_rank"], key=lambda m: sum(m.values()))
        same = (
            f"{s['ratio_to_same_precision_ddp']:.3f}x ({s['paired_ratio_same_precision_ddp']:.3f}x)"
            if "ratio_to_same_precision_ddp" in s
            else "-"
        )
        lines.append(
            f"| {name} | {s['step_ms_median']:.0f} ({s['step_ms_min']:.0f}-{s['step_ms_max']:.0f}) "
            f"| {s.get('ratio_to_ddp', nan):.3f}x | {s.get('paired_ratio_median', nan):.3f}x "
            f"| {same} "
            f"| {s['tokens_per_s']:.0f} "
            f"| {mib(mem['params'])} | {mib(mem['gradients'])} | {mib(mem['optimizer_states'])} "
            f"| {mib(s['model_state_total_max_rank'])} | {mib(s['formula_bytes'])} | {s['measured_over_formula']:.4f} "
            f"| {mib(max(s['comm_bytes_per_step']))} | {diff_cell(name, s)} "
            f"| {'-' if name == s['param_diff_reference'] else format(s['rel_l2_param_diff'], '.1e')} |"
        )
    lines += [
        "",
        "vs ddp = median step / ddp's median step; paired = median over rounds of step / ddp's step in the same "
        "round; vs same-precision ddp: the same against ddp_bf16 for the bf16-mixed systems (against ddp for the fp32 "
        f"ones). Other processes used {load['foreign_cpu_s']:.0f} CPU-s during the {load['wall_s']:.0f} s timing "
        f"run ({100 * load['foreign_share']:.0f}% of the machine). Param diffs after the run: max rel = the largest "
        "max|a - b| / max|b| of any tensor (zero-initialised biases dominate it once results are not bit-equal); "
        "rel L2 = ||a - b|| / ||b|| over all parameters.",
    ]
    if any(is_bf16(name) for name in names):
        lines += [
            "",
            "bf16-mixed: the forward and loss under bf16 autocast; gradients reduced in fp32; AdamW updates fp32 "
            'values. ddp_bf16: fp32 parameters and gradients (Lightning\'s DDP with precision="bf16-mixed"); '
            "zero*_bf16: bf16 parameters and gradients and fp32 master shards, counted under optim "
            "(PrecisionPolicy(bf16, fp32, fp32)); fsdp2_bf16: fp32 shards gathered in bf16 "
            "(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). Their parameters after the run "
            "(ZeRO: the fp32 masters) are compared with ddp_bf16's.",
        ]
    lines += ["", "Median phase times per step (ms, slowest rank):", ""]
    phase_names = list(dict.fromkeys(p for name in names for p in summary[name]["phase_ms_median"]))
    lines += [
        "| system | " + " | ".join(phase_names) + " | minor page faults per step (MiB touched fresh) |",
        "|---|" + "---|" * (len(phase_names) + 1),
    ]
    for name in names:
        values = summary[name]["phase_ms_median"]
        faults = summary[name]["page_faults_per_step_median"]
        cells = [f"{values[p]:.1f}" if p in values else "-" for p in phase_names]
        cells.append(f"{faults:.0f} ({faults * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += rss_table(args, summary, names)
    lines += [
        "",
        f"Peak RSS of the timing run (all systems live in each process): "
        f"{' / '.join(mib(b) for b in combined_rss)} MiB per rank.",
        "Comm: ZeRO = engine.last_step_comm.nbytes; DDP = 2 x 4Ψ (its fp32 gradient all-reduce, counted as in "
        "[Note: counting communication] of lightning_zero/core/comm/communicator.py; ddp_bf16 too); FSDP2 not "
        "measured: "
        "3 x 4Ψ (fsdp2_bf16: 2Ψ + 2Ψ + 4Ψ, the bf16 all-gathers and the fp32 reduce-scatter).",
    ]
    return "\n".join(lines)


def rss_table(args: argparse.Namespace, summary: dict[str, Any], names: list[str]) -> list[str]:
    """Markdown lines: peak RSS per system and malloc variant, next to the model-state bytes."""
    rows = [(name, variant, summary[name]["rss"][variant]) for name in names for variant in summary[name]["rss"]]
    if not rows:
        return []
    gpu = device_type(args) == "cuda"  # the peak accelerator memory of the same runs, in one more column
    lines = [
        "",
        f"RSS per rank, MiB (rank 0 / rank 1): one system per process, {args.rss_steps} steps; baseline = RSS "
        "after imports and data, before the model is built; model states = params + grads + optimizer states "
        "counted from the tensors" + ("; GPU peak = torch.cuda.max_memory_allocated over the run" if gpu else "") + ":",
        "",
        "| system | malloc | peak (ru_maxrss) | peak - baseline | after the last step - baseline | model states |"
        + (" GPU peak MiB |" if gpu else ""),
        "|---|---|---|---|---|---|" + ("---|" if gpu else ""),
    ]
    for name, variant, ranks in rows:
        states = max(sum(m.values()) for m in summary[name]["model_state_bytes_per_rank"])
        lines.append(
            f"| {name} | {variant} | {' / '.join(mib(r['peak_rss']) for r in ranks)} "
            f"| {' / '.join(mib(r['peak_rss'] - r['baseline_rss']) for r in ranks)} "
            f"| {' / '.join(mib(r['end_rss'] - r['baseline_rss']) for r in ranks)} | {mib(states)} |"
            + (f" {' / '.join(mib(r['peak_accelerator']) for r in ranks)} |" if gpu else "")
        )
    lines += [
        "",
        "malloc as-is: the environment unchanged (glibc's dynamic mmap threshold); mmap64k: "
        "`MALLOC_MMAP_THRESHOLD_=65536` in the ranks' environment, so freed large blocks go back to the system.",
    ]
    return lines


def code_version() -> dict[str, Any]:
    """Which lightning_zero was measured: its path, a hash of its sources, and git's view where there is one."""
    import hashlib
    import subprocess

    import lightning_zero

    package = Path(lightning_zero.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    version: dict[str, Any] = {"lightning_zero_path": str(package), "lightning_zero_sha256": digest.hexdigest()[:16]}
    try:
        git = ["git", "-C", str(package.parent)]
        version["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", str(package)], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        version["lightning_zero_uncommitted"] = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        version["git_commit"] = None
    return version


def environment() -> dict[str, Any]:
    import lightning

    return {
        **code_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "malloc_mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        **gpus(),
    }


def gpus() -> dict[str, Any]:
    """The GPUs and CUDA of this machine, where there are any (nothing on a CPU-only one)."""
    if not torch.cuda.is_available():
        return {}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cuda": torch.version.cuda, "gpus": names}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="target parameter count of the GPT")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per system (clean rounds wanted)")
    parser.add_argument(
        "--max-rounds", type=int, help="measure at most this many rounds while waiting for clean ones (2 x --steps)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per system before those")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=sorted(BACKENDS),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL ranks, rank r on cuda:r (one node; not run yet)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--systems", default="ddp,zero1,zero2", help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--rss-variants", default="as-is,mmap64k", help="comma-separated from as-is,mmap64k; '' = none")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps per system in each RSS run")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP and ZeRO bucket size")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.05,
        help="rounds in which other processes used more than this share of the CPUs are left out of the statistics",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir(), help="swap directory of the *_nvme systems")
    parser.add_argument(
        "--adamw-fused", action="store_true", help="every system's AdamW with fused=True (offload picks it anyway)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.adamw_fused:
        os.environ[FUSED_ENV] = "1"  # read by make_adamw in every spawned rank
    args.max_rounds = args.max_rounds or 2 * args.steps
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.rss_variants = [v.strip() for v in args.rss_variants.split(",") if v.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS] + [v for v in args.rss_variants if v not in RSS_VARIANTS]
    if unknown:
        parser.error(f"unknown systems or RSS variants {unknown}; systems: {SYSTEMS}, variants: {list(RSS_VARIANTS)}")
    if len(set(args.systems)) != len(args.systems) or not args.systems:
        parser.error("--systems needs distinct names")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        parser.error(f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} GPUs, {args.world_size} ranks")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    cfg = model_config(args)
    print(f"# {cfg} | {environment()}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    busy_before, own_before = machine_busy_s(), _own_cpu_s()
    timing = run_on_ranks(timing_rank, args.world_size, args.threads, args, device_type=args.device)
    wall = time.perf_counter() - started
    # CPU time that other processes took from this machine during the timing run (children's time
    # counts once they have been joined, as they are by now).
    foreign = (machine_busy_s() - busy_before) - (_own_cpu_s() - own_before)
    load = {"wall_s": wall, "foreign_cpu_s": foreign, "foreign_share": foreign / (wall * (os.cpu_count() or 1))}
    print(f"# timing run: {wall:.0f} s, foreign CPU {foreign:.1f} s", file=sys.stderr, flush=True)
    rss: dict[str, dict[str, list]] = {}
    for variant in args.rss_variants:
        rss[variant] = {}
        for name in args.systems:
            t = time.perf_counter()
            rss[variant][name] = run_on_ranks(
                rss_rank, args.world_size, args.threads, args, name, env=RSS_VARIANTS[variant], device_type=args.device
            )
            print(f"# rss run {variant}/{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    summary = summarize(args, timing, rss)
    if any(offload_of(name)[0] == "nvme" for name in args.systems):
        summary["_disk"] = disk_bandwidth(args.nvme_path)
        print(f"# disk behind --nvme-path: {summary['_disk']}", file=sys.stderr, flush=True)
    combined = [r["combined_peak_rss"] for r in timing]
    print(markdown(args, summary, combined, load))
    print(f"# total: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "model": vars(cfg),
            "environment": environment(),
            "summary": summary,
            "combined_peak_rss_per_rank": combined,
            "timing_run_load": load,
            "wall_s": time.perf_counter() - started,
        }
        out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()

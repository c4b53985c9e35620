"""Benchmark: DDP and DeepSpeed ZeRO stages 1-3 on the GPT of examples/gpt.py, fp32, 2 gloo ranks on the CPU.

On demand only (never imported by the tests). DeepSpeed is not a dependency of lightning-zero: install it in an
environment of its own, e.g.::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch deepspeed
    /tmp/dsvenv/bin/pip install -e .          # lightning_zero and examples/, for the GPT and zero_bench/'s helpers
    /tmp/dsvenv/bin/python benchmarks/bench_deepspeed.py --params 25e6 --steps 16
    /tmp/dsvenv/bin/python benchmarks/bench_deepspeed.py --params 5e6 --steps 4 --warmup 1   # quick smoke run

DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``, set here unless the environment says otherwise) over
the gloo process group that the repository's launcher starts (``tests/helpers.py``, through ``zero_bench.launch``;
``deepspeed.init_distributed(dist_backend="gloo")`` adopts it). No fp16/bf16 section in the config: fp32 throughout.
The client optimizer is bench_zero.py's ``make_adamw`` (torch.optim.AdamW, the same two param groups: weight decay
0.1 on matrices, 0 on the rest), handed to ``deepspeed.initialize`` with ``zero_allow_untested_optimizer``. On first
use DeepSpeed's CPU communication backend JIT-compiles a small C++ op (``deepspeed_shm_comm``, with ninja and the
system compiler), used only by its ``inference_all_reduce``; training collectives are torch.distributed's gloo ones.

What it does (as bench_zero.py, whose helpers in ``zero_bench/`` it imports: ``make_model``, ``make_adamw``,
``model_config``, ``batch_stream``, ``parameter_gap``, ``on_ranks``, ...): every rank builds ``ddp`` and
``ds_zero1``-``ds_zero3`` from the same seed (identical starting weights, checked) and trains them on one fixed
stream of batches, interleaved (round ``i`` runs step ``i`` of every system, the order rotating every round); a
step's time is the slowest rank's; rounds in which other processes used more than ``--max-foreign`` of the CPUs are
left out of the statistics when enough clean ones remain (else all rounds are used, flagged NOISY).

Reported per system: median step time and its ratio to ``ddp``'s (and the median of per-round ratios), per-phase
medians, per-rank model-state bytes (below), and after the run the largest per-tensor relative parameter difference
from ``ddp`` (max|a - b| / max|b|) and the relative L2 difference over all parameters. DeepSpeed's full parameters:
at stage 3 gathered with ``deepspeed.zero.GatheredParameters``; at stages 1 and 2 the module's parameters, which
DeepSpeed all-gathers in every step.

Model states, counted from the tensors DeepSpeed holds, each storage once (in the order below, so a storage shared
by two categories counts in the first), after one more (untimed) step at the end of the run:

* ``params``: the module's parameter storages; stages 1-2 ``optimizer.bit16_groups_flat`` (the full flat parameter
  buffer, fp32 here, with its alignment padding); stage 3 ``fp16_partitioned_groups_flat`` / ``param.ds_tensor``
  (this rank's shards) and the full data of parameters kept whole (``ds_persist``: below
  ``stage3_param_persistence_threshold`` elements).
* ``fp32 master``: stages 1-2 ``single_partition_of_fp32_groups``, stage 3 ``fp32_partitioned_groups_flat``: this
  rank's fp32 partition that AdamW updates (DeepSpeed 0.19.8 keeps it in storage of its own next to the parameter
  buffers even in fp32 training, at every stage: counted, not assumed).
* ``optim``: the client AdamW's state tensors (``exp_avg``, ``exp_avg_sq``, ``step``), over the fp32 partitions.
* ``grads``: the module parameters' ``.grad``, the masters' ``.grad``, stages 1-2 ``averaged_gradients`` and
  ``grads_in_partition``, stage 3 ``grad_partitions_flat_buffer``; sampled after every parameter's gradient is
  accumulated during ``engine.backward`` (``register_post_accumulate_grad_hook``; the maximum is the peak), after
  ``engine.backward`` and after ``engine.step``.
* ``buckets``: the reduction buckets' buffers (``ipg_buckets``; stage 3 allocates ``reduce_bucket_size`` elements
  up front, so ``--bucket-cap-mb`` sets it: 25 MiB of fp32 by default, DeepSpeed's own default being 5e8 elements),
  peak in backward; reported apart and not in the total.

DDP's states are bench_zero.py's count (params + grads + AdamW state tensors, ``gradient_as_bucket_view=True``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # zero_bench, which puts the repository root on the path

import torch
import torch.distributed as dist
from torch import Tensor
from zero_bench.launch import on_ranks
from zero_bench.measure import batch_stream, foreign_share_since, machine_busy_s, model_config, own_cpu_s, parameter_gap
from zero_bench.report import code_version, mib, rounds_sentence, select_rounds, step_ratios
from zero_bench.systems import DDPSystem, System, lm_loss, make_adamw, make_model

from examples.gpt import DEFAULT_DATA

# ``_cpu``: DeepSpeed's ZeRO-Offload (optimizer state on the CPU; at stage 3 the parameters too) stepping the same
# torch AdamW (``zero_force_ds_cpu_optimizer: False``: its compiled DeepSpeedCPUAdam is not what is compared).
SYSTEMS = ("ddp", "ds_zero1", "ds_zero2", "ds_zero3", "ds_zero1_cpu", "ds_zero2_cpu", "ds_zero3_cpu")
INSTALL_HINT = (
    "bench_deepspeed.py needs DeepSpeed, which lightning-zero does not depend on. Install it in a separate "
    "environment (see this file's docstring), e.g. `pip install deepspeed`, and run the script with that Python."
)


def import_deepspeed() -> Any:
    """``deepspeed``, imported on the CPU accelerator; a clear error where it is not installed."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as error:
        raise SystemExit(f"{INSTALL_HINT}\n({error})") from error
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


# ----------------------------------------------------------------------------- DeepSpeed


def ds_config(stage: int, args: argparse.Namespace, offload: bool = False) -> dict[str, Any]:
    bucket = int(args.bucket_cap_mb * 2**20 / 4)  # elements: the same bytes as bench_zero's fp32 buckets
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket}
    if stage < 3:
        zero["allgather_bucket_size"] = bucket
    extra: dict[str, Any] = {}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}  # no pinned memory on a CPU-only torch
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
        extra["zero_force_ds_cpu_optimizer"] = False
    return {
        **extra,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.batch_size * args.world_size,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch.optim.AdamW as the client optimizer
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedSystem(System):
    """``ds_zero1``-``ds_zero3``: ``deepspeed.initialize`` on the GPT and make_adamw's AdamW, fp32."""

    def __init__(self, name: str, cfg: Any, args: argparse.Namespace) -> None:
        deepspeed = import_deepspeed()
        self._setup(name, args)
        self.stage = int(name.removeprefix("ds_zero")[0])
        self.model = make_model(cfg, args.seed)
        optimizer = make_adamw(self.model, args.lr)
        self.config = ds_config(self.stage, args, offload=name.endswith("_cpu"))
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=self.config
        )
        self.zero = self.engine.optimizer  # DeepSpeedZeroOptimizer (stages 1, 2) or DeepSpeedZeroOptimizer_Stage3
        self.grad_bytes: dict[str, int] = {}

    def step(self, x: Tensor, y: Tensor) -> dict[str, float]:
        t0 = time.perf_counter()
        loss = lm_loss(self.engine, x, y)
        t1 = time.perf_counter()
        self.engine.backward(loss)
        t2 = time.perf_counter()
        self.engine.step()  # the optimizer step, the all-gather of the parameters (stages 1, 2), zero_grad
        t3 = time.perf_counter()
        return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2}

    def measured_step(self, x: Tensor, y: Tensor) -> None:
        """One more step, counting the gradient storages during backward (after each parameter's gradient is
        accumulated: the peak), after ``engine.backward`` and after ``engine.step``."""
        seen = set(self._state_storages())
        peak = {"grads": 0, "buckets": 0}

        def sample(_: Tensor) -> None:
            grads, buckets = self._gradient_tensors()
            peak["grads"] = max(peak["grads"], _count(grads, set(seen)))
            peak["buckets"] = max(peak["buckets"], _count(buckets, set(seen)))

        hooks = [p.register_post_accumulate_grad_hook(sample) for p in self.model.parameters() if p.requires_grad]
        try:
            self.engine.backward(lm_loss(self.engine, x, y))
        finally:
            for hook in hooks:
                hook.remove()
        sample(x)  # the end of backward counts too
        grads, buckets = self._gradient_tensors()
        self.grad_bytes = {
            "grads peak in backward": peak["grads"],
            "buckets peak in backward": peak["buckets"],
            "grads after backward": _count(grads, set(seen)),
        }
        self.engine.step()
        grads, buckets = self._gradient_tensors()
        self.grad_bytes["grads after step"] = _count(grads, set(seen))
        self.grad_bytes["buckets after step"] = _count(buckets, set(seen))

    def _param_tensors(self) -> list[Tensor]:
        z = self.zero
        tensors = [p.data for p in self.model.parameters()]
        if self.stage < 3:
            return tensors + list(z.bit16_groups_flat)
        return tensors + list(z.fp16_partitioned_groups_flat) + [p.ds_tensor for p in self.model.parameters()]

    def _master_tensors(self) -> list[Tensor]:
        z = self.zero
        return list(z.single_partition_of_fp32_groups if self.stage < 3 else z.fp32_partitioned_groups_flat)

    def _optimizer_tensors(self) -> list[Tensor]:
        inner = self.zero.optimizer  # the client AdamW, over the fp32 partitions
        return [v for state in inner.state.values() for v in state.values() if isinstance(v, Tensor)]

    def _gradient_tensors(self) -> tuple[list[Tensor], list[Tensor]]:
        """(gradient storages, reduction-bucket buffers)."""
        z = self.zero
        grads = [p.grad for p in self.model.parameters()] + [m.grad for m in self._master_tensors()]
        if self.stage < 3:
            averaged = z.averaged_gradients.values() if isinstance(z.averaged_gradients, dict) else []
            grads += [t for group in averaged if group is not None for t in _as_list(group)]
            grads.append(getattr(z, "grads_in_partition", None))
            buckets = [t for bucket in z.ipg_buckets.values() for t in bucket.buffer]
        else:
            grads.append(getattr(z, "grad_partitions_flat_buffer", None))
            buckets = [bucket.buffer for bucket in z.ipg_buckets.values()]
        return [t for t in grads if isinstance(t, Tensor)], [t for t in buckets if isinstance(t, Tensor)]

    def _state_storages(self) -> dict[int, None]:
        return dict.fromkeys(_storage_key(t) for t in self._param_tensors() + self._master_tensors())

    def memory(self) -> dict[str, int]:
        seen: set[int] = set()
        counts = {
            "params": _count(self._param_tensors(), seen),
            "fp32 master": _count(self._master_tensors(), seen),
            "optimizer_states": _count(self._optimizer_tensors(), seen),
        }
        return {**counts, "gradients": self.grad_bytes.get("grads peak in backward", 0), **self.grad_bytes}

    def full_state(self) -> dict[str, Tensor]:
        if self.stage < 3:
            return super().full_state()
        deepspeed = import_deepspeed()
        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {name: p.detach().clone() for name, p in self.model.named_parameters()}


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _count(tensors: list[Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which it extends): each storage once."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def build(name: str, cfg: Any, args: argparse.Namespace) -> System:
    if name == "ddp":
        return DDPSystem(name, cfg, args, dist.new_group(backend="gloo"))
    return DeepSpeedSystem(name, cfg, args)


# ----------------------------------------------------------------------------- rank body


def timing_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build every system, train them interleaved, then count their states and compare their parameters."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group that run_on_ranks started
    cfg = model_config(args)
    names = list(args.systems)
    device = torch.device("cpu")
    batches = batch_stream(args, rank)
    systems = {name: build(name, cfg, args) for name in names}
    reference = systems[names[0]].full_state()
    for name in names[1:]:
        for key, value in systems[name].full_state().items():
            assert torch.equal(value, reference[key]), f"{name} starts from other weights than {names[0]} ({key})"

    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    load: list[float] = []
    clean = 0
    while len(load) < args.warmup or (clean < args.steps and len(load) < args.warmup + args.max_rounds):
        index = len(load)
        x, y = next(batches)
        dist.barrier()
        mark = (time.perf_counter(), machine_busy_s(), time.process_time())
        for name in names[index % len(names) :] + names[: index % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            phases[name].append(systems[name].step(x, y))
            times[name].append(time.perf_counter() - start)
        load.append(foreign_share_since(*mark, device=device))
        clean += index >= args.warmup and load[-1] <= args.max_foreign

    result: dict[str, Any] = {"times": times, "phases": phases, "load": load, "systems": {}}
    base = systems["ddp"].full_state() if "ddp" in systems else None
    for name, system in systems.items():
        full = system.full_state()  # a collective at stage 3: every rank, in the same order
        entry = {"numel": sum(t.numel() for t in full.values())}
        if base is not None and name != "ddp":
            entry.update(parameter_gap(full, base))
        result["systems"][name] = entry
    x, y = next(batches)  # one more step, untimed, for the byte counts (after the parameter comparison)
    for name, system in systems.items():
        if isinstance(system, DeepSpeedSystem):
            system.measured_step(x, y)
        else:
            system.step(x, y)
        result["systems"][name]["memory"] = system.memory()
    if rank == 0:
        result["ds_configs"] = {n: s.config for n, s in systems.items() if isinstance(s, DeepSpeedSystem)}
        result["ds_optimizers"] = {
            n: type(s.zero).__name__ for n, s in systems.items() if isinstance(s, DeepSpeedSystem)
        }
    return result


# ----------------------------------------------------------------------------- report


def summarize(args: argparse.Namespace, timing: list[dict[str, Any]]) -> dict[str, Any]:
    rounds, rounds_info = select_rounds(args, timing[0]["load"])
    summary: dict[str, Any] = {"_rounds": rounds_info}
    for name in args.systems:
        per_step = [max(r["times"][name][i] for r in timing) for i in rounds]
        phase_names = timing[0]["phases"][name][0].keys()
        memory = [r["systems"][name]["memory"] for r in timing]
        entry = {
            "step_ms_median": 1e3 * statistics.median(per_step),
            "step_ms_min": 1e3 * min(per_step),
            "step_ms_max": 1e3 * max(per_step),
            "step_ms_all": [1e3 * t for t in per_step],
            "phase_ms_median": {
                p: 1e3 * statistics.median(max(r["phases"][name][i][p] for r in timing) for i in rounds)
                for p in phase_names
            },
            "model_state_bytes_per_rank": memory,
            "numel": timing[0]["systems"][name]["numel"],
        }
        gaps = [r["systems"][name] for r in timing if "max_rel_param_diff" in r["systems"][name]]
        if gaps:
            entry["max_rel_param_diff"] = max(g["max_rel_param_diff"] for g in gaps)
            entry["rel_l2_param_diff"] = max(g["rel_l2_param_diff"] for g in gaps)
            entry["bitwise_equal"] = all(g["bitwise_equal"] for g in gaps)
        summary[name] = entry
    if "ddp" in summary:
        for name in args.systems:
            summary[name]["ratio_to_ddp"], summary[name]["paired_ratio_median"] = step_ratios(summary, name, "ddp")
    return summary


def state_total(memory: dict[str, int]) -> int:
    """Params + fp32 master + optimizer states + gradients (at their peak, before the step)."""
    return sum(memory.get(k, 0) for k in ("params", "fp32 master", "optimizer_states", "gradients"))


def markdown(args: argparse.Namespace, summary: dict[str, Any], versions: dict[str, Any], load: dict) -> str:
    names = [name for name in summary if not name.startswith("_")]
    rounds = summary["_rounds"]
    numel = summary[names[0]]["numel"]
    lines = [
        f"GPT {numel / 1e6:.2f}M parameters (Ψ = {numel:,}), N = {args.world_size} gloo ranks on the CPU, batch "
        f"{args.batch_size} x block {args.block_size} per rank, fp32 AdamW, DeepSpeed {versions['deepspeed']} "
        f"(torch {versions['torch']}), {args.warmup} warmup + {rounds['measured_rounds']} measured rounds of one "
        "step per system, interleaved; " + rounds_sentence(args, rounds),
        "",
        "| system | median step ms (min-max) | vs ddp | paired | params MiB | fp32 master MiB | optim MiB "
        "| grads MiB: peak in backward / after backward / after step | buckets MiB | total MiB | total / Ψ "
        "| max rel param diff vs ddp | rel L2 param diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        s = summary[name]
        mem = max(s["model_state_bytes_per_rank"], key=state_total)
        grads = " / ".join(
            mib(mem.get(key, mem["gradients"])) for key in ("gradients", "grads after backward", "grads after step")
        )
        buckets = mib(mem["buckets peak in backward"]) if "buckets peak in backward" in mem else "-"
        diff = "(reference)" if name == "ddp" else f"{s['max_rel_param_diff']:.1e}"
        if s.get("bitwise_equal"):
            diff += " (bit-equal)"
        l2 = "-" if name == "ddp" else f"{s['rel_l2_param_diff']:.1e}"
        lines.append(
            f"| {name} | {s['step_ms_median']:.0f} ({s['step_ms_min']:.0f}-{s['step_ms_max']:.0f}) "
            f"| {s['ratio_to_ddp']:.3f}x | {s['paired_ratio_median']:.3f}x | {mib(mem['params'])} "
            f"| {mib(mem.get('fp32 master', 0))} | {mib(mem['optimizer_states'])} | {grads} | {buckets} "
            f"| {mib(state_total(mem))} | {state_total(mem) / numel:.2f} | {diff} | {l2} |"
        )
    phase_names = list(dict.fromkeys(p for name in names for p in summary[name]["phase_ms_median"]))
    lines += [
        "",
        "vs ddp = median step / ddp's; paired = median over rounds of step / ddp's step in the same round. "
        f"Other processes used {load['foreign_cpu_s']:.0f} CPU-s during the {load['wall_s']:.0f} s run "
        f"({100 * load['foreign_share']:.0f}% of the machine). Model states: the rank with the most, counted from "
        "the tensors in one untimed step after the run (see the docstring); total = params + fp32 master + optim + "
        "grads at their peak in backward, without DeepSpeed's reduction-bucket buffers (buckets, listed apart; DDP's "
        "buckets are its gradients, gradient_as_bucket_view=True).",
        "",
        "Median phase times per step (ms, slowest rank):",
        "",
        "| system | " + " | ".join(phase_names) + " |",
        "|---|" + "---|" * len(phase_names),
    ]
    for name in names:
        values = summary[name]["phase_ms_median"]
        lines.append(
            f"| {name} | " + " | ".join(f"{values[p]:.1f}" if p in values else "-" for p in phase_names) + " |"
        )
    return "\n".join(lines)


def versions() -> dict[str, Any]:
    deepspeed = import_deepspeed()
    return {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
        **code_version(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="target parameter count of the GPT")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=16, help="measured steps per system (clean rounds wanted)")
    parser.add_argument("--max-rounds", type=int, help="measure at most this many rounds (default 2 x --steps)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--systems", default=",".join(SYSTEMS[:4]), help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket; DeepSpeed reduce/allgather bucket")
    parser.add_argument("--max-foreign", type=float, default=0.05)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    args.max_rounds = args.max_rounds or 2 * args.steps
    args.device = "cpu"
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems or len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems: distinct names from {SYSTEMS}, got {args.systems}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = versions()  # fails with the install hint before any rank is spawned
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    print(f"# {model_config(args)} | {info}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    busy_before, own_before = machine_busy_s(), own_cpu_s()
    timing = on_ranks(timing_rank, args)
    wall = time.perf_counter() - started
    foreign = (machine_busy_s() - busy_before) - (own_cpu_s() - own_before)
    load = {"wall_s": wall, "foreign_cpu_s": foreign, "foreign_share": foreign / (wall * (os.cpu_count() or 1))}
    summary = summarize(args, timing)
    print(markdown(args, summary, info, load))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "model": vars(model_config(args)),
            "environment": info,
            "deepspeed_configs": timing[0]["ds_configs"],
            "deepspeed_optimizers": timing[0]["ds_optimizers"],
            "summary": summary,
            "timing_run_load": load,
        }
        out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()

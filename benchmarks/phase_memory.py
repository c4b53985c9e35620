"""Where in a training step the RSS peaks: forward, backward, prepare_step, optimizer step, per system.

Run on demand, from the repository root::

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/phase_memory.py zero3_bf16 fsdp2_bf16 zero3 fsdp2

Each system (names of bench_zero.py) trains on 2 fresh gloo ranks for ``--steps`` steps. Before each phase of a
step the kernel's peak-RSS counter (``VmHWM``) is reset (``/proc/self/clear_refs``); after the phase its peak is
read, and so is the RSS when the phase ends. Printed per system (rank 0, last step, MiB over the RSS at the start
of the step): for each phase its peak and its end. Run it with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed
buffers leave the RSS (see docs/benchmarks.md). Memory that an earlier step freed but the allocator kept
resident is reused without raising the RSS, so a peak shows what a phase added on top of that, not all it used.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_zero
import torch
from zero_bench.launch import on_ranks
from zero_bench.measure import batch_stream, model_config
from zero_bench.names import SYSTEMS
from zero_bench.systems import build_system, lm_loss

PHASES = ("forward", "backward", "prepare_step", "step")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS


def phase_peaks(rank: int, world_size: int, args: argparse.Namespace, name: str) -> list[dict[str, float]]:
    """Per step: the peak RSS of each phase (``phase``) and the RSS at its end (``phase/end``) over the RSS at the
    step's start, in MiB."""
    torch.set_num_threads(args.threads)
    system = build_system(name, model_config(args), args, None)
    engine = getattr(system, "engine", None)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=name.endswith("_bf16"))
    stream = batch_stream(args, rank)
    steps = []
    for _ in range(args.steps):
        x, y = next(stream)
        start, peaks = _status_mib("VmRSS"), {}
        _reset_peak()
        system.optimizer.zero_grad()
        with autocast:
            loss = lm_loss(system.model, x, y)
        peaks["forward"] = _status_mib("VmHWM") - start
        peaks["forward/end"] = _status_mib("VmRSS") - start
        _reset_peak()
        loss.backward()
        peaks["backward"] = _status_mib("VmHWM") - start
        peaks["backward/end"] = _status_mib("VmRSS") - start
        _reset_peak()
        if engine is not None:
            engine.step_of(system.optimizer).prepare()
        peaks["prepare_step"] = _status_mib("VmHWM") - start
        peaks["prepare_step/end"] = _status_mib("VmRSS") - start
        _reset_peak()
        system.optimizer.step()  # ZeRO: the step window, the masters rounded and the new shards gathered
        peaks["step"] = _status_mib("VmHWM") - start
        peaks["step/end"] = _status_mib("VmRSS") - start
        steps.append(peaks)
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("systems", nargs="+", help=f"from {', '.join(SYSTEMS)}")
    parser.add_argument("--params", default="25e6")
    parser.add_argument("--steps", type=int, default=3)
    options, rest = parser.parse_known_args(argv)
    args = bench_zero.parse_args(["--params", options.params, *rest])
    print(f"RSS over the step's start, MiB (rank 0, step {options.steps}), peak / end of: " + " | ".join(PHASES))
    for name in options.systems:
        args.steps = options.steps
        result: Any = on_ranks(phase_peaks, args, name)
        last = result[0][-1]
        print(f"{name}: " + " | ".join(f"{last[phase]:.1f} / {last[phase + '/end']:.1f}" for phase in PHASES))


if __name__ == "__main__":
    main()

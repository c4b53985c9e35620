"""The step peak's ledger (core/peak.py) and record (StepPeak, MemoryReport.as_dict) without ranks."""

from __future__ import annotations

import torch

from lightning_zero import MemoryReport, StepPeak
from lightning_zero.core.peak import DETACHED, PeakLedger, Tracked


def test_the_peak_is_the_snapshot_at_the_highest_sum_not_each_kinds_maximum() -> None:
    ledger = PeakLedger()
    ledger.hold("gathered", "unit", 10)
    ledger.hold("buckets", "staging", 5)  # sum 15: the peak
    ledger.release("unit")
    ledger.hold("buckets", "staging", 12)  # replaces the 5: sum 12, buckets' own maximum
    ledger.release("never held")  # a no-op
    assert ledger.current == {"gathered": 0, "buckets": 12, "temporaries": 0}
    assert ledger.peak == {"gathered": 10, "buckets": 5, "temporaries": 0}
    ledger.reset()  # a new step starts from what is held now
    assert ledger.peak == {"gathered": 0, "buckets": 12, "temporaries": 0}
    ledger.hold("temporaries", "grads", 1)
    assert ledger.peak == {"gathered": 0, "buckets": 12, "temporaries": 1}


class Holder:
    staging: Tracked[torch.Tensor | None] = Tracked("buckets")

    def __init__(self, ledger: PeakLedger | None) -> None:
        if ledger is not None:
            self.ledger = ledger
        self.staging = None


def test_a_tracked_attribute_counts_what_it_holds() -> None:
    ledger = PeakLedger()
    holder, other = Holder(ledger), Holder(ledger)
    holder.staging = torch.zeros(10)  # 40 bytes
    other.staging = torch.zeros(3, dtype=torch.bfloat16)  # 6 bytes, under its own key
    assert ledger.current["buckets"] == 46
    holder.staging = torch.zeros(2, dtype=torch.float64)  # replaced: 16 bytes
    other.staging = None  # freed
    assert ledger.current["buckets"] == 16
    assert ledger.peak["buckets"] == 46
    assert holder.staging.dtype == torch.float64
    detached = Holder(None)  # no ledger of its own: the detached one, which records nothing
    detached.staging = torch.zeros(100)
    assert DETACHED.current["buckets"] == 0
    assert ledger.current["buckets"] == 16


def test_step_peak_adds_the_allocators_remainder_as_activations() -> None:
    transient = {"gathered": 30, "buckets": 20, "temporaries": 10}
    cpu = StepPeak.of(100, transient)
    assert (cpu.total, cpu.activations, cpu.allocated) == (160, None, None)
    assert "activations" not in cpu.by_kind
    cuda = StepPeak.of(100, transient, allocated=1000)
    assert cuda.activations == 840
    assert cuda.total == 1000
    assert StepPeak.of(100, transient, allocated=150).activations == 0  # never negative
    report = MemoryReport(params=60, gradients=20, optimizer_states=20, step_peak=cuda)
    flat = report.as_dict()
    assert flat["total"] == 100
    assert flat["peak"] == 1000
    assert {k: v for k, v in flat.items() if k.startswith("peak_")} == {
        "peak_model_states": 100,
        "peak_gathered": 30,
        "peak_buckets": 20,
        "peak_temporaries": 10,
        "peak_activations": 840,
    }
    assert "step_peak" not in flat
    assert set(MemoryReport(0, 0, 0).as_dict()) == {*flat} - {"peak"} - {k for k in flat if k.startswith("peak_")}

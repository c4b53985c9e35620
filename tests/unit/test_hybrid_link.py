"""benchmarks/hybrid_link.py without running it: its options, its reading of link rates and its table (the run
itself needs root and network namespaces and takes minutes: by hand only)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.unit.bench_scripts import benchmark_script


@pytest.fixture(scope="module")
def hybrid_link() -> Iterator[ModuleType]:
    with benchmark_script("hybrid_link") as module:
        yield module


def test_defaults_time_every_system_but_zero2_hybrid_at_the_default_rate(hybrid_link: ModuleType) -> None:
    args = hybrid_link.parse_args([])
    assert args.rate == hybrid_link.DEFAULT_RATE
    assert args.rate_bits == hybrid_link.rate_bits_per_s(hybrid_link.DEFAULT_RATE)
    zeropp = ["zero3_qw", "zero3_qg", "zero3_hp", "zero3_pp"]
    assert args.systems == ["ddp", "fsdp2", "fsdp2_hsdp", "zero2", "zero3", "zero3_hybrid", *zeropp]
    assert args.shard_size == 2
    chosen = hybrid_link.parse_args(["--rate", "off", "--systems", "zero3, zero2_hybrid"])
    assert (chosen.rate_bits, chosen.systems) == (None, ["zero3", "zero2_hybrid"])


@pytest.mark.parametrize(
    ("rate", "bits"), [("200mbit", 2e8), ("1gbit", 1e9), ("1.5Gbit", 1.5e9), ("800kbit", 8e5), ("64bit", 64.0)]
)
def test_rates_read_in_tc_decimal_units(hybrid_link: ModuleType, rate: str, bits: float) -> None:
    assert hybrid_link.rate_bits_per_s(rate) == bits


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "100mbps"], "--rate '100mbps' is not a rate"),
        (["--rate", "fast"], "is not a rate"),
        (["--systems", "zero3,zero4"], "--systems needs distinct names"),
        (["--systems", "zero3,zero3"], "--systems needs distinct names"),
        (["--shard-size", "3"], "does not divide the world size 4"),
        (["--warmup", "0"], "must be at least 1"),
    ],
)
def test_bad_options_name_the_problem(
    hybrid_link: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        hybrid_link.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(re.escape(message), capsys.readouterr().err)


def test_table_has_ratios_to_flat_stage_3_link_mib_and_unavailable_rows(hybrid_link: ModuleType) -> None:
    args = hybrid_link.parse_args(["--rate", "8mbit", "--systems", "ddp,zero3,zero3_hybrid", "--steps", "3"])
    mib = 2**20
    result = {
        "rows": {
            "ddp": {"status": "ok", "step_s": [0.5, 0.1, 0.2], "link_rx_tx_bytes": [[mib, 3 * mib]] * 3},
            "zero3": {"status": "ok", "step_s": [0.4, 0.4, 0.9], "link_rx_tx_bytes": [[2 * mib, 2 * mib]] * 3},
            "zero3_hybrid": {"status": "unavailable: rank 0: TypeError: no shard_size"},
        }
    }
    summary = hybrid_link.summarize(args, result)
    assert summary["ddp"]["step_ms_median"] == pytest.approx(200)
    assert summary["ddp"]["ratio_to_zero3"] == pytest.approx(0.5)
    assert summary["ddp"]["link_mib_per_step"] == pytest.approx(4)
    assert summary["ddp"]["link_floor_ms"] == pytest.approx(3 * mib * 8 / 8e6 * 1e3)  # the busier direction
    assert summary["zero3"]["ratio_to_zero3"] == pytest.approx(1)
    table = hybrid_link.markdown(args, summary)
    assert "| ddp | 200 | 0.50 | 4.0 | 3146 |" in table
    assert "| zero3_hybrid | unavailable: rank 0: TypeError: no shard_size |" in table

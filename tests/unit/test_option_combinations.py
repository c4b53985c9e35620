"""Every combination of ZeroStrategy's options, legal and odd values alike, either constructs or raises a
``ValueError``, never another error; the options that are
invalid together are exactly those the contract lists."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from torch import nn

from lightning_zero import ZeroStrategy

VALUES = {
    "stage": [0, 1, 2, 3, 4, "3", None, 2.0, True],
    "offload_optimizer": [False, "cpu", "nvme", "gpu", True, None],
    "offload_params": [False, "cpu", "nvme", "disk", None],
    "nvme_path": [None, "/tmp", "", 3],
    "partition": ["flat", "parameter", "tensor"],
    "bucket_cap_mb": [25, 0, -1, 0.001, float("nan"), float("inf"), 1e308, "25"],
    "state_dict_type": ["sharded", "full", "zip"],
    "start_method": ["popen", "spawn", "fork", "forkserver"],
    "shard_size": [None, 1, 2, 0, -2],
    "weighted_loss": [False, True, "yes"],
    "quantize_weights": [False, True, 1],
    "free_gradients_after_step": [False, True, "yes"],
    "overlap_comm": [True, False, 0],
    "timeout": [timedelta(minutes=30), timedelta(seconds=0), 30],
    "wrap_policy": [None, {nn.Linear}, lambda module: False, 5],
}
# Two options at a time over every pair of values (each option's own values alone are covered by the pairs too).
PAIRS = [((a, va), (b, vb)) for a, b in itertools.combinations(VALUES, 2) for va in VALUES[a] for vb in VALUES[b]]


def _build(options: dict[str, object]) -> str:
    try:
        strategy = ZeroStrategy(**options)
    except ValueError:
        return "ValueError"
    assert strategy.config.engine.bucket_cap_bytes >= 0  # what setup derives from the options exists too
    return "ok"


@pytest.mark.parametrize("chunk", range(8))
def test_every_pair_of_option_values_constructs_or_raises_a_value_error(chunk: int) -> None:
    outcomes = []
    for pair in PAIRS[chunk::8]:
        options = dict(pair)
        outcomes.append(_build(options))  # anything but these two fails the test with its own traceback
    assert outcomes


@pytest.mark.parametrize(
    "options",
    [
        {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": "/tmp"},
        {"stage": 2, "offload_optimizer": "cpu"},
        {"stage": 1, "offload_optimizer": "nvme", "nvme_path": "/tmp", "state_dict_type": "full"},
        {"stage": 3, "wrap_policy": {nn.Linear}, "weighted_loss": True, "start_method": "spawn"},
        {"stage": 3, "quantize_weights": True, "offload_optimizer": "cpu", "offload_params": "cpu", "shard_size": 2},
    ],
)
def test_legal_combinations_construct(options: dict[str, object]) -> None:
    assert _build(options) == "ok"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"stage": 2, "offload_params": "cpu"}, "offload_params"),
        ({"stage": 3, "offload_optimizer": "nvme"}, "nvme_path"),
        ({"stage": 3, "offload_params": "nvme", "nvme_path": "/tmp"}, "offload_optimizer"),
        ({"stage": 4}, "stage"),
        ({"partition": "tensor"}, "partition"),
        ({"timeout": timedelta(0)}, "timeout must be positive"),
        ({"nvme_path": 3}, "nvme_path"),
        ({"stage": 2, "quantize_weights": True}, "quantize_weights"),
        ({"stage": 3, "quantize_weights": True, "partition": "parameter"}, "quantize_weights"),
        ({"free_gradients_after_step": 1}, "free_gradients_after_step"),
    ],
)
def test_invalid_combinations_name_the_option(options: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ZeroStrategy(**options)

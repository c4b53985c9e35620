"""estimate_memory() follows the ZeRO paper's formulas, on meta-device models, with checked arguments."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_zero
from lightning_zero import MemoryEstimate, estimate_memory

TRAINABLE = 1200  # divisible by every world size used below, so the shards are exact
FROZEN = 240


class TwoTensors(nn.Module):
    """One trainable and one frozen parameter, on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.trained = nn.Parameter(torch.empty(TRAINABLE, device="meta"))
        self.frozen = nn.Parameter(torch.empty(FROZEN, device="meta"), requires_grad=False)


@pytest.fixture
def model() -> nn.Module:
    return TwoTensors()


# ----------------------------------------------------------------------------- ZeRO paper, Figure 1


@pytest.mark.parametrize(("stage", "gigabytes"), [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, gigabytes: float) -> None:
    # Ψ = 7.5B, N_d = 64, mixed-precision Adam (K = 12): (2 + 2 + 12)Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(10_000, 10_000, bias=False) for _ in range(75)))
    assert sum(p.numel() for p in model.parameters()) == 7_500_000_000
    estimate = estimate_memory(model, stage=stage, world_size=64, precision="16-mixed", optimizer="adam")
    assert round(estimate.total / 1e9, 1) == gigabytes
    assert estimate.offloaded == 0


# ----------------------------------------------------------------------------- formulas


@pytest.mark.parametrize(
    ("precision", "param_width", "frozen_width", "grad_width", "master_width"),
    [("32-true", 4, 4, 4, 0), ("16-mixed", 2, 4, 2, 4), ("bf16-mixed", 2, 4, 2, 4), ("bf16-true", 2, 2, 2, 4)],
)
@pytest.mark.parametrize(
    ("optimizer", "k"), [("adamw", 8), ("adam", 8), ("sgd", 0), ("sgd_momentum", 4), ("adagrad", 4), ("rmsprop", 4)]
)
def test_bytes_per_parameter_at_stage_0(
    model: nn.Module,
    precision: str,
    param_width: int,
    frozen_width: int,
    grad_width: int,
    master_width: int,
    optimizer: str,
    k: int,
) -> None:
    estimate = estimate_memory(model, stage=0, world_size=4, precision=precision, optimizer=optimizer)
    # Frozen parameters cost parameter bytes (no master: the mixed modes keep them in fp32)...
    assert estimate.params == param_width * TRAINABLE + frozen_width * FROZEN
    assert estimate.gradients == grad_width * TRAINABLE  # ...and nothing else
    assert estimate.optimizer_states == (k + master_width) * TRAINABLE
    assert estimate.offloaded == 0


@pytest.mark.parametrize(
    ("stage", "divided"),
    [
        (0, ()),
        (1, ("optimizer_states",)),
        (2, ("optimizer_states", "gradients")),
        (3, ("optimizer_states", "gradients", "params")),
    ],
)
def test_each_stage_divides_one_more_state_by_world_size(model: nn.Module, stage: int, divided: tuple[str]) -> None:
    full = estimate_memory(model, stage=0, world_size=4).as_dict()
    sharded = estimate_memory(model, stage=stage, world_size=4).as_dict()
    for name in ("params", "gradients", "optimizer_states"):
        assert sharded[name] == (full[name] // 4 if name in divided else full[name]), name
    assert sharded["total"] == sharded["params"] + sharded["gradients"] + sharded["optimizer_states"]


def test_shards_round_up(model: nn.Module) -> None:
    # 32-true SGD with momentum: 4 * 1200 bytes of state over 7 ranks is 685.7 -> 686 bytes per rank.
    estimate = estimate_memory(model, stage=1, world_size=7, precision="32-true", optimizer="sgd_momentum")
    assert estimate.optimizer_states == 686


def test_tied_parameters_count_once() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100, bias=False))
    model[1].weight = model[0].weight
    assert estimate_memory(model, stage=0, world_size=1, precision="32-true").params == 4 * 800


@pytest.mark.parametrize("target", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_moves_the_optimizer_states(model: nn.Module, target: str, stage: int) -> None:
    on_device = estimate_memory(model, stage=stage, world_size=4)
    offloaded = estimate_memory(model, stage=stage, world_size=4, offload_optimizer=target)
    assert offloaded.optimizer_states == 0
    assert offloaded.offloaded == on_device.optimizer_states == (8 + 4) * TRAINABLE // 4  # Adam + fp32 master
    assert (offloaded.params, offloaded.gradients) == (on_device.params, on_device.gradients)
    assert offloaded.total == on_device.total - on_device.optimizer_states


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_offloaded_32_true_counts_the_host_fp32_copy(model: nn.Module, target: str) -> None:
    """In 32-true the device keeps the fp32 parameters and the host the fp32 master the optimizer steps: Adam's
    offloaded state is 12 bytes a parameter, not the 8 of its moments."""
    on_device = estimate_memory(model, stage=2, world_size=4, precision="32-true")
    offloaded = estimate_memory(model, stage=2, world_size=4, precision="32-true", offload_optimizer=target)
    assert on_device.optimizer_states == 8 * TRAINABLE // 4
    assert offloaded.offloaded == 12 * TRAINABLE // 4
    assert offloaded.optimizer_states == 0


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_offload_params_moves_the_parameter_shard_at_stage_3(model: nn.Module, target: str) -> None:
    on_device = estimate_memory(model, stage=3, world_size=4)
    params_off = estimate_memory(model, stage=3, world_size=4, offload_params=target)
    assert params_off.params == 0
    assert params_off.offloaded == on_device.params == (2 * TRAINABLE + 4 * FROZEN) // 4  # 16-mixed by default
    assert params_off.total == on_device.gradients + on_device.optimizer_states
    both = estimate_memory(model, stage=3, world_size=4, offload_optimizer="cpu", offload_params=target)
    assert both.offloaded == on_device.params + on_device.optimizer_states
    assert both.total == on_device.gradients


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_accumulation_with_both_offloads_on_nvme_adds_the_waiting_reduction(model: nn.Module, precision: str) -> None:
    """ZeRO-Infinity keeps the gradient shard in the swap file; accumulating, each reduction's fp32 result waits in a
    second region there until backward ends: 4 bytes per trained element / N more, in every precision."""
    options = {"stage": 3, "world_size": 4, "precision": precision}
    nvme = {"offload_optimizer": "nvme", "offload_params": "nvme"}
    once = estimate_memory(model, **options, **nvme)
    accumulating = estimate_memory(model, **options, **nvme, accumulate_grad_batches=4)
    assert accumulating.offloaded - once.offloaded == 4 * TRAINABLE // 4
    assert (accumulating.params, accumulating.gradients, accumulating.total) == (0, 0, 0)
    elsewhere = [{"offload_optimizer": "cpu", "offload_params": "nvme"}, {"offload_optimizer": "nvme"}, {}]
    for offload in elsewhere:  # the gradient shard in memory: accumulation adds nothing that stays
        kept = estimate_memory(model, **options, **offload)
        assert estimate_memory(model, **options, **offload, accumulate_grad_batches=4) == kept, offload


def test_memory_estimate_is_a_frozen_record_like_memory_report(model: nn.Module) -> None:
    estimate = estimate_memory(model, stage=2, world_size=4, precision="32-true")
    assert estimate.as_dict() == {
        "params": 4 * (TRAINABLE + FROZEN),
        "gradients": 4 * TRAINABLE // 4,
        "optimizer_states": 8 * TRAINABLE // 4,
        "offloaded": 0,
        "owned_max": TRAINABLE // 4,
        "owned_min": TRAINABLE // 4,
        "total": 4 * (TRAINABLE + FROZEN) + 12 * TRAINABLE // 4,
    }
    assert set(estimate.as_dict()) == set(lightning_zero.MemoryReport(0, 0, 0).as_dict())
    assert not hasattr(estimate, "__dict__")  # slots
    with pytest.raises(dataclasses.FrozenInstanceError):
        estimate.params = 0  # type: ignore[misc]
    assert isinstance(estimate, MemoryEstimate)


def test_a_70b_model_on_the_meta_device_is_estimated_without_allocation() -> None:
    with torch.device("meta"):  # 298 x 8192 x 28672 = 69.99B parameters, nothing allocated
        model = nn.Sequential(*(nn.Linear(8192, 28672, bias=False) for _ in range(298)))
    psi = 298 * 8192 * 28672
    estimate = estimate_memory(model, stage=3, world_size=64, offload_optimizer="cpu")
    assert estimate.params == estimate.gradients == 2 * psi // 64
    assert estimate.offloaded == 12 * psi // 64
    assert all(p.is_meta for p in model.parameters())


# ----------------------------------------------------------------------------- hybrid sharding

OFFLOADS = [(False, False), ("cpu", False), ("nvme", False), ("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")]
# (stage, offload_optimizer, offload_params): every offload pair each stage accepts
STAGE_OFFLOADS = [
    (stage, optimizer, params)
    for stage in (0, 1, 2, 3)
    for optimizer, params in OFFLOADS
    if not (optimizer and stage == 0) and not (params and stage != 3)
]


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize(("stage", "offload_optimizer", "offload_params"), STAGE_OFFLOADS)
@pytest.mark.parametrize("partition", ["flat", "parameter"])
def test_shard_size_k_gives_the_figures_of_a_world_of_k(
    precision: str, stage: int, offload_optimizer: str | bool, offload_params: str | bool, partition: str
) -> None:
    with torch.device("meta"):  # uneven tensors and a frozen one, so that owners and rounding matter
        model = nn.Sequential(nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(5, 3, bias=False))
    model[1].bias.requires_grad_(False)
    options = {
        "stage": stage,
        "precision": precision,
        "offload_optimizer": offload_optimizer,
        "offload_params": offload_params,
        "partition": partition,
        "accumulate_grad_batches": 2,
    }
    for world_size, shard_size in [(4, 2), (6, 3), (8, 4), (6, 1), (4, 4)]:
        hybrid = estimate_memory(model, world_size=world_size, shard_size=shard_size, **options)
        alone = estimate_memory(model, world_size=shard_size, **options)
        assert hybrid == alone, (world_size, shard_size)
    # shard_size=None and shard_size=world_size both shard over all ranks, and hybrid differs from them
    everyone = estimate_memory(model, world_size=8, **options)
    assert estimate_memory(model, world_size=8, shard_size=8, **options) == everyone
    if stage > 0:
        assert estimate_memory(model, world_size=8, shard_size=2, **options).as_dict() != everyone.as_dict()


def test_shard_size_divides_by_the_group_not_the_world(model: nn.Module) -> None:
    # 32-true AdamW, Ψ = 1200 trained, Φ = 240 frozen, 16 ranks in groups of 4: each /N is /4.
    estimate = estimate_memory(model, stage=3, world_size=16, precision="32-true", shard_size=4)
    assert estimate.params == (4 * TRAINABLE + 4 * FROZEN) // 4
    assert estimate.gradients == 4 * TRAINABLE // 4
    assert estimate.optimizer_states == 8 * TRAINABLE // 4
    assert (estimate.owned_max, estimate.owned_min) == (TRAINABLE // 4, TRAINABLE // 4)


def test_stage_0_ignores_shard_size(model: nn.Module) -> None:
    assert estimate_memory(model, stage=0, world_size=8, shard_size=2) == estimate_memory(model, stage=0, world_size=8)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 4}, r"stage=4 is not supported; choose one of \[0, 1, 2, 3\]"),
        ({"stage": True}, r"stage=True is not supported"),
        ({"stage": "2"}, r"stage='2' is not supported"),
        ({"world_size": 0}, r"world_size=0 is not supported; choose a positive int"),
        ({"world_size": 2.0}, r"world_size=2.0 is not supported"),
        ({"world_size": True}, r"world_size=True is not supported"),
        (
            {"precision": "16-true"},
            r"precision='16-true' is not supported; choose one of \['32-true', '16-mixed', 'bf16-mixed', 'bf16-true'\]",
        ),
        (
            {"optimizer": "lamb"},
            r"optimizer='lamb' is not supported; choose one of "
            r"\['adamw', 'adam', 'sgd', 'sgd_momentum', 'adagrad', 'rmsprop'\]",
        ),
        ({"optimizer": "AdamW"}, r"optimizer='AdamW' is not supported"),
        (
            {"offload_optimizer": "gpu"},
            r"offload_optimizer='gpu' is not supported; choose one of \[False, 'cpu', 'nvme'\]",
        ),
        ({"offload_optimizer": True}, r"offload_optimizer=True is not supported"),
        ({"offload_params": "disk", "stage": 3}, r"offload_params='disk' is not supported"),
        ({"offload_optimizer": "cpu", "stage": 0}, r"offload_optimizer='cpu' needs stage >= 1, got stage=0"),
        ({"offload_params": "cpu", "stage": 2}, r"offload_params='cpu' needs stage=3, got stage=2"),
        ({"accumulate_grad_batches": 0}, r"accumulate_grad_batches=0 is not supported; choose a positive int"),
        ({"accumulate_grad_batches": True}, r"accumulate_grad_batches=True is not supported"),
        ({"accumulate_grad_batches": 2.0}, r"accumulate_grad_batches=2.0 is not supported"),
        (
            {"shard_size": 3},
            r"shard_size=3 does not divide world_size=4: pick a divisor of 4 \(1, 2, 4\) such as the number of "
            r"processes per node",
        ),
        ({"shard_size": 8}, r"shard_size=8 does not divide world_size=4"),
        ({"shard_size": 3, "stage": 0}, r"shard_size=3 does not divide world_size=4"),  # checked at stage 0 too
        (
            {"shard_size": 0},
            r"shard_size=0 is not supported; choose a positive int that divides world_size=4 \(e.g. the number of "
            r"processes per node\), or None",
        ),
        ({"shard_size": -2}, r"shard_size=-2 is not supported"),
        ({"shard_size": True}, r"shard_size=True is not supported"),
        ({"shard_size": 2.0}, r"shard_size=2.0 is not supported"),
        ({"shard_size": "2"}, r"shard_size='2' is not supported"),
    ],
)
def test_invalid_arguments_raise_value_error(model: nn.Module, kwargs: dict, match: str) -> None:
    arguments = {"stage": 2, "world_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_memory(model, **arguments)


def test_model_must_be_a_module() -> None:
    with pytest.raises(ValueError, match=r"model must be a torch.nn.Module, got dict"):
        estimate_memory({}, stage=2, world_size=4)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- layering

PACKAGE_DIR = str(Path(lightning_zero.__file__).parent)
LAYERING = f"""
import sys, types
package = types.ModuleType("lightning_zero")
package.__path__ = [{PACKAGE_DIR!r}]
sys.modules["lightning_zero"] = package
import lightning_zero.core.engine
assert "lightning_zero.estimate" not in sys.modules, "the core imports estimate"
import lightning_zero.estimate
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
assert not loaded, f"estimate loads lightning: {{loaded}}"
"""


def test_estimate_never_imports_lightning_and_the_core_never_imports_estimate() -> None:
    result = subprocess.run([sys.executable, "-c", LAYERING], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_partition_parameter_gives_the_most_loaded_owner() -> None:
    with torch.device("meta"):  # 4 tensors of 100, 60, 50, 10 elements
        model = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(6, 10, bias=False), nn.Linear(5, 10, bias=False))
        model.append(nn.Linear(1, 10, bias=False))
    flat = estimate_memory(model, stage=3, world_size=2, precision="32-true", partition="flat")
    owned = estimate_memory(model, stage=3, world_size=2, precision="32-true", partition="parameter")
    assert (flat.owned_max, flat.owned_min) == (110, 110)
    assert (owned.owned_max, owned.owned_min) == (110, 110)  # 100 + 10 | 60 + 50
    three = estimate_memory(model, stage=3, world_size=3, precision="32-true", partition="parameter")
    assert (three.owned_max, three.owned_min) == (100, 60)  # 100 | 60 | 50 + 10
    assert three.params == 4 * 100
    assert three.gradients == 4 * 100
    assert three.optimizer_states == 8 * 100  # AdamW: the most loaded rank's state
    ddp = estimate_memory(model, stage=0, world_size=3, precision="32-true", partition="parameter")
    assert ddp.optimizer_states == 8 * 220
    with pytest.raises(ValueError, match="partition='tensor' is not supported"):
        estimate_memory(model, stage=1, world_size=2, partition="tensor")

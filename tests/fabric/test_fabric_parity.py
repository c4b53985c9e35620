"""ZeroFabricStrategy's training guarantees on 2 and 3 real gloo ranks (3: odd shards need padding), one spawn per
rank count (tests/fabric/parity.py runs everything):

- fp32: stages 1-3 equal Fabric's DDPStrategy with gradient accumulation (``fabric.no_backward_sync``) and clipping
  by norm (``fabric.clip_gradients``), set up with ``fabric.setup`` or ``setup_module`` + ``setup_optimizers``, with
  one optimizer or two over disjoint parts; ``Fabric(strategy="zero_2")`` equals the class form. The tolerance is
  calibrated by a local run that sums the same gradients in another order.
- bf16-mixed: Fabric equals the Trainer's ZeroStrategy doing the same maths bit for bit (see
  :func:`test_bf16_mixed_equals_the_trainer`).
- ``fabric.init_module()`` at stage 3: created on the meta device, only the shard held after setup, never the full
  model, and trained bit-equal to a model created normally and initialised as the engine does.
- Wrong setups raise a clear error on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.models import TinyLM
from tests.fabric.parity import (
    CLIP,
    KINDS,
    STAGES,
    STEPS,
    WIDE_BYTES,
    WIDE_UNIT_BYTES,
    run_all,
)
from tests.helpers import run_on_ranks

TOLERANCE = 1e-5
FP32 = 4


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    # glibc returns large freed buffers to the system only when they were mmapped: a low threshold makes RSS follow
    # what is live, for the peak-memory check (the ranks inherit the environment).
    return run_on_ranks(run_all, request.param, env={"MALLOC_MMAP_THRESHOLD_": "65536"})


def _each_rank(results: list[dict[str, Any]], key: str) -> list[Any]:
    return [per_rank[key] for per_rank in results]


# ------------------------------------------------------------------------------------------------ fp32 vs DDP
@pytest.mark.parametrize("setup", ["together", "separate"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stage", STAGES)
def test_fp32_equals_fabric_ddp(results: list[dict[str, Any]], stage: int, kind: str, setup: str) -> None:
    name = f"stage{stage}/{kind}/{setup}"
    for rank, per_rank in enumerate(results):
        difference, spread = per_rank[name], per_rank[f"spread/{kind}"]
        assert difference <= TOLERANCE, (
            f"rank {rank}: {name} differs from DDP by {difference:.2e} (spread {spread:.2e})"
        )
        # fabric.clip_gradients returns the norm over every shard: DDP's, up to rounding.
        assert per_rank[f"norms/{name}"] <= TOLERANCE, f"rank {rank}: {name}'s gradient norms differ from DDP's"


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_penalty_inside_allow_autograd_grad_equals_fabric_ddp(
    results: list[dict[str, Any]], stage: int
) -> None:
    """``torch.autograd.grad(..., create_graph=True)`` through the module's outputs, which Fabric refuses for a
    strategy with its own backward unless the strategy's ``allow_autograd_grad()`` is entered (a user's trial: the
    documented gradient penalty failed with "requires you to call fabric.backward")."""
    assert _each_rank(results, f"penalty/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_grad_norm_after_fabric_backward_equals_fabric_ddp(results: list[dict[str, Any]], stage: int) -> None:
    """``lightning_zero.grad_norm(model, 2)`` between ``fabric.backward`` and the step gives Fabric's DDP norms, key
    by key, with one optimizer and with each of two named (under ZeRO the parameters have no ``.grad``); with two and
    none named it raises on every rank, naming the argument."""
    keys = results[0]["grad_norm/keys"]
    assert any(key.startswith("one/") and key.endswith("_total") for key in keys)
    assert any(key.startswith("two/1/1/") and key.endswith("head.weight") for key in keys), keys
    assert _each_rank(results, f"grad_norm/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)
    for error in _each_rank(results, f"grad_norm_error/stage{stage}"):
        assert "optimizer=optimizer" in error


@pytest.mark.parametrize("stage", STAGES)
def test_two_forwards_before_one_backward_equal_fabric_ddp(results: list[dict[str, Any]], stage: int) -> None:
    """``fabric.backward(f(model(a), model(b)))``: the second forward must not begin a new iteration (at stage 3 that
    freed the units the first forward's graph needs: "setStorage ... out of bounds for storage of size 0", found in a
    user's trial); after a forward that raised (caught), training still equals DDP."""
    assert _each_rank(results, f"two_forwards/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_evaluation_uses_rank_zeros_buffers_as_fabric_ddp(results: list[dict[str, Any]], stage: int) -> None:
    """A forward without gradients after a step broadcasts rank 0's buffers (BatchNorm statistics), as DDP's does:
    the evaluation outputs equal DDP's on every rank (rank 1's once used its own statistics); so do those of a
    ``copy.deepcopy`` of the module (an EMA's copy; the strategy's hooks once made it fail)."""
    assert _each_rank(results, f"evaluation/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_reentrant_checkpoints_of_the_users_own_equal_fabric_ddp(results: list[dict[str, Any]], stage: int) -> None:
    """``torch.utils.checkpoint(block.__call__, x, use_reentrant=True)`` around each block (a stage-3 unit): equal to
    Fabric's DDP without the checkpoints (see [Note: reentrant activation checkpointing at stage 3])."""
    assert _each_rank(results, f"reentrant/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_two_backwards_over_a_retained_graph_equal_fabric_ddp(results: list[dict[str, Any]], stage: int) -> None:
    """``fabric.backward(l1, retain_graph=True); fabric.backward(l2)`` over one forward: at stage 3 the second
    backward gathers the units again (see [Note: a retained graph])."""
    assert _each_rank(results, f"retained/stage{stage}") == pytest.approx([0.0] * len(results), abs=TOLERANCE)


@pytest.mark.parametrize("stage", STAGES)
def test_free_gradients_after_step_equals_fabric_ddp_and_frees_each_optimizers_own(
    results: list[dict[str, Any]], stage: int
) -> None:
    """``free_gradients_after_step=True`` with two optimizers over disjoint parts: the same parameters and norms
    as DDP; after the first ``step()`` its gradients are empty and the second's still held, after the second none."""
    for rank, per_rank in enumerate(results):
        assert per_rank[f"stage{stage}/two/free"] <= TOLERANCE, f"rank {rank}"
        assert per_rank[f"norms/stage{stage}/two/free"] <= TOLERANCE, f"rank {rank}"
        held = per_rank[f"held/stage{stage}"]
        assert len(held) == 2 * STEPS, held
        for first, second in zip(held[::2], held[1::2], strict=True):
            assert first[0] == 0, f"rank {rank}: the first optimizer's gradients after its step: {held}"
            assert first[1] > 0, f"rank {rank}: the second optimizer's gradients before its step: {held}"
            assert second == [0, 0], f"rank {rank}: after the second step: {held}"


@pytest.mark.parametrize("kind", KINDS)
def test_tolerance_is_above_the_reordering_spread(results: list[dict[str, Any]], kind: str) -> None:
    # DDP and a local run summing the same gradients in another order agree within the tolerance and differ at all:
    # the tolerance is neither too tight nor blind to rounding.
    spread = results[0][f"spread/{kind}"]
    assert 0 < spread <= TOLERANCE, f"reordered DDP spread {spread:.2e}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_clips(results: list[dict[str, Any]], kind: str) -> None:
    norms = results[0][f"ddp_norms/{kind}"]
    assert len(norms) == STEPS * (1 if kind == "one" else 2)
    assert min(norms) > CLIP, f"some gradient norms are below the clipping threshold: {norms}"


def test_registry_name_equals_the_class_form(results: list[dict[str, Any]]) -> None:
    assert _each_rank(results, "registry/strategy") == ["ZeroFabricStrategy stage 2"] * len(results)
    assert _each_rank(results, "registry/vs_class") == [0.0] * len(results)
    assert max(_each_rank(results, "registry/vs_ddp")) <= TOLERANCE


# ------------------------------------------------------------------------------------------------ bf16-mixed
@pytest.mark.parametrize("stage", STAGES)
def test_bf16_mixed_equals_the_trainer(results: list[dict[str, Any]], stage: int) -> None:
    # Bit-equal, not within a tolerance: both front doors run the same engine, autocast around the model's forward
    # and the same step. The one difference, Fabric upcasting the bf16 logits to fp32 after the forward
    # (convert_output) where the Trainer's cross_entropy runs under autocast (an fp32 op there, so it upcasts the
    # same logits), is an exact conversion either way, in forward and in backward.
    prefix = f"bf16/stage{stage}"
    for rank, per_rank in enumerate(results):
        assert per_rank[f"{prefix}/steps"] == STEPS
        assert per_rank[f"{prefix}/param_dtype"] == "torch.bfloat16"
        assert per_rank[f"{prefix}/vs_trainer"] == 0.0, f"rank {rank}: {per_rank[f'{prefix}/vs_trainer']:.2e}"
        # bf16 shows (the comparison is not of two fp32 runs), within what 4 steps of bf16 rounding explain.
        assert 1e-4 < per_rank[f"{prefix}/vs_fp32"] < 5e-2, per_rank[f"{prefix}/vs_fp32"]


# ------------------------------------------------------------------------------------------------ init_module
def _stage3_shard_bytes(world_size: int) -> int:
    """fp32 bytes of one rank's stage-3 shard of TinyLM with every Linear a unit and the embedding in the root: each
    unit's flat buffer padded to a multiple of the world size."""
    model = TinyLM()
    units = [model.a, model.b, model.c, model.head, model.emb]
    return FP32 * sum(-(-sum(p.numel() for p in unit.parameters()) // world_size) for unit in units)


def test_init_module_creates_on_meta_and_keeps_only_the_shard(results: list[dict[str, Any]]) -> None:
    world_size = len(results)
    for per_rank in results:
        assert all(per_rank["init/meta_before_setup"])
        assert per_rank["init/report_params"] == _stage3_shard_bytes(world_size)
        assert per_rank["init/resting_bytes"] == 0  # no parameter keeps a full storage after setup


def test_init_module_never_holds_the_full_model(results: list[dict[str, Any]]) -> None:
    world_size = len(results)
    for rank, per_rank in enumerate(results):
        lazy, eager = per_rank["init/peak_lazy"], per_rank["init/peak_eager"]
        # Created unit by unit: the shard plus about one unit in flight (two allowed for allocator slack).
        bound = WIDE_BYTES // world_size + 2 * WIDE_UNIT_BYTES
        assert lazy < bound, f"rank {rank}: peak grew {lazy / 1e6:.1f} MB, bound {bound / 1e6:.1f} MB"
        # Created normally the full model exists first: the measurement does see a full model.
        assert eager > WIDE_BYTES, f"rank {rank}: eager peak grew only {eager / 1e6:.1f} MB"


def test_init_module_trains_equal_to_a_normal_model(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        assert per_rank["init/initial_vs_normal"] == 0.0
        assert per_rank["init/trained_vs_normal"] == 0.0
        assert per_rank["init/moved"] > 1e-2  # training changed the parameters: trained models were compared
        # A tied weight keeps its creator's initialisation: the embedding's N(0, 1), not the head Linear's uniform
        # one of bound 1/sqrt(7) (std 0.22), which overwrote it before (see [Note: tied parameters created on the
        # meta device]).
        assert per_rank["init/tied_std"] > 0.6, per_rank["init/tied_std"]


# ------------------------------------------------------------------------------------------------ errors
ERRORS = {
    "error/second_model": ("RuntimeError", "shards one model: it set one up already"),
    "error/second_module": ("RuntimeError", "shards one model: it set one up already"),
    "error/optimizer_first": ("RuntimeError", "set up the model first: `model = fabric.setup_module(model)`"),
    "error/foreign_optimizer/stage1": ("ValueError", "not in the model"),
    "error/foreign_optimizer/stage2": ("ValueError", "not in the model"),
    "error/foreign_optimizer/stage3": ("ValueError", "not in the model"),
    "error/foreign_optimizer/together": ("ValueError", "not in the model"),
}


@pytest.mark.parametrize("key", sorted(ERRORS))
def test_wrong_setups_raise_a_clear_error_on_every_rank(results: list[dict[str, Any]], key: str) -> None:
    kind, phrase = ERRORS[key]
    for rank, message in enumerate(_each_rank(results, key)):
        assert message.startswith(f"{kind}: "), f"rank {rank}: {message}"
        assert phrase in message, f"rank {rank}: {message}"
        if "foreign" in key:
            assert "fabric.setup_module" in message, f"rank {rank}: the fix for Fabric is not named: {message}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_refused_optimizer_leaves_the_strategy_usable(results: list[dict[str, Any]], stage: int) -> None:
    # After setup_optimizers refused an optimizer of another model, the right ones set up and train exactly as if
    # the refused one had never been offered.
    assert _each_rank(results, f"recovered/stage{stage}") == [0.0] * len(results)


def test_a_joint_setup_refused_before_sharding_can_be_retried(results: list[dict[str, Any]]) -> None:
    """``fabric.setup(model, wrong_optimizer)`` raised before anything was sharded: ``fabric.setup(model,
    right_optimizer)`` then sets the same model up (not "it set one up already")."""
    assert _each_rank(results, "retried_setup") == ["no error"] * len(results)

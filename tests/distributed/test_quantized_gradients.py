"""``quantize_gradients`` (ZeRO++'s qgZ) on 4 gloo ranks numbered as 2 nodes x 2, flat and with ``shard_size=2``:
error feedback keeps the sum of many reductions of one bucket within one rounding of the exact sum, training stays
close to unquantized at stages 1-3, the bytes across nodes equal the formula, an fp16 overflow skips the step on
every rank, and on one node the option changes nothing, bit for bit (the same 4 ranks told they share one node:
``Communicator(ranks_per_node=4)``). One spawn.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero import estimate_memory
from lightning_zero.core.comm import Communicator
from lightning_zero.core.comm.quantize import (
    QUANT_BLOCK,
    BlockPlan,
    check_finite_scales,
    dequantize_blocks,
    quantize_blocks,
    quantized_nbytes,
)
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import DynamicLossScaler, PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.step.quantized_reduction import GRADIENT_BLOCK, QuantizedReduction, QuantizedSlices
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks
from tests.quantized_bytes import quantized_part_bytes

WORLD_SIZE, NODES, LOCAL = 4, 2, 2
STEPS = 3
SHARD = 300  # elements per rank in the direct reduction test: one whole block and a partial one
TRIALS = 200
# Relative difference of the parameter update (quantized vs exact, SGD, 3 steps): measured 0.2% flat, 0.3% hybrid with
# error feedback (0.6% and 1.2% with stochastic rounding).
UPDATE_TOLERANCE = 0.01


def _engine(
    stage: int,
    quantize: bool,
    shard_size: int | None = None,
    ranks_per_node: int | None = None,
    secondary_shard_size: int | None = None,
    **kwargs: Any,
) -> ZeroEngine:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    options = EngineOptions(
        stage=stage,
        bucket_cap_mb=0.001,
        wrap_policy={nn.Linear} if stage == 3 else None,
        shard_size=shard_size,
        secondary_shard_size=secondary_shard_size,
        quantize_gradients=quantize,
    )
    return ZeroEngine(model, [optimizer], options, Communicator(ranks_per_node=ranks_per_node), **kwargs)


def _train(
    rank: int,
    stage: int,
    quantize: bool,
    shard_size: int | None = None,
    ranks_per_node: int | None = None,
    secondary_shard_size: int | None = None,
) -> dict[str, Any]:
    """SGD for STEPS steps; the full parameters at the start and the end, and the last step's communication."""
    engine = _engine(stage, quantize, shard_size, ranks_per_node, secondary_shard_size)
    optimizer = engine.optimizers[0]
    with engine.gathered():
        start = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    for step in range(STEPS):
        engine.begin_iteration()
        optimizer.zero_grad()
        loss_fn(engine.module, *batch(seed=10 * step + rank)).backward()
        engine.finish_backward()
        optimizer.step()
    stats = engine.last_step_comm
    with engine.gathered():
        end = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    buffers = [b for b in engine.model.buffers if b.params[0].requires_grad]
    shards = [b.layout.shard_numel for b in buffers]
    tensors = [[(slot.numel, len(slot.shape)) for slot in b.layout.slots] for b in buffers]
    worlds = [b.layout.padded_numel // b.layout.shard_numel for b in buffers]
    report = engine.memory_report()
    engine.release()
    return {
        "residuals_after_release": sum(bucket.feedback_nbytes for bucket in engine.model.buckets),
        "gradients": report.gradients,
        "peak_buckets": report.step_peak.buckets,
        "start": start,
        "end": end,
        "by_op": dict(stats.by_op),
        "by_group": dict(stats.by_group),
        "inter": stats.inter_node_bytes,
        "shards": shards,
        "slices": [quantized_part_bytes(t, n, GRADIENT_BLOCK, False) for t, n in zip(tensors, worlds, strict=True)],
    }


def _feedback(rank: int, shard_size: int | None) -> dict[str, Any]:
    """One bucket of WORLD_SIZE x SHARD elements per rank, reduced TRIALS times with the same residuals: this rank's
    shard each time."""
    world = Communicator()
    topology = Topology.build(world, 2, shard_size, quantize_gradients=True)
    reduction = QuantizedReduction.of(topology)
    assert reduction is not None
    n = SHARD * (WORLD_SIZE if shard_size is None else shard_size)
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) * (1 + r) for r in range(WORLD_SIZE)]
    exact = torch.stack(inputs).double().sum(0)
    if shard_size is None:
        mine = exact[rank * SHARD : (rank + 1) * SHARD]
    else:
        mine = exact[rank % shard_size * SHARD : (rank % shard_size + 1) * SHARD]
    total, first = torch.zeros(SHARD, dtype=torch.float64), None
    slices = QuantizedSlices.uniform(SHARD, reduction.slices)
    for _ in range(TRIALS):
        output = torch.empty(SHARD)
        reduced = reduction.start(output, inputs[rank].clone())
        reduced.wait()
        reduction.across(output, reduced, slices).wait()
        first = output.clone() if first is None else first
        total += output.double()
    # At least the largest block scale of what travels (a node's partial sums): bounds a rounding's error.
    partials = [sum(inputs[r] for r in range(node * LOCAL, (node + 1) * LOCAL)) for node in range(NODES)]
    scale = max(float(p.abs().max()) for p in partials) / 127
    return {
        "mean_error": float((total / TRIALS - mine).abs().max()),
        "one_error": float((first.double() - mine).abs().max()),
        "scale": scale,
        "first": first,
        "nodes_in_cross": reduction.cross.world_size,
        "residual_bytes": slices.nbytes,
    }


def _tensor_blocks(rank: int, shard_size: int | None) -> dict[str, Any]:
    """Every slice holds a tensor of large gradients (100 elements, about 100) then one of small (200, about 0.01),
    as a LayerNorm's weight may follow a matrix: reduced once with block plans restarting at the second tensor, once
    with blocks from the slice's start. The small tensor's largest error, and the bound its own blocks give."""
    world = Communicator()
    reduction = QuantizedReduction.of(Topology.build(world, 2, shard_size, quantize_gradients=True))
    assert reduction is not None
    slices = WORLD_SIZE if shard_size is None else shard_size
    gen = torch.Generator().manual_seed(100)  # the same on every rank
    one = torch.cat([torch.randn(100, generator=gen) * 100, torch.randn(SHARD - 100, generator=gen) * 0.01])
    mine = rank % slices
    exact = one * WORLD_SIZE  # every rank's slices alike, the sum of 4 ranks
    out: dict[str, Any] = {}
    with_plans = QuantizedSlices([BlockPlan.build(SHARD, (100,), (), GRADIENT_BLOCK)] * slices)
    for name, state in (("plans", with_plans), ("none", QuantizedSlices.uniform(SHARD, slices))):
        output = torch.empty(SHARD)
        reduced = reduction.start(output, one.repeat(slices))
        reduced.wait()
        reduction.across(output, reduced, state).wait()
        out[name] = float((output[100:] - exact[100:]).abs().max())
    out["bound"] = NODES * float((one[100:] * LOCAL).abs().max()) / 127  # a step of each node's partial
    out["slice"] = mine
    return out


def _overflow(rank: int, quantize: bool) -> dict[str, Any]:
    """fp16 with a dynamic loss scale; at step 1 one element of rank 1's gradient is inf."""
    results = {}
    for stage in (1, 2, 3):
        policy = PrecisionPolicy(torch.float16, torch.float32, torch.float32)
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=100)
        engine = _engine(stage, quantize, precision=policy, loss_scaler=scaler)
        model, optimizer = engine.module, engine.optimizers[0]
        states = []
        for step in range(3):
            engine.begin_iteration()
            optimizer.zero_grad()
            handle = None
            if step == 1 and rank == 1:
                handle = model.c.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([2]), float("inf")))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model, *batch(10 * step + rank))
            engine.scale_loss(loss).backward()
            engine.finish_backward()
            if handle is not None:
                handle.remove()
            optimizer.step()
            states.append(engine.full_state_dict(keep=True))
        results[stage] = {"skipped": scaler.skipped_steps, "scale": scaler.scale, "states": states}
        engine.release()
    return results


def _two_nodes(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"feedback/flat": _feedback(rank, None), "feedback/hybrid": _feedback(rank, 2)}
    out["tensor-blocks/flat"], out["tensor-blocks/hybrid"] = _tensor_blocks(rank, None), _tensor_blocks(rank, 2)
    for stage in (1, 2, 3):
        out[f"plain/{stage}"] = _train(rank, stage, False)
        out[f"quantized/{stage}"] = _train(rank, stage, True)
        out[f"plain-hybrid/{stage}"] = _train(rank, stage, False, shard_size=2)
        out[f"quantized-hybrid/{stage}"] = _train(rank, stage, True, shard_size=2)
        out[f"one-node/{stage}"] = _train(rank, stage, True, ranks_per_node=WORLD_SIZE)
    out["again/2"] = _train(rank, 2, True)
    out["quantized-secondary/3"] = _train(rank, 3, True, secondary_shard_size=LOCAL)
    out["overflow"] = _overflow(rank, True)
    return out


@pytest.fixture(scope="module")
def two_nodes() -> list[dict[str, Any]]:
    return run_on_ranks(_two_nodes, WORLD_SIZE, nodes=NODES, timeout_s=300)


def _update_difference(plain: dict[str, Any], quantized: dict[str, Any]) -> float:
    """|quantized update - exact update| / |exact update| over every parameter."""
    diff = sum(float((quantized["end"][k] - plain["end"][k]).double().pow(2).sum()) for k in plain["end"])
    norm = sum(float((plain["end"][k] - plain["start"][k]).double().pow(2).sum()) for k in plain["end"])
    return math.sqrt(diff / norm)


@pytest.mark.parametrize("layout", ["flat", "hybrid"])
def test_error_feedback_keeps_the_sum_of_reductions_within_one_rounding(
    two_nodes: list[dict[str, Any]], layout: str
) -> None:
    """Reduced TRIALS times with error feedback, what arrived sums to the exact sums less the last residuals (half a
    block step per element and row that crosses): the mean errs by about scale / (2 TRIALS), where stochastic
    rounding errs by scale / (2 sqrt(TRIALS)) and a fixed rounding by up to scale / 2. Each rank keeps the residuals
    of the rows it sends: (nodes - 1) slices flat, its shard with shard_size."""
    for rank, out in enumerate(two_nodes):
        result = out[f"feedback/{layout}"]
        crossing = 1 if layout == "flat" else NODES  # flat: the own node's partial stays exact
        bound = crossing * result["scale"] / TRIALS  # twice the last rounding's half step: the residual widens it
        print(
            f"{layout} rank {rank}: mean error {result['mean_error']:.2e} (bound {bound:.2e}), one reduction "
            f"{result['one_error']:.2e}, scale {result['scale']:.2e}"
        )
        assert result["nodes_in_cross"] == NODES
        assert result["mean_error"] <= bound, rank
        assert result["one_error"] > 20 * result["mean_error"], rank  # the quantization is visible in one trial
        assert result["one_error"] <= crossing * result["scale"] / 2 * 1.001, rank  # rounded to nearest
        assert result["residual_bytes"] == (NODES - 1 if layout == "flat" else 1) * SHARD * 4, rank
    if layout == "hybrid":  # replicas (ranks r and r + 2) dequantize the same bytes: identical shards
        for rank in range(2):
            assert torch.equal(
                two_nodes[rank][f"feedback/{layout}"]["first"], two_nodes[rank + 2][f"feedback/{layout}"]["first"]
            )


@pytest.mark.parametrize("layout", ["flat", "hybrid"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_stays_close_to_unquantized(two_nodes: list[dict[str, Any]], stage: int, layout: str) -> None:
    suffix = "" if layout == "flat" else "-hybrid"
    for rank, out in enumerate(two_nodes):
        plain, quantized = out[f"plain{suffix}/{stage}"], out[f"quantized{suffix}/{stage}"]
        difference = _update_difference(plain, quantized)
        print(f"stage {stage} {layout} rank {rank}: update differs by {difference:.2%}")
        assert 0 < difference <= UPDATE_TOLERANCE, rank
        for key, value in quantized["end"].items():  # every rank ends with the same parameters
            assert torch.equal(value, two_nodes[0][f"quantized{suffix}/{stage}"]["end"][key]), (rank, key)


def test_a_quantized_run_repeats_bit_for_bit(two_nodes: list[dict[str, Any]]) -> None:
    """The rounding is deterministic: the same run gives the same parameters, and so does it with secondary shards
    (hpZ gathers the same values, so the same gradients are quantized)."""
    for rank, out in enumerate(two_nodes):
        for key, value in out["quantized/2"]["end"].items():
            assert torch.equal(value, out["again/2"]["end"][key]), (rank, key)
        for key, value in out["quantized/3"]["end"].items():
            assert torch.equal(value, out["quantized-secondary/3"]["end"][key]), (rank, key)


@pytest.mark.parametrize("layout", ["flat", "hybrid"])
def test_gradient_blocks_restart_at_each_tensor(two_nodes: list[dict[str, Any]], layout: str) -> None:
    """A tensor of small gradients after one of large ones keeps its own scale (a bucket's block plans, see [Note:
    blocks never span two tensors]); with blocks from the slice's start it would take the large tensor's (measured:
    a LayerNorm weight's gradient 14% off in the example GPT)."""
    for rank, out in enumerate(two_nodes):
        result = out[f"tensor-blocks/{layout}"]
        assert result["plans"] <= result["bound"], (rank, result)
        assert result["none"] > 10 * result["bound"], (rank, result)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_across_nodes_equal_the_formula(two_nodes: list[dict[str, Any]], stage: int) -> None:
    """Flat: the world reduce-scatter (half of its bytes cross) becomes the node's (none cross) plus an all-to-all
    of quantized node partials (one of its two rows crosses). Hybrid: the replicate all-reduce (half crosses)
    becomes an all-gather of quantized shards (one of two crosses). Everything else is the same collectives."""
    for out in two_nodes:
        plain, quantized = out[f"plain/{stage}"], out[f"quantized/{stage}"]
        travelled = sum(quantized["slices"])  # per bucket: a slice's values and the padded scales
        assert quantized["shards"] == plain["shards"]
        assert quantized["by_op"]["quantized_all_to_all"] == NODES * travelled
        assert quantized["by_op"]["reduce_scatter"] == plain["by_op"]["reduce_scatter"]  # now inside the node
        assert quantized["by_group"]["node"] == plain["by_op"]["reduce_scatter"]
        exact = plain["by_op"]["reduce_scatter"] // 2  # what the flat reduce-scatter sent across
        assert quantized["inter"] == plain["inter"] - exact + travelled
        # fp32: 1 byte an element instead of 4, and each rank sends its own slices only (not 1/N of the bucket)
        scales = travelled - sum(quantized["shards"])
        assert travelled - scales == exact // (4 * LOCAL)
        print(f"stage {stage} flat: gradient bytes across nodes {travelled} vs {exact} ({travelled / exact:.3f})")

        plain, quantized = out[f"plain-hybrid/{stage}"], out[f"quantized-hybrid/{stage}"]
        travelled = sum(quantized["slices"])  # per bucket: a slice's values and the padded scales
        assert "all_reduce" not in quantized["by_op"]
        assert quantized["by_op"]["quantized_all_gather"] == NODES * travelled
        exact = plain["by_op"]["all_reduce"] // 2
        assert quantized["inter"] == plain["inter"] - exact + travelled
        scales = travelled - sum(quantized["shards"])
        assert travelled - scales == exact // 4
        print(f"stage {stage} hybrid: gradient bytes across nodes {travelled} vs {exact} ({travelled / exact:.3f})")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_and_estimate_count_the_residuals(two_nodes: list[dict[str, Any]], stage: int) -> None:
    """Error feedback's fp32 residuals are gradient state: (nodes - 1) slices per bucket flat, the shard with
    shard_size, in memory_report() and in estimate_memory(quantize_gradients=True, num_nodes=2) (which rounds
    each shard of the whole model once, not each bucket's)."""
    model = TinyLM()
    trainable = sum(p.numel() for p in model.parameters())
    for layout, suffix, rows, shard_size in (("flat", "", NODES - 1, None), ("hybrid", "-hybrid", 1, 2)):
        estimates = [
            estimate_memory(
                model,
                stage=stage,
                world_size=WORLD_SIZE,
                precision="32-true",
                optimizer="sgd",
                shard_size=shard_size,
                quantize_gradients=quantize,
                num_nodes=NODES,
            ).gradients
            for quantize in (False, True)
        ]
        estimated = estimates[1] - estimates[0]
        assert estimated == rows * -(-4 * trainable // (WORLD_SIZE if shard_size is None else shard_size))
        for rank, out in enumerate(two_nodes):
            plain, quantized = out[f"plain{suffix}/{stage}"], out[f"quantized{suffix}/{stage}"]
            assert quantized["residuals_after_release"] == 0, (layout, rank)  # release drops them
            held = quantized["gradients"] - plain["gradients"]
            assert held == rows * 4 * sum(quantized["shards"]), (layout, rank)
            assert abs(held - estimated) <= rows * 4 * len(quantized["shards"]), (layout, rank)  # padding
            if layout == "flat":  # one node: nothing crosses, so no residual
                assert out[f"one-node/{stage}"]["gradients"] == plain["gradients"], rank
            # The step peak counts the quantized reduction's own buffers in flight (partials, what is sent and
            # received) with the buckets' (see [Note: step peak ledger]); at stage 3 a gathered unit sets the peak.
            if stage < 3:
                assert quantized["peak_buckets"] > plain["peak_buckets"], (layout, rank)


def test_estimate_checks_num_nodes_and_keeps_the_residuals_on_the_device() -> None:
    for stage in (0, 2):  # checked at every stage, stage 0 (DDP) included
        with pytest.raises(ValueError, match="num_nodes=3 must be a positive int dividing world_size=4"):
            estimate_memory(TinyLM(), stage=stage, world_size=4, quantize_gradients=True, num_nodes=3)
    with pytest.raises(ValueError, match="quantize_gradients=True needs partition='flat'"):
        estimate_memory(TinyLM(), stage=2, world_size=4, quantize_gradients=True, num_nodes=2, partition="parameter")
    one = estimate_memory(TinyLM(), stage=2, world_size=4, quantize_gradients=True, num_nodes=1)
    assert one == estimate_memory(TinyLM(), stage=2, world_size=4)
    trainable = sum(p.numel() for p in TinyLM().parameters())
    nvme = {"offload_optimizer": "nvme", "offload_params": "nvme", "stage": 3, "world_size": 4, "precision": "32-true"}
    plain = estimate_memory(TinyLM(), **nvme)  # type: ignore[arg-type]
    quantized = estimate_memory(TinyLM(), quantize_gradients=True, num_nodes=2, **nvme)  # type: ignore[arg-type]
    assert plain.gradients == 0  # the gradient shard rests in the swap file, the residuals stay on the device
    assert quantized.gradients == -(-4 * trainable // 4)
    assert quantized.offloaded == plain.offloaded


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_overflow_skips_the_step_on_every_rank(two_nodes: list[dict[str, Any]], stage: int) -> None:
    for rank, out in enumerate(two_nodes):
        result = out["overflow"][stage]
        assert result["skipped"] == 1, rank
        assert result["scale"] == 2.0**9, rank  # halved once
        before, skipped, after = result["states"]
        assert all(torch.equal(before[k], skipped[k]) for k in before), rank  # the step changed nothing
        assert all(bool(torch.isfinite(v).all()) for v in after.values()), rank
        assert not all(torch.equal(skipped[k], after[k]) for k in skipped), rank  # the next one trains


def test_one_node_changes_nothing(two_nodes: list[dict[str, Any]]) -> None:
    """Every rank on one node: nothing crosses nodes, no group is made, the results are plain's bit for bit."""
    for rank, out in enumerate(two_nodes):
        for stage in (1, 2, 3):
            plain, quantized = out[f"plain/{stage}"], out[f"one-node/{stage}"]
            assert plain["by_op"] == quantized["by_op"], (rank, stage)
            assert plain["by_group"] == quantized["by_group"], (rank, stage)
            for key, value in plain["end"].items():
                assert torch.equal(value, quantized["end"][key]), (rank, stage, key)


def test_the_option_is_checked_and_reaches_both_strategies() -> None:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    with pytest.raises(ValueError, match="quantize_gradients must be True or False, got 1"):
        EngineOptions(quantize_gradients=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantize_gradients=True needs partition='flat'"):
        ZeroStrategy(quantize_gradients=True, partition="parameter")
    assert ZeroStrategy(quantize_gradients=True).config.engine.quantize_gradients is True
    assert ZeroFabricStrategy(quantize_gradients=True).config.describe()["quantize_gradients"] is True
    assert ZeroStrategy().config.describe()["quantize_gradients"] is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_block_quantizer(dtype: torch.dtype) -> None:
    """Nearest rounding errs by at most half a step of its block; zeros stay zeros; inf or NaN give a non-finite
    scale and non-finite values back, never an exception; odd sizes keep a short last block."""
    x = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    values, scales = quantize_blocks(x)
    assert values.dtype == torch.int8
    assert values.numel() == 1000
    assert scales.dtype == torch.float32
    assert scales.numel() == 4
    assert quantized_nbytes(1000) == 1000 + 16
    back = dequantize_blocks(values, scales, torch.empty(1000, dtype=torch.float32))
    steps = scales.repeat_interleave(QUANT_BLOCK)[:1000]
    assert bool(((back - x.float()).abs() <= steps / 2 * 1.0001).all())
    zeros, zero_scales = quantize_blocks(torch.zeros(300, dtype=dtype))
    assert zero_scales.tolist() == [0.0, 0.0]
    assert not bool(zeros.any())
    x[3], x[700] = float("inf"), float("nan")
    values, scales = quantize_blocks(x, generator=torch.Generator().manual_seed(1))
    back = dequantize_blocks(values, scales, torch.empty(1000, dtype=dtype))
    assert not bool(back[:256].isfinite().any())
    assert not bool(back[512:768].isfinite().any())
    assert bool(back[256:512].isfinite().all())
    with pytest.raises(ValueError, match="a test tensor: values are inf/NaN \\(2 of 4 blocks"):
        check_finite_scales(scales, "a test tensor")

"""The block-wise int8 quantizer of quantized all-gathers (see [Note: block-wise int8])."""

from __future__ import annotations

import pytest
import torch

from lightning_zero.core.comm.quantize import (
    QUANT_BLOCK,
    BlockPlan,
    check_finite_scales,
    dequantize_blocks,
    quantize_blocks,
    quantized_nbytes,
)

SIZES = (1, 255, 256, 257, 1000)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _sample(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Blocks of very different magnitudes: a scale per block must follow each.
    magnitude = torch.logspace(-3, 2, -(-numel // QUANT_BLOCK)).repeat_interleave(QUANT_BLOCK)[:numel]
    return (torch.randn(numel, generator=gen) * magnitude).to(dtype)


def _per_element_scale(scales: torch.Tensor, numel: int) -> torch.Tensor:
    return scales.repeat_interleave(QUANT_BLOCK)[:numel]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_round_to_nearest_error_at_most_half_a_scale(numel: int, dtype: torch.dtype) -> None:
    x = _sample(numel, dtype)
    values, scales = quantize_blocks(x)
    assert values.dtype == torch.int8
    assert values.shape == (numel,)
    assert scales.dtype == torch.float32
    assert scales.shape == (-(-numel // QUANT_BLOCK),)
    exact = x.float()
    blocks = torch.nn.functional.pad(exact, (0, scales.numel() * QUANT_BLOCK - numel)).view(-1, QUANT_BLOCK)
    torch.testing.assert_close(scales, blocks.abs().amax(1) / 127, rtol=0, atol=0)
    out = dequantize_blocks(values, scales, torch.empty(numel))
    error = (out - exact).abs()
    bound = _per_element_scale(scales, numel) * (0.5 + 1e-5)
    assert bool((error <= bound).all()), float((error - bound).max())
    again = quantize_blocks(x)
    assert torch.equal(again[0], values)
    assert torch.equal(again[1], scales)


@pytest.mark.parametrize("numel", SIZES)
def test_stochastic_error_below_a_scale_and_unbiased(numel: int) -> None:
    x = _sample(numel, torch.float32, seed=1)
    gen = torch.Generator().manual_seed(7)
    draws = 2000
    total = torch.zeros(numel, dtype=torch.float64)
    scales = quantize_blocks(x)[1]
    scale = _per_element_scale(scales, numel)
    for _ in range(draws):
        values, drawn_scales = quantize_blocks(x, generator=gen)
        assert torch.equal(drawn_scales, scales)
        out = dequantize_blocks(values, drawn_scales, torch.empty(numel))
        assert bool(((out - x).abs() < scale * (1 + 1e-5)).all())
        total += out.double()
    mean = total / draws
    # Each draw's error is within one scale and has variance <= scale^2 / 4: the mean's error stays within 5 standard
    # errors; biased rounding (nearest) would miss by up to scale/2.
    bound = 5 * scale.double() / 2 / draws**0.5 + 1e-6 * x.abs().double()
    assert bool(((mean - x.double()).abs() <= bound).all())


def test_stochastic_rounding_differs_from_nearest() -> None:
    x = _sample(1000, torch.float32)
    nearest = quantize_blocks(x)[0]
    drawn = quantize_blocks(x, generator=torch.Generator().manual_seed(0))[0]
    assert not torch.equal(nearest, drawn)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_give_zero_scales_and_values(dtype: torch.dtype) -> None:
    x = torch.zeros(600, dtype=dtype)
    x[300] = 2.0  # one non-zero block among zero blocks
    values, scales = quantize_blocks(x)
    assert scales[0] == 0
    assert scales[2] == 0
    assert scales[1] == pytest.approx(2 / 127)
    out = dequantize_blocks(values, scales, torch.full((600,), 9.0, dtype=dtype))
    assert torch.equal(out, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_into_every_float_dtype(dtype: torch.dtype) -> None:
    x = _sample(1000, torch.float32)
    values, scales = quantize_blocks(x)
    reference = dequantize_blocks(values, scales, torch.empty(1000))
    out = dequantize_blocks(values, scales, torch.empty(1000, dtype=dtype))
    assert out.dtype == dtype
    assert torch.equal(out, reference.to(dtype))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_gives_non_finite_scale_and_check_raises(bad: float) -> None:
    x = _sample(1000, torch.bfloat16)
    x[600] = bad
    _values, scales = quantize_blocks(x)  # never raises
    assert not bool(torch.isfinite(scales[2]))
    assert bool(torch.isfinite(scales[[0, 1, 3]]).all())
    check_finite_scales(scales[[0, 1, 3]], "unit 'layers.0'")
    with pytest.raises(ValueError, match=r"unit 'layers\.0' buffer 1.*inf/NaN"):
        check_finite_scales(scales, "unit 'layers.0' buffer 1")


def test_quantized_nbytes() -> None:
    assert quantized_nbytes(1) == 1 + 4
    assert quantized_nbytes(256) == 256 + 4
    assert quantized_nbytes(257) == 257 + 8
    assert quantized_nbytes(1000) == 1000 + 16
    values, scales = quantize_blocks(torch.randn(1000))
    assert quantized_nbytes(1000) == values.numel() * values.element_size() + scales.numel() * scales.element_size()


def test_refuses_non_float_or_non_flat_input() -> None:
    with pytest.raises(ValueError, match="1-D floating-point"):
        quantize_blocks(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="1-D floating-point"):
        quantize_blocks(torch.zeros(4, dtype=torch.int64))


# A part holding the end of a matrix (300), a LayerNorm's weight (100, about 1) and bias (100, about 0.01), and the
# start of another matrix (700): see [Note: blocks never span two tensors].
PART_STARTS = (300, 400, 500)
PART_EXACT = (300, 400)


def _part(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    pieces = [
        torch.randn(300, generator=gen) * 0.02,
        1 + torch.randn(100, generator=gen) * 0.01,
        torch.randn(100, generator=gen) * 0.01,
        torch.randn(700, generator=gen) * 0.5,
    ]
    return torch.cat(pieces).to(dtype)


def test_block_plan_restarts_at_tensors_and_counts_exact_elements() -> None:
    plan = BlockPlan.build(1200, PART_STARTS, PART_EXACT, block=256)
    runs = [(s.begin, s.end, s.first, s.exact) for s in plan.segments]
    # 300 -> 2 blocks; 100 exact -> 100 scales; 100 exact -> 100 scales; 700 -> 3 blocks.
    assert runs == [(0, 300, 0, False), (300, 400, 2, True), (400, 500, 102, True), (500, 1200, 202, False)]
    assert plan.scale_count == 205
    assert plan.rows == 5
    assert quantized_nbytes(1200, plan=plan) == 1200 + 4 * 205
    assert BlockPlan.build(1200, (0, 1200, 5000)).uniform  # offsets at the ends or outside cut nothing
    assert BlockPlan.build(0, (), (0,)).scale_count == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_plan_keeps_exact_runs_exact_and_bounds_each_run_by_its_own_scale(dtype: torch.dtype) -> None:
    x = _part(dtype)
    plan = BlockPlan.build(x.numel(), PART_STARTS, PART_EXACT)
    values, scales = quantize_blocks(x, plan=plan)
    assert values.shape == (1200,)
    assert scales.shape == (plan.scale_count,)
    out = dequantize_blocks(values, scales, torch.empty(1200, dtype=dtype), plan=plan)
    assert torch.equal(out[300:500], x[300:500])  # the LayerNorm travels exact
    exact = x.float()
    for begin, end in ((0, 300), (500, 1200)):  # each run's error is bounded by its own blocks' absmax
        for lo in range(begin, end, QUANT_BLOCK):
            hi = min(lo + QUANT_BLOCK, end)
            bound = exact[lo:hi].abs().max() / 127 * (0.5 + 1e-5) + _rounding(dtype, exact[lo:hi])
            assert float((out[lo:hi].float() - exact[lo:hi]).abs().max()) <= float(bound)
    # Without the plan, the block holding the LayerNorm's weight rounds its bias to steps of about 1/127.
    spanned = dequantize_blocks(*quantize_blocks(x), torch.empty(1200))[400:500]
    assert float((spanned - exact[400:500]).abs().max()) > 1e-3


def _rounding(dtype: torch.dtype, x: torch.Tensor) -> float:
    """Half a unit in the last place of ``dtype`` at ``x``'s magnitude: dequantized values are rounded into it."""
    return float(x.abs().max()) * torch.finfo(dtype).eps


def test_block_plan_stochastic_rounding_keeps_exact_runs_and_flags_non_finite_exact_values() -> None:
    x = _part(torch.float32)
    plan = BlockPlan.build(x.numel(), PART_STARTS, PART_EXACT)
    values, scales = quantize_blocks(x, generator=torch.Generator().manual_seed(1), plan=plan)
    out = dequantize_blocks(values, scales, torch.empty(1200), plan=plan)
    assert torch.equal(out[300:500], x[300:500])
    x[450] = float("nan")  # inside the exact bias
    _values, scales = quantize_blocks(x, plan=plan)
    with pytest.raises(ValueError, match="inf/NaN"):
        check_finite_scales(scales, "unit 'blocks.0' buffer 0")

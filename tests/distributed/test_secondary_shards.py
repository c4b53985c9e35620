"""Secondary shards (``secondary_shard_size``, ZeRO++ hpZ): backward gathers inside a node from the slices kept after
forward. On 4 gloo ranks numbered as 2 nodes x 2, with secondary groups of 2 (one per node) and of 1: parameters bit
for bit those of plain stage 3 (fp32 and bf16-mixed, accumulation and clipping, activation checkpointing, a unit used
twice, a backward that reaches some units on half the ranks, no prefetch, offloaded parameters, hybrid sharding,
whole-tensor owners, a step that raises in backward); one step's bytes by node against the units' sizes;
memory_report() at the end of forward against estimate_memory(secondary_shard_size=) and the CLI; and the errors of
a bad value. One spawn in all.
"""

from __future__ import annotations

import copy
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_zero import estimate_memory
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.options import EngineOptions
from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from tests.helpers import run_on_ranks

VOCAB, WIDTH, STEPS = 12, 16, 2
BF16 = PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
POLICY = {nn.Linear, nn.Embedding}  # every layer a unit: the root holds no parameter


class Net(nn.Module):
    """Embedding -> 3 Linear -> head, each a unit; every tensor's size is a multiple of 4 (no padding on 4 ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.fail = False  # raise in the next backward, on every rank
        self.reuse = False  # apply the middle layer twice: two plan entries for one unit
        self.first: Tensor | None = None  # the first layer's output

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.emb(tokens)
        for index, layer in enumerate(self.layers):
            hidden = torch.tanh(layer(hidden))
            if index == 1 and self.reuse:
                hidden = torch.tanh(layer(hidden))
            self.first = hidden if index == 0 else self.first
        if self.fail:
            hidden.register_hook(_raise)
        return self.head(hidden)


def _raise(grad: Tensor) -> Tensor:
    raise RuntimeError("raised in backward on purpose")


def _loss(model: nn.Module, rank: int, seed: int, partial: bool = False) -> Tensor:
    """The next-token loss; with ``partial`` on odd ranks one that reaches the first two units only (their backward
    still issues the gathers of the others, from the slices, in step with the even ranks)."""
    tokens = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(100 * seed + rank))
    logits = model(tokens[:, :-1])
    if partial and rank % 2:
        return model.first.float().square().mean()
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _engine(model: nn.Module, optimizer: torch.optim.Optimizer, mixed: bool, **options: Any) -> ZeroEngine:
    options = {"stage": 3, "bucket_cap_mb": 0.0005, "wrap_policy": POLICY, **options}
    if options.get("offload_params"):
        options.update(offload_optimizer="cpu", nvme_path=tempfile.gettempdir())
    return ZeroEngine(model, [optimizer], EngineOptions(**options), Communicator(), precision=BF16 if mixed else None)


def _micro_step(engine: ZeroEngine, rank: int, seed: int, scale: float, partial: bool = False) -> None:
    """One micro-batch as the Lightning glue runs it: iteration start, root gathered, announced backward."""
    engine.begin_iteration()
    engine.model.scheduler.unshard_root()
    engine.scale_loss(_loss(engine.module, rank, seed, partial) * scale).backward()
    engine.finish_backward()


def _train(rank: int, mixed: bool, accumulate: int = 1, clip: bool = False, fail_at: int = -1, **options: Any) -> Any:
    """Train a fresh ``Net`` for STEPS steps; return its gathered parameters (and the fp32 masters where kept)."""
    torch.manual_seed(0)
    model = Net()
    model.reuse = options.pop("reuse", False)
    partial = options.pop("partial", False)
    if options.pop("checkpointing", False):
        apply_activation_checkpointing(model, {nn.Linear})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine = _engine(model, optimizer, mixed, **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        if step == fail_at:  # a backward that raises on every rank, then the step as usual
            model.fail = True
            with pytest.raises(RuntimeError, match="on purpose"):
                _micro_step(engine, rank, 999, 1.0)
            model.fail = False
        for micro in range(accumulate):
            context = engine.no_sync() if micro < accumulate - 1 else nullcontext()
            with context:
                _micro_step(engine, rank, 10 * step + micro, 1 / accumulate, partial)
        if clip:
            engine.step_of(optimizer).clip_grad_norm_(0.05)
        optimizer.step()
        assert engine.model.ledger.current.get("secondary", 0) == 0, "secondary slices outlived the backward"
    with engine.gathered():
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return params, engine.full_state_dict(keep=True)


# (name, arguments of _train), each run plain and with secondary shards.
PARITY_2 = {
    "fp32-accumulate-clip": {"mixed": False, "accumulate": 2, "clip": True},
    "bf16-accumulate-clip": {"mixed": True, "accumulate": 2, "clip": True},
    "checkpointing-reuse": {"mixed": False, "checkpointing": True, "reuse": True},
    "partial-backward": {"mixed": False, "partial": True},
    "no-prefetch": {"mixed": True, "overlap_comm": False},
    "offload-params": {"mixed": True, "offload_params": "cpu", "accumulate": 2},
    "hybrid": {"mixed": False, "shard_size": 2, "accumulate": 2, "clip": True},
    "parameter-partition": {"mixed": False, "partition": "parameter"},
    "raise-in-backward": {"mixed": True, "fail_at": 1},
    # With quantize_weights backward computes with the forward's dequantized values either way: regathered
    # quantized from the same shards, or copied from the slices of them.
    "quantized-weights": {"mixed": True, "quantize_weights": True, "accumulate": 2, "clip": True},
    "quantized-weights-checkpointing": {"mixed": False, "quantize_weights": True, "checkpointing": True},
}
# Secondary groups of one rank each (every rank keeps its own full copy until backward), on the same 4 ranks: a
# spawn of its own would cost more than the cases.
PARITY_1 = {
    "fp32-accumulate-clip": {"mixed": False, "accumulate": 2, "clip": True},
    "bf16-accumulate-clip": {"mixed": True, "accumulate": 2, "clip": True},
}


def _parity(rank: int, cases: dict[str, dict[str, Any]], secondary: int, out: dict[str, Any]) -> None:
    for name, arguments in cases.items():
        plain = _train(rank, **copy.deepcopy(arguments))
        hpz = _train(rank, secondary_shard_size=secondary, **copy.deepcopy(arguments))
        out[f"parity{secondary}/{name}"] = [
            [key for key, value in plain[i].items() if not torch.equal(value, hpz[i][key])] for i in (0, 1)
        ]


def _one_step(rank: int, secondary: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = _engine(model, optimizer, mixed=False, secondary_shard_size=secondary)
    _micro_step(engine, rank, 0, 1.0)
    optimizer.step()
    stats = engine.last_step_comm
    units = [u for u in engine.model.units if not u.is_root]
    return {
        "nbytes": stats.nbytes,
        "intra": stats.intra_node_bytes,
        "inter": stats.inter_node_bytes,
        "by_group": dict(stats.by_group),
        "by_op": dict(stats.by_op),
        "unit_bytes": [sum(b.layout.padded_numel * b.data.element_size() for b in u.buffers) for u in units],
    }


def _memory(rank: int, mixed: bool, offload_params: Any, policy: Any = POLICY) -> dict[str, Any]:
    """memory_report() at the end of forward (every unit's slice alive) and after the step."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"secondary_shard_size": 2, "offload_params": offload_params, "wrap_policy": policy}
    engine = _engine(model, optimizer, mixed, **options)
    out = {}
    for step in range(2):
        engine.begin_iteration()
        engine.model.scheduler.unshard_root()
        loss = _loss(model, rank, step)
        out[f"forward{step}"] = engine.memory_report().params
        out[f"ledger{step}"] = engine.model.ledger.current["secondary"]
        engine.scale_loss(loss).backward()
        engine.finish_backward()
        optimizer.step()
        optimizer.zero_grad()
        report = engine.memory_report()
        out[f"after{step}"] = (report.params, report.step_peak.secondary, engine.model.ledger.current["secondary"])
    return out


def _error(rank: int, **options: Any) -> str:
    model = Net()
    try:
        _engine(model, torch.optim.SGD(model.parameters(), lr=0.1), mixed=False, **options)
    except ValueError as error:
        return str(error)
    return "no error"


def _fabric(rank: int, secondary: int | None) -> dict[str, Tensor]:
    """ZeroFabricStrategy at stage 3 through tests/fabric/parity.py's loop (accumulation, clipping by norm)."""
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy
    from tests.distributed.models import TinyLM
    from tests.fabric.parity import full_params, trained

    strategy = ZeroFabricStrategy(
        stage=3, bucket_cap_mb=0.0005, wrap_policy={nn.Linear}, secondary_shard_size=secondary
    )
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    model, _ = trained(fabric, TinyLM(), "one", False, rank)
    return full_params(fabric, model)


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain, hpz = _fabric(rank, None), _fabric(rank, 2)
    out["fabric"] = [name for name, value in plain.items() if not torch.equal(value, hpz[name])]
    _parity(rank, PARITY_2, 2, out)
    _parity(rank, PARITY_1, 1, out)
    out["bytes/plain"] = _one_step(rank, None)
    out["bytes/hpz"] = _one_step(rank, 2)
    for mixed in (False, True):
        for offload in (False, "cpu"):
            out[f"memory/{mixed}/{offload}"] = _memory(rank, mixed, offload)
    for name, policy in ROOT_HOLDS.items():
        for offload in (False, "cpu"):
            out[f"memory/root/{name}/{offload}"] = _memory(rank, True, offload, policy)
    out["error/not-a-divisor"] = _error(rank, secondary_shard_size=3)
    out["error/straddles"] = _error(rank, secondary_shard_size=4)
    out["error/hybrid-not-a-divisor"] = _error(rank, secondary_shard_size=4, shard_size=2)
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(_four_ranks, 4, nodes=2)


@pytest.mark.parametrize("case", list(PARITY_2))
def test_bit_identical_to_plain_stage3_on_two_nodes(four: list[dict[str, Any]], case: str) -> None:
    for rank, out in enumerate(four):
        assert out[f"parity2/{case}"] == [[], []], f"rank {rank}: parameters / masters that differ"


def test_fabric_strategy_is_bit_identical_too(four: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(four):
        assert out["fabric"] == [], f"rank {rank}: parameters that differ"


@pytest.mark.parametrize("case", list(PARITY_1))
def test_bit_identical_with_groups_of_one_rank(four: list[dict[str, Any]], case: str) -> None:
    for rank, out in enumerate(four):
        assert out[f"parity1/{case}"] == [[], []], f"rank {rank}: parameters / masters that differ"


def test_backward_gathers_stay_inside_the_node(four: list[dict[str, Any]]) -> None:
    """A collective counted as B bytes over p ranks sends B/p to each peer (see [Note: counting communication]).
    Plain stage 3 gathers each non-root unit (U_u bytes full) twice over 4 ranks: B/4 inside the node, B/2 across,
    each time. With secondary groups of 2 (one node) backward's gathers send U_u/2 inside the node and nothing across;
    everything else is the same collectives."""
    for rank, out in enumerate(four):
        plain, hpz = out["bytes/plain"], out["bytes/hpz"]
        units = hpz["unit_bytes"]
        assert len(units) == 5
        assert units == plain["unit_bytes"]
        assert hpz["by_group"]["secondary"] == sum(units), rank  # each unit once, in backward
        assert hpz["by_group"]["gather"] + sum(units) == plain["by_group"]["gather"], rank  # forward's stay primary
        assert (hpz["nbytes"], hpz["by_op"]) == (plain["nbytes"], plain["by_op"]), rank
        assert hpz["inter"] == plain["inter"] - sum(u // 2 for u in units), rank
        assert hpz["intra"] == plain["intra"] - sum(u // 4 for u in units) + sum(u // 2 for u in units), rank


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("offload", [False, "cpu"])
def test_memory_report_equals_the_estimate_at_the_end_of_forward(
    four: list[dict[str, Any]], mixed: bool, offload: Any
) -> None:
    with torch.device("meta"):
        model = Net()
    precision = "bf16-mixed" if mixed else "32-true"

    def estimate(secondary: int | None) -> int:
        return estimate_memory(
            model,
            stage=3,
            world_size=4,
            precision=precision,
            offload_optimizer="cpu" if offload else False,
            offload_params=offload,
            secondary_shard_size=secondary,
            wrap_policy=POLICY,
        ).params

    slices = (2 if mixed else 4) * sum(p.numel() for p in model.parameters()) // 2
    assert estimate(2) - estimate(None) == slices
    for rank, out in enumerate(four):
        measured = out[f"memory/{mixed}/{offload}"]
        for step in range(2):
            assert measured[f"forward{step}"] == estimate(2), (rank, step)
            assert measured[f"ledger{step}"] == slices, (rank, step)
            params, peak_secondary, held = measured[f"after{step}"]
            assert params == estimate(None), (rank, step)  # every slice freed once backward gathered it
            assert 0 < peak_secondary <= slices, (rank, step)
            assert held == 0, (rank, step)


# Policies under which the root unit holds parameters: they keep no slice, and stay gathered from forward to backward.
ROOT_HOLDS = {"default": None, "linear": {nn.Linear}}  # the default: the repeated layers; the embedding (and head) root


@pytest.mark.parametrize("offload", [False, "cpu"])
@pytest.mark.parametrize("name", list(ROOT_HOLDS))
def test_the_estimate_counts_the_root_gathered_not_sliced(four: list[dict[str, Any]], name: str, offload: Any) -> None:
    """Where the root holds parameters, estimate_memory(wrap_policy=) (the CLI's --wrap-policy) counts the slices of
    the other units and the root gathered in full, as memory_report() measures at the end of forward; it counted a
    slice of every parameter before (an error of 1/2 the root's bytes here)."""
    with torch.device("meta"):
        model = Net()
    policy = ROOT_HOLDS[name]
    options = {"stage": 3, "world_size": 4, "precision": "bf16-mixed", "wrap_policy": policy}
    if offload:
        options.update(offload_optimizer=offload, offload_params=offload)
    plain, hpz = estimate_memory(model, **options).params, estimate_memory(model, **options, secondary_shard_size=2)
    units = list(model.layers) if policy is None else [m for m in model.modules() if isinstance(m, nn.Linear)]
    in_units = sum(p.numel() for unit in units for p in unit.parameters())
    root = sum(p.numel() for p in model.parameters()) - in_units
    slices = 2 * in_units // 2  # bf16
    assert root > 0
    assert hpz.params - plain == slices + 2 * root
    for rank, out in enumerate(four):
        measured = out[f"memory/root/{name}/{offload}"]
        for step in range(2):
            assert measured[f"forward{step}"] == hpz.params, (rank, step)
            assert measured[f"ledger{step}"] == slices, (rank, step)
            assert measured[f"after{step}"][0] == plain, (rank, step)


def test_bad_values_raise_the_same_error_on_every_rank(four: list[dict[str, Any]]) -> None:
    expected = {
        "not-a-divisor": r"secondary_shard_size=3 does not divide the stage-3 gather group's 4 ranks",
        "straddles": r"secondary_shard_size=4 does not fit nodes of 2 ranks: a secondary shard group would straddle",
        "hybrid-not-a-divisor": r"secondary_shard_size=4 does not divide the stage-3 gather group's 2 ranks",
    }
    for name, pattern in expected.items():
        messages = {out[f"error/{name}"] for out in four}
        assert len(messages) == 1, messages
        assert pattern in messages.pop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 2, "secondary_shard_size": 2}, "secondary_shard_size=2 needs stage=3, got stage=2"),
        ({"stage": 3, "secondary_shard_size": 0}, "secondary_shard_size=0 is not supported; choose a positive int"),
        ({"stage": 3, "secondary_shard_size": True}, "secondary_shard_size=True is not supported"),
        ({"stage": 3, "secondary_shard_size": "2"}, "secondary_shard_size='2' is not supported"),
    ],
)
def test_invalid_options_raise_at_construction(options: dict[str, Any], message: str) -> None:
    from lightning_zero import ZeroFabricStrategy, ZeroStrategy

    for build in (EngineOptions, ZeroStrategy, ZeroFabricStrategy):
        with pytest.raises(ValueError, match=message):
            build(**options)
    with torch.device("meta"):
        model = Net()
    with pytest.raises(ValueError, match=message):
        estimate_memory(model, world_size=4, **options)


def test_cli_estimate_counts_the_slices_at_stage_3_only(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.gpt import GPTLightningModule
    from lightning_zero.cli import main
    from tests.unit.test_cli import DEFAULT_GPT_PARAMS, GPT, _rows

    base = ["estimate", "--model", GPT, "--precision", "32-true", "--world-size", "4"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--secondary-shard-size", "2"]) == 0
    hpz = capsys.readouterr().out
    assert {k: v for k, v in _rows(hpz).items() if k != "3"} == {k: v for k, v in _rows(plain).items() if k != "3"}
    policy = ["--wrap-policy", "examples.gpt.Block", "torch.nn.Embedding"]
    assert main([*base, "--secondary-shard-size", "2", *policy]) == 0
    embeddings = capsys.readouterr().out
    with torch.device("meta"):
        module = GPTLightningModule()
        module.configure_model()
    blocks = sum(p.numel() for p in module.model.blocks.parameters())
    assert blocks < DEFAULT_GPT_PARAMS
    params = [float(row["3"][0].removesuffix(" MB")) for row in map(_rows, (plain, hpz, embeddings))]  # 2 decimals

    def added(in_units: int) -> float:  # fp32: the units' elements / 2 in slices, the root's gathered in full
        return (4 * in_units / 2 + 4 * (DEFAULT_GPT_PARAMS - in_units)) / 1e6

    assert params[1] - params[0] == pytest.approx(added(blocks), abs=0.01)
    # wpe joins them; wte stays in the root, tied to lm_head, which no unit holds.
    assert params[2] - params[0] == pytest.approx(added(blocks + module.model.wpe.weight.numel()), abs=0.01)
    assert "secondary_shard_size=2" in hpz
    assert "Secondary shards: stage 3's parameters include 1/2 of every unit but the root, which" in hpz
    with pytest.raises(SystemExit, match=r"wrap_policy: cannot import the class 'examples.gpt.Nothing'"):
        main([*base, "--secondary-shard-size", "2", "--wrap-policy", "examples.gpt.Nothing"])
    with pytest.raises(SystemExit, match=r"--secondary-shard-size 3 does not divide the stage-3 gather group's 4"):
        main([*base, "--secondary-shard-size", "3"])


def test_lightning_cli_yaml_sets_it(tmp_path: Path) -> None:
    from tests.lightning.test_construction import _cli

    strategy_yaml = "\n    class_path: lightning_zero.ZeroStrategy\n    init_args: {stage: 3, secondary_shard_size: 2}"
    strategy = _cli(tmp_path, strategy_yaml).trainer.strategy
    assert strategy.config.engine.secondary_shard_size == 2
    assert strategy.config.describe()["secondary_shard_size"] == 2

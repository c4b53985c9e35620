"""Stage 3 with configure_model: the model is created unit by unit and never exists in full on one rank."""

from __future__ import annotations

import gc
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from tests.helpers import run_on_ranks

WIDTH = 1024
DEPTH = 16  # 16 x (1024 x 1024 + 1024) fp32 = 67 MB: big enough for RSS to see, 16 gather units
FULL_BYTES = DEPTH * (WIDTH * WIDTH + WIDTH) * 4


class WideMLP(LightningModule):
    """Builds its layers in configure_model (meta device under stage 3) or, with ``eager``, in __init__."""

    def __init__(self, eager: bool = False) -> None:
        super().__init__()
        self.layers: nn.Sequential | None = self._build() if eager else None

    @staticmethod
    def _build() -> nn.Sequential:
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None
        return self.layers(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x * 0.5), batch_size=4)


def _trainer(world_size: int, strategy: ZeroStrategy | None = None, **kwargs: object) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy or ZeroStrategy(stage=3),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _peak_rss_growth(rank: int, world_size: int, eager: bool) -> int:
    """Peak RSS while building, sharding and evaluating the model, minus the RSS just before."""
    _trainer(world_size).validate(WideMLP(eager=False), _data(), verbose=False)  # warm up: imports, allocator
    gc.collect()
    # The peak is this process's high-water RSS reset here (/proc/self/clear_refs): ru_maxrss would also hold the
    # warm-up's peak and, through fork, the peak of the process that spawned this one.
    before = _rss()
    Path("/proc/self/clear_refs").write_text("5")
    trainer = _trainer(world_size)
    trainer.validate(WideMLP(eager=eager), _data(), verbose=False)
    return _peak_rss() - before


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def test_configure_model_never_holds_the_full_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # glibc keeps freed buffers resident unless large allocations are mmapped: set the threshold so that
    # RSS follows what is live. The child processes inherit the environment.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    lazy = run_on_ranks(_peak_rss_growth, 2, False)
    eager = run_on_ranks(_peak_rss_growth, 2, True)
    for rank in range(2):
        # Built in configure_model: the rank's parameter shard (FULL/2) plus about one unit in flight; evaluation
        # creates no gradient shard.
        assert lazy[rank] < 0.75 * FULL_BYTES, f"rank {rank}: peak grew {lazy[rank] / 1e6:.1f} MB"
        # Built in __init__ the full model exists first: the measurement does see a full model.
        assert eager[rank] > FULL_BYTES, f"rank {rank}: eager peak grew only {eager[rank] / 1e6:.1f} MB"


def _fit(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # different RNG per rank: rank 0's initial values must still win everywhere
    model = WideMLP()
    trainer = _trainer(world_size, max_steps=4)
    trainer.fit(model, _data(), _data())
    losses = trainer.callback_metrics
    at_rest = [p.untyped_storage().nbytes() for p in model.parameters()]
    with trainer.strategy.gathered_params():
        first = model.layers[0].weight.detach().clone()
        shapes = [tuple(p.shape) for p in model.parameters()]
    return {
        "first": first,
        "shapes": shapes,
        "at_rest": at_rest,
        "val_loss": float(losses["val_loss"]),
        "step": trainer.global_step,
    }


def test_model_from_configure_model_trains_and_gathers_after_fit() -> None:
    results = run_on_ranks(_fit, 2)
    for result in results:
        assert result["step"] == 4
        assert result["shapes"] == [(WIDTH, WIDTH), (WIDTH,)] * DEPTH
        assert result["at_rest"] == [0] * (2 * DEPTH)  # sharded after fit: the full storage is freed
        assert torch.isfinite(torch.tensor(result["val_loss"]))
    assert torch.equal(results[0]["first"], results[1]["first"])


class NoResetLayer(nn.Module):
    """A layer whose parameter has no reset_parameters(): built on the meta device, it cannot be initialised."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class HalfInitialisable(WideMLP):
    """Two ordinary layers (created and initialised first), then one that cannot be initialised."""

    @staticmethod
    def _build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), NoResetLayer())


def _fit_uninitialisable(rank: int, world_size: int) -> str:
    try:
        _trainer(world_size, max_steps=1).fit(HalfInitialisable(), _data())
    except Exception as error:  # what the user sees last
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_setup_that_fails_part_way_reports_its_own_error() -> None:
    """Setup raising after some units were created (others still on the meta device) ends with that error on every
    rank; Lightning's teardown used to move the half-built module to the CPU and raise 'Cannot copy out of meta
    tensor' instead."""
    for rank, message in enumerate(run_on_ranks(_fit_uninitialisable, 2)):
        assert message.startswith("RuntimeError"), (rank, message)
        assert "reset_parameters()" in message, (rank, message)
        assert "meta tensor" not in message.split("reset_parameters")[0], (rank, message)


def test_what_configure_model_did_not_create_moves_to_the_device() -> None:
    """A stage-3 model built partly in configure_model (on the meta device) and partly in ``__init__`` (a torchmetrics
    metric, a buffer of the root): the strategy moves every materialized part to the root device (here the meta device
    stands in for a GPU: a CPU-only machine has no other) and leaves the meta parts for the engine. On an H200 the
    example GPT's Perplexity metric stayed on the CPU ("Encountered different devices in metric calculation")."""
    import torchmetrics

    from lightning_zero.strategy import move_materialized

    class Partly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.metric = torchmetrics.MeanMetric()
            self.register_buffer("scale", torch.ones(3))
            with torch.device("meta"):
                self.body = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
            self.head = nn.Linear(2, 2)

    model = Partly()
    move_materialized(model, torch.device("meta"))
    assert model.scale.is_meta
    assert model.head.weight.is_meta
    assert model.metric.mean_value.is_meta  # a metric state: moved by the metric's own `to`
    assert model.body[0].weight.is_meta  # untouched, still to be created by the engine
    whole = nn.Linear(2, 2)
    move_materialized(whole, torch.device("meta"))
    assert whole.weight.is_meta


def _fixed(tensor: torch.Tensor, seed: int, scale: float) -> None:
    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)) * scale)


class SeededEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:  # its own values whatever the order of initialisation: N(0, 1)
        _fixed(self.weight, 1, 1.0)


class SeededLinear(nn.Linear):
    def reset_parameters(self) -> None:  # N(0, 0.02), seeded by size
        _fixed(self.weight, 2 + self.weight.numel(), 0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class TiedLM(LightningModule):
    """An embedding tied to the output head, built in configure_model; ``head_first``: the head is created (and
    registered) before the embedding whose weight it takes, so the module order does not tell who created it."""

    def __init__(self, head_first: bool) -> None:
        super().__init__()
        self.head_first = head_first
        self.net: nn.ModuleDict | None = None

    def configure_model(self) -> None:
        if self.net is not None:
            return
        head = SeededLinear(8, 32, bias=False) if self.head_first else None
        embed = SeededEmbedding(32, 8)
        body = SeededLinear(8, 8)
        head = head or SeededLinear(8, 32, bias=False)
        head.weight = embed.weight  # the embedding's values, as on a real device
        parts = {"head": head, "embed": embed, "body": body} if self.head_first else {"embed": embed, "body": body}
        self.net = nn.ModuleDict({**parts, "head": head})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net["head"](torch.tanh(self.net["body"](self.net["embed"](tokens))))

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("val", self(batch[0]).float().mean())


class InitialisesChildren(nn.Module):
    """A block without parameters of its own whose reset_parameters() initialises its layers, called by its
    ``__init__`` as usual (on the meta device that call does nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for index, layer in enumerate(self.inner):
            _fixed(layer.weight, 10 + index, 0.5)
            nn.init.constant_(layer.bias, 0.25)


class ParentInitialised(TiedLM):
    """The block above (its layers units of their own: ``wrap_policy={nn.Linear}``), and a multi-head attention whose
    own reset_parameters() zeroes the bias of its ``out_proj`` child, another unit. ``attend``: the forward uses the
    attention, which reads out_proj's weight without calling out_proj (a unit that is never gathered here)."""

    attend = False

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.ModuleDict({"block": InitialisesChildren(), "attention": nn.MultiheadAttention(8, 2)})

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        x = self.net["block"].inner(tokens.float().unsqueeze(-1).expand(-1, -1, 8))
        return self.net["attention"](x, x, x)[0] if self.attend else x


def _tied_initial_weights(rank: int, world_size: int) -> dict[Any, dict[str, torch.Tensor]]:
    tokens = DataLoader(TensorDataset(torch.arange(32).view(8, 4)), batch_size=4)
    weights = {}
    for head_first in (False, True):
        model = TiedLM(head_first)
        trainer = _trainer(world_size)
        trainer.validate(model, tokens, verbose=False)
        with trainer.strategy.gathered_params():
            assert model.net is not None
            assert model.net["head"].weight is model.net["embed"].weight
            weights[head_first] = {name: p.detach().clone() for name, p in model.named_parameters()}
    parent = ParentInitialised(head_first=False)
    trainer = _trainer(world_size, strategy=ZeroStrategy(stage=3, wrap_policy={nn.Linear}))
    trainer.validate(parent, tokens, verbose=False)
    with trainer.strategy.gathered_params():
        weights["parent"] = {name: p.detach().clone() for name, p in parent.named_parameters()}
    attending = ParentInitialised(head_first=False)
    attending.attend = True
    try:  # last: it raises inside validate
        _trainer(world_size, strategy=ZeroStrategy(stage=3, wrap_policy={nn.Linear})).validate(attending, tokens)
    except RuntimeError as error:
        weights["attending_error"] = str(error)  # type: ignore[assignment]
    return weights


@pytest.fixture(scope="module")
def initial_weights() -> list[dict[Any, dict[str, torch.Tensor]]]:
    """One spawn for the initialisation tests below."""
    return run_on_ranks(_tied_initial_weights, 2)


def test_a_tied_weight_built_on_the_meta_device_starts_from_its_creators_values(
    initial_weights: list[dict[Any, dict[str, torch.Tensor]]],
) -> None:
    """Stage 3 initialises a model from configure_model by each module's reset_parameters(): a weight two modules
    share must keep the values its creator gave it, as on a real device (the output head's Linear initialisation
    used to overwrite the embedding's: std 0.02 instead of 1, a different model from DDP's and stage 2's)."""
    expected = {}
    for head_first in (False, True):
        eager = TiedLM(head_first)
        eager.configure_model()
        expected[head_first] = dict(eager.named_parameters())
    for per_rank in initial_weights:
        for head_first in (False, True):
            weights = per_rank[head_first]
            assert weights.keys() == expected[head_first].keys()
            for name, value in weights.items():
                assert torch.equal(value, expected[head_first][name]), (head_first, name)


def test_a_parents_reset_parameters_initialises_children_in_other_units(
    initial_weights: list[dict[Any, dict[str, torch.Tensor]]],
) -> None:
    """A block's reset_parameters() that initialises its layers (units of their own) reaches them, as its __init__
    did on a real device (it was never run: the layers kept nn.Linear's initialisation); nn.MultiheadAttention's
    zeroes its out_proj child's bias, another unit (it raised: that bias was at rest)."""
    eager = ParentInitialised(head_first=False)
    eager.configure_model()
    expected = dict(eager.named_parameters())
    for per_rank in initial_weights:
        weights = per_rank["parent"]
        assert weights.keys() == expected.keys()
        for name in ("block.inner.0.weight", "block.inner.0.bias", "block.inner.1.weight", "block.inner.1.bias"):
            assert torch.equal(weights[f"net.{name}"], expected[f"net.{name}"]), name
        assert torch.equal(weights["net.attention.out_proj.bias"], torch.zeros(8))
        assert torch.equal(weights["net.attention.in_proj_bias"], torch.zeros(24))


def test_a_unit_read_without_calling_its_module_names_the_wrap_policy(
    initial_weights: list[dict[Any, Any]],
) -> None:
    """nn.MultiheadAttention reads its out_proj's weight directly: with out_proj a unit of its own it is never
    gathered, and the error says why and what to change, not only where a resting parameter may be read."""
    for per_rank in initial_weights:
        message = per_rank["attending_error"]
        assert "'net.attention.out_proj.weight'" in message, message
        assert "take the owner's class out of wrap_policy" in message, message


def test_metrics_built_on_the_meta_device_keep_real_states() -> None:
    """Inside stage 3's meta-device context a torchmetrics metric's states (neither parameters nor buffers: nothing
    could give them values later) are made as on a real device, with their defaults; the layers stay on meta."""
    from lightning_zero.core.stage3.meta_init import on_meta_device

    with on_meta_device():
        layer = nn.Linear(4, 4)
        mean, largest = torchmetrics.MeanMetric(), torchmetrics.MaxMetric()
        collection = torchmetrics.MetricCollection({"acc": torchmetrics.Accuracy(task="multiclass", num_classes=3)})
    assert layer.weight.is_meta
    assert not mean.mean_value.is_meta
    assert largest.max_value.item() == float("-inf")
    largest.update(torch.tensor([2.0, 5.0]))
    assert largest.compute().item() == 5.0
    collection.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    assert collection.compute()["acc"].item() == pytest.approx(2 / 3)


class MetricInConfigureModel(LightningModule):
    """Layers and a torchmetrics metric built in configure_model (at stage 3 on the meta device)."""

    def configure_model(self) -> None:
        if hasattr(self, "net"):
            return
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3))
        self.accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.accuracy(self.net(batch[0]), batch[1])
        self.log("acc", self.accuracy)


def _validate_with_a_metric(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(stage=3),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return trainer.validate(MetricInConfigureModel(), DataLoader(data, batch_size=8), verbose=False)[0]["acc"]


def test_a_metric_built_in_configure_model_at_stage_3() -> None:
    """It failed at setup on every rank with torch's "Cannot copy out of meta tensor" (found in a user's trial)."""
    accuracies = run_on_ranks(_validate_with_a_metric, 2)
    assert accuracies[0] == accuracies[1]
    assert 0.0 <= accuracies[0] <= 1.0

"""Tiny LightningModules, data and a case runner for the Lightning-level tests.

Everything here is importable by the processes that ``tests.helpers.run_on_ranks`` spawns. Models seed
themselves in ``__init__`` so that every rank and every strategy starts from the same weights.

A *case* is a plain dict so that a whole list of cases can be sent to the ranks in one spawn:

- ``strategy``: ``"ddp"`` (the oracle: ``DDPStrategy(find_unused_parameters=True)``), a ZeRO stage (1, 2, 3) or
  ``"model_parallel"`` (Lightning's ``ModelParallelStrategy``, FSDP2 data parallel over every rank: use the model
  ``"two_layer_fsdp"``);
- ``model``: a key of :data:`MODELS`; ``model_kwargs``: its keyword arguments;
- ``trainer``: extra ``Trainer`` keyword arguments (``max_steps``, ``accumulate_grad_batches``, clipping);
- ``strategy_kwargs``: extra ``ZeroStrategy`` keyword arguments;
- ``save_at``: ``(global_step, path)``: ``trainer.save_checkpoint(path)`` once that many steps are done;
- ``ckpt_path``: a checkpoint to resume from; ``samples``: the dataset size.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, Strategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

BATCH_SIZE = 4


class TwoLayer(pl.LightningModule):
    """Linear(7, hidden) -> tanh -> Linear(hidden, 3): uneven sizes, so 2 and 3 ranks both need padding.

    With the default ``hidden=16`` the model has 179 parameter elements (a prime), and the two param groups
    128 and 51 elements, so shards of 2 and 3 ranks end in padding and tensors straddle shard boundaries.

    Args:
        hidden: width of the hidden layer.
        lr: learning rate (AdamW or SGD).
        param_groups: two param groups (first layer / second layer) with their own lr and weight decay,
            plus a ``LambdaLR`` that steps every optimizer step.
        optimizer: ``"adamw"`` or ``"sgd"`` (SGD with momentum and weight decay).
    """

    def __init__(
        self, hidden: int = 16, lr: float = 1e-2, param_groups: bool = False, optimizer: str = "adamw"
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, hidden)
        self.b = nn.Linear(hidden, 3)
        self.lr = lr
        self.param_groups = param_groups
        self.optimizer_name = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        if not self.param_groups:
            return _make_optimizer(self.optimizer_name, self.parameters(), self.lr, weight_decay=0.01)
        groups = [
            {"params": self.a.parameters(), "lr": self.lr, "weight_decay": 0.1},
            {"params": self.b.parameters(), "lr": self.lr / 3, "weight_decay": 0.0},
        ]
        optimizer = _make_optimizer(self.optimizer_name, groups, self.lr, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 0.8**s, lambda s: 1.0 / (1 + s)])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TiedLM(pl.LightningModule):
    """A token model whose output head shares its weight with the input embedding (weight tying).

    169 parameter elements (65 + 54 + 50), so both 2 and 3 ranks pad the flat buffer.
    """

    VOCAB = 13

    def __init__(self, lr: float = 1e-2, param_groups: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, 5)
        self.up = nn.Linear(5, 9)
        self.down = nn.Linear(9, 5)
        self.head = nn.Linear(5, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.lr = lr
        self.param_groups = param_groups

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(torch.tanh(self.up(hidden)))
        return self.head(hidden)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), targets.reshape(-1))

    def configure_optimizers(self) -> Any:
        if not self.param_groups:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        groups = [
            {"params": [*self.embed.parameters(), *self.up.parameters()], "weight_decay": 0.1},
            {"params": self.down.parameters(), "lr": self.lr / 2, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TwoOptimizerManual(pl.LightningModule):
    """GAN-like manual optimization: ``opt_a`` trains module A, ``opt_b`` module B; ``loss_a`` runs through both.

    Args:
        disjoint: ``loss_a`` uses A only and ``loss_b`` B only (each backward leaves the other module alone).
        toggle: wrap each update in ``toggle_optimizer``/``untoggle_optimizer`` (Lightning's GAN recipe), so
            that ``loss_a`` leaves no gradient on B; without it, B gets a gradient from ``loss_a`` that
            ``opt_b.zero_grad()`` must discard.
    """

    def __init__(self, toggle: bool = False, disjoint: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))  # module A
        self.disc = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3))  # module B
        self.toggle = toggle
        self.disjoint = disjoint
        self.record: list[list[bool]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()

        if self.toggle:
            self.toggle_optimizer(opt_a)
            # Lightning's contract for toggle_optimizer: only opt_a's parameters require grad now.
            self.record.append([p.requires_grad for p in self.parameters()])
        through = self.gen(x)[:, :3] if self.disjoint else self.disc(self.gen(x))
        loss_a = nn.functional.mse_loss(through, y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        if self.toggle:
            self.untoggle_optimizer(opt_a)

        if self.toggle:
            self.toggle_optimizer(opt_b)
        fake = x[:, 2:] if self.disjoint else self.gen(x).detach()
        loss_b = nn.functional.mse_loss(self.disc(fake), -y) + self.disc(x[:, :5]).pow(2).mean()
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        opt_b.step()
        if self.toggle:
            self.untoggle_optimizer(opt_b)

    def configure_optimizers(self) -> Any:
        opt_a = torch.optim.AdamW(self.gen.parameters(), lr=1e-2, weight_decay=0.01)
        opt_b = torch.optim.SGD(self.disc.parameters(), lr=5e-2, momentum=0.9)
        return opt_a, opt_b


class PartlyUsed(TwoLayer):
    """TwoLayer plus a frozen input layer and two heads that only some steps or some ranks use.

    ``rare`` runs on every third batch (on all ranks), so in other steps no rank gives it a gradient;
    ``alternating`` runs where ``batch_idx + rank`` is even, so in every step one rank of two uses it and
    the other does not. With AdamW (``zero_grad(set_to_none=True)``) a parameter without a gradient is
    skipped, weight decay included, exactly as under DDP.
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.rare = nn.Linear(3, 3)
        self.alternating = nn.Linear(3, 3, bias=False)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(torch.tanh(self.frozen(x)))
        if batch_idx % 3 == 0:
            out = out + self.rare(out)
        if (batch_idx + self.global_rank) % 2 == 0:
            out = out + self.alternating(out)
        return nn.functional.mse_loss(out, y)


class FsdpTwoLayer(TwoLayer):
    """TwoLayer for Lightning's ``ModelParallelStrategy`` too: there ``configure_model`` applies FSDP2 (``fully_shard``)
    to each block, then the root, over the data-parallel mesh; same weights, keys and AdamW as TwoLayer. Under any
    other strategy (no device mesh) it is TwoLayer: one class moves between the two strategies."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is None:  # not under ModelParallelStrategy
            return
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.a, mesh=mesh)
        fully_shard(self.b, mesh=mesh)
        fully_shard(self, mesh=mesh)


MODELS: dict[str, type[pl.LightningModule]] = {
    "two_layer": TwoLayer,
    "two_layer_fsdp": FsdpTwoLayer,
    "tied": TiedLM,
    "manual": TwoOptimizerManual,
    "partly_used": PartlyUsed,
}


def _make_optimizer(name: str, params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}")


def make_loader(model: str, samples: int = 96) -> DataLoader:
    """The same fixed data on every rank; Lightning's DistributedSampler splits it (shuffled, seed 0: alike in every
    run)."""
    gen = torch.Generator().manual_seed(1)
    if model == "tied":
        tokens = torch.randint(0, TiedLM.VOCAB, (samples, 5), generator=gen)
        targets = torch.roll(tokens, 1, dims=1)
        dataset = TensorDataset(tokens, targets)
    else:
        dataset = TensorDataset(torch.randn(samples, 7, generator=gen), torch.randn(samples, 3, generator=gen))
    return DataLoader(dataset, batch_size=BATCH_SIZE)


def make_strategy(case: dict[str, Any], world_size: int | None = None) -> Strategy:
    from lightning_zero import ZeroStrategy

    if case["strategy"] == "ddp":
        return DDPStrategy(find_unused_parameters=True)
    if case["strategy"] == "model_parallel":
        # [Note: ModelParallelStrategy's data split] its default mesh is data_parallel_size=num_nodes, so on one
        # node every rank would be fed the same batches; FSDP2 over all ranks as DDP / ZeRO splits the data
        # (Lightning's DistributedSampler then gets num_replicas=world_size, rank=global rank, as for ZeroStrategy).
        if world_size is None:
            raise ValueError("make_strategy(case, world_size): 'model_parallel' needs the world size for its mesh")
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    return ZeroStrategy(stage=case["strategy"], **case.get("strategy_kwargs", {}))


def make_trainer(world_size: int, strategy: Strategy | str, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world_size,
        "strategy": strategy,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def state_of(module: nn.Module) -> dict[str, Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint(path)`` on every rank right after optimizer step ``step``.

    Saving inside fit, at the end of an epoch, is what makes a resumed run continue exactly like the
    uninterrupted one: a checkpoint written after ``fit`` returned at ``max_steps`` restores Lightning's
    loops one batch off (a Lightning behaviour, seen with DDP too).
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


class StartStep(pl.Callback):
    """The global step at which ``fit`` started training (after any checkpoint's loop state was restored)."""

    step: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.step = trainer.global_step


def fit_case(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Run one case on this rank (inside a process group); return its parameters and some trainer facts."""
    model = MODELS[case["model"]](**case.get("model_kwargs", {}))
    trainer_kwargs = dict(case.get("trainer", {}))
    start = StartStep()
    save_at = [SaveAt(*case["save_at"])] if case.get("save_at") else []
    trainer_kwargs["callbacks"] = [start, *trainer_kwargs.get("callbacks", []), *save_at]
    trainer = make_trainer(world_size, make_strategy(case, world_size), **trainer_kwargs)
    loader = make_loader(case["model"], case.get("samples", 96))
    trainer.fit(model, loader, ckpt_path=case.get("ckpt_path"))
    from lightning_zero import ZeroStrategy

    if isinstance(trainer.strategy, ZeroStrategy):
        with trainer.strategy.gathered_params():  # stage 3 keeps only shards after fit
            state = state_of(model)
    elif isinstance(trainer.strategy, ModelParallelStrategy):  # DTensor shards: gather the full tensors
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
    else:
        state = state_of(model)
    return {
        "state": state,
        "global_step": trainer.global_step,
        "start_step": start.step,
        "record": getattr(model, "record", None),
    }


def fit_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``run_on_ranks`` entry point: every case in turn, in one set of processes.

    A case that raises (on every rank alike) is reported as ``{"error": traceback}`` so that the other cases
    of the batch still run; :func:`result_of` turns it into a test failure.
    """
    results = []
    for case in cases:
        try:
            results.append(fit_case(world_size, copy.deepcopy(case)))
        except Exception:
            results.append({"error": f"rank {rank}, case {case}:\n{traceback.format_exc()}"})
    return results


def result_of(result: dict[str, Any]) -> dict[str, Any]:
    """The result of a case, failing the test with the rank's traceback if the case raised."""
    if "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


def assert_every_case_finished(cases: Mapping[Any, Sequence[Any]]) -> None:
    """Fail naming every case and rank whose result is ``{"error": traceback}``.

    ``cases``: each case's result on every rank. The other tests of a spawn often read one rank's result of a case,
    or none (a run that only writes a checkpoint), so a case that raised on another rank alone would pass unseen;
    leave out the cases whose error is the outcome their tests assert.
    """
    failed = [
        f"case {name!r}, rank {rank}:\n{result['error']}"
        for name, per_rank in cases.items()
        for rank, result in enumerate(per_rank)
        if isinstance(result, dict) and result.get("error") is not None
    ]
    if failed:
        pytest.fail(f"{len(failed)} case result(s) hold an error:\n" + "\n".join(failed), pytrace=False)


def max_rel_diff(expected: dict[str, Tensor], actual: dict[str, Tensor]) -> dict[str, float]:
    """``max |a - b| / max |a|`` per tensor (keys must match)."""
    assert expected.keys() == actual.keys(), (sorted(expected), sorted(actual))
    out = {}
    for name, ref in expected.items():
        ref, got = ref.double(), actual[name].double()
        assert ref.shape == got.shape, (name, ref.shape, got.shape)
        scale = ref.abs().max().clamp_min(1e-12)
        out[name] = ((ref - got).abs().max() / scale).item()
    return out


class RecordingTwoLayer(TwoLayer):
    """TwoLayer that writes, on every rank at the end of training, its rank, step and weights to ``out_dir``.

    Module-level so that a ``"spawn"`` launcher can pickle it; with ``"fork"`` the files are the only way
    (besides rank 0's weights, which the launcher returns) to see what the worker processes did.
    """

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.out_dir = out_dir

    def on_train_end(self) -> None:
        payload = {
            "global_rank": self.global_rank,
            "world_size": self.trainer.world_size,
            "global_step": self.trainer.global_step,
            "state": state_of(self),
        }
        torch.save(payload, f"{self.out_dir}/rank{self.global_rank}.pt")


class TokenSequences(Dataset):
    """``size`` token sequences of ``length`` next-token labels, of which sample i has 1 to ``length`` real ones (the
    rest labelled -100): every micro-batch's token count differs (for weighted losses)."""

    def __init__(self, size: int, vocab: int, length: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.tokens = torch.randint(0, vocab, (size, length + 1), generator=generator)
        self.lengths = torch.randint(1, length + 1, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        labels = self.tokens[index, 1:].clone()
        labels[self.lengths[index] :] = -100
        return self.tokens[index, :-1], labels

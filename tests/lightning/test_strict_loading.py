"""``LightningModule.strict_loading = False`` with sharded checkpoints behaves as with DDP's full files.

The model's tensors load like ``load_state_dict(strict=False)``: keys missing from the checkpoint keep their values,
keys the model lacks are skipped, a shape that differs still raises. Optimizer state needs the param groups it was
saved with, as in Lightning's other strategies (DDP's ``Optimizer.load_state_dict`` refuses groups of other sizes):
a parameter that is new but frozen resumes like DDP, a new trained one raises a clear error.

One spawn of 2 ranks: DDP, stage 1 and stage 3 each save a ``Variant`` after ``SAVE_STEP`` steps, then load their own
checkpoint into every variant (validate, or fit on to ``STEPS``).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.helpers import run_on_ranks
from tests.lightning.models import SaveAt, TwoLayer, make_loader, make_strategy, make_trainer, max_rel_diff, state_of

SAVE_STEP = 4
STEPS = 6
RTOL = 1e-5
STRATEGIES = ("ddp", 1, 3)
# name: (Variant kwargs, what runs: "validate" or "fit")
SCENARIOS: dict[str, tuple[dict[str, Any], str]] = {
    "extra_trained": ({"extra": "trained", "strict": False}, "validate"),
    "fewer": ({"bias": False, "strict": False}, "validate"),
    "extra_trained_strict": ({"extra": "trained"}, "validate"),
    "wider": ({"hidden": 17, "strict": False}, "validate"),
    "extra_frozen_fit": ({"extra": "frozen", "strict": False}, "fit"),
    "extra_trained_fit": ({"extra": "trained", "strict": False}, "fit"),
    "sgd_fit": ({"sgd": True}, "fit"),  # the checkpoint holds AdamW's state
}


class Variant(TwoLayer):
    """TwoLayer, optionally with an ``extra`` Linear after it (trained or frozen), without ``b.bias``, or wider; its
    optimizer holds the trainable parameters only."""

    def __init__(
        self, extra: str | None = None, bias: bool = True, hidden: int = 16, strict: bool = True, sgd: bool = False
    ) -> None:
        super().__init__(hidden=hidden)
        self.sgd = sgd
        if not bias:
            self.b = nn.Linear(hidden, 3, bias=False)
        self.extra = None
        if extra is not None:
            torch.manual_seed(1)
            self.extra = nn.Linear(3, 3)
            self.extra.requires_grad_(extra == "trained")
        self.strict_loading = strict

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out if self.extra is None else out + self.extra(out)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]
        if self.sgd:
            return torch.optim.SGD(trained, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(trained, lr=self.lr, weight_decay=0.01)


def _held_state(trainer: Any, model: nn.Module) -> dict[str, Tensor]:
    from lightning_zero import ZeroStrategy

    if isinstance(trainer.strategy, ZeroStrategy):
        with trainer.strategy.gathered_params():
            return state_of(model)
    return state_of(model)


def _scenario(world_size: int, strategy: Any, ckpt_path: str, kwargs: dict[str, Any], run: str) -> dict[str, Any]:
    model = Variant(**kwargs)
    loader = make_loader("two_layer", 96)
    trainer = make_trainer(world_size, make_strategy({"strategy": strategy}), max_steps=STEPS)
    try:
        if run == "fit":
            trainer.fit(model, loader, ckpt_path=ckpt_path)
        else:
            trainer.validate(model, loader, ckpt_path=ckpt_path, verbose=False)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"state": _held_state(trainer, model), "global_step": trainer.global_step}


def _cases(rank: int, world_size: int, directory: str) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    try:
        for strategy in STRATEGIES:
            path = str(Path(directory) / f"{strategy}.ckpt")
            trainer = make_trainer(world_size, make_strategy({"strategy": strategy}), max_steps=SAVE_STEP)
            trainer.callbacks.append(SaveAt(SAVE_STEP, path))
            saved = Variant()
            trainer.fit(saved, make_loader("two_layer", 96))
            results[strategy, "saved"] = _held_state(trainer, saved)
            for name, (kwargs, run) in SCENARIOS.items():
                results[strategy, name] = _scenario(world_size, strategy, path, kwargs, run)
        ddp_file = str(Path(directory) / "ddp.ckpt")  # a full file: the other loading path
        results[3, "sgd_fit_from_full"] = _scenario(world_size, 3, ddp_file, {"sgd": True}, "fit")
    except Exception:
        results["error"] = f"rank {rank}:\n{traceback.format_exc()}"
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    per_rank = run_on_ranks(_cases, 2, str(tmp_path_factory.mktemp("strict")))
    for results in per_rank:
        if "error" in results:
            pytest.fail(results["error"], pytrace=False)
    return per_rank


def _loaded(result: dict[str, Any], what: str) -> dict[str, Tensor]:
    assert "state" in result, f"{what}: {result.get('error')}"
    return result["state"]


@pytest.mark.parametrize("scenario", ["extra_trained", "fewer"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_validate_skips_missing_and_unexpected_keys(ranks: list[dict], strategy: Any, scenario: str) -> None:
    """The tensors in both keep the checkpoint's values; a tensor the checkpoint lacks keeps its own."""
    kwargs, _ = SCENARIOS[scenario]
    fresh = state_of(Variant(**kwargs))
    for rank, results in enumerate(ranks):
        saved, loaded = results[strategy, "saved"], _loaded(results[strategy, scenario], f"rank {rank}")
        assert set(loaded) == set(fresh), f"rank {rank}"
        for key, value in loaded.items():
            expected = saved.get(key, fresh[key])
            assert torch.equal(value, expected), f"rank {rank}, {strategy}: {key}"
        assert any(not torch.equal(saved[k], fresh[k]) for k in saved if k in fresh), "the saved run did not train"


# validate() at stages 1 and 2 loads the plain module (no engine), as DDP does: torch's own errors then.
MISSING = {"ddp": 'Missing key(s) in state_dict: "extra.weight"', 1: 'Missing key(s) in state_dict: "extra.weight"'}
MISSING[3] = "is of a different model: it has no tensor 'extra.weight'"
WIDER = {"ddp": "size mismatch for a.weight", 1: "size mismatch for a.weight"}
WIDER[3] = "tensor 'a.weight' has shape [16, 7] there, [17, 7] here"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strict_loading_still_refuses_a_different_model(ranks: list[dict], strategy: Any) -> None:
    for rank, results in enumerate(ranks):
        error = results[strategy, "extra_trained_strict"].get("error", "")
        assert MISSING[strategy] in error, f"rank {rank}: {error}"
        if strategy == 3:
            assert "strict_loading = False) skips the tensors only one of them has" in error, error


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_different_shape_raises_even_without_strict_loading(ranks: list[dict], strategy: Any) -> None:
    for rank, results in enumerate(ranks):
        error = results[strategy, "wider"].get("error", "")
        assert WIDER[strategy] in error, f"rank {rank}, {strategy}: {error}"


@pytest.mark.parametrize("strategy", [1, 3])
def test_fit_with_a_new_frozen_parameter_resumes_like_ddp(ranks: list[dict], strategy: Any) -> None:
    """The optimizer holds the same parameters as when saved: its state loads, and training goes on like DDP's."""
    for rank, results in enumerate(ranks):
        ddp = _loaded(results["ddp", "extra_frozen_fit"], f"rank {rank}: DDP")
        zero = _loaded(results[strategy, "extra_frozen_fit"], f"rank {rank}: stage {strategy}")
        assert results[strategy, "extra_frozen_fit"]["global_step"] == STEPS
        diffs = max_rel_diff(ddp, zero)
        assert max(diffs.values()) <= RTOL, f"rank {rank}: {diffs}"
        assert torch.equal(zero["extra.weight"], state_of(Variant(extra="frozen"))["extra.weight"])


@pytest.mark.parametrize("strategy", [1, 3])
def test_fit_with_a_new_trained_parameter_raises_like_ddp(ranks: list[dict], strategy: Any) -> None:
    """Optimizer state needs the param groups it was saved with; strict_loading=False relaxes the model only."""
    for rank, results in enumerate(ranks):
        assert "error" in results["ddp", "extra_trained_fit"], f"rank {rank}: DDP resumed another optimizer"
        error = results[strategy, "extra_trained_fit"].get("error", "")
        assert "was saved with optimizers whose param groups hold" in error, f"rank {rank}: {error}"
        assert "strict_loading=False skips missing and unexpected tensors of the model only" in error, error
    assert ranks[0][strategy, "extra_trained_fit"] == ranks[1][strategy, "extra_trained_fit"]


@pytest.mark.parametrize("case", [(1, "sgd_fit"), (3, "sgd_fit"), (3, "sgd_fit_from_full")])
def test_resuming_another_optimizer_type_raises_naming_both(ranks: list[dict], case: tuple[int, str]) -> None:
    """AdamW's checkpoint resumed with SGD: DDP fails (``KeyError: 'momentum'``); ZeRO trained on with SGD's groups
    merged with AdamW's hyper-parameters (its weight decay) and momentum restarted from zero, silently (found in a
    user's trial). Now a clear error on every rank, from the sharded directory and from a full file."""
    for rank, results in enumerate(ranks):
        assert "error" in results["ddp", "sgd_fit"], f"rank {rank}: DDP resumed AdamW's state into SGD"
        error = results[case].get("error", "")
        for part in ("another optimizer type", "SGD", "'betas'", "'momentum'"):
            assert part in error, f"rank {rank}: {part!r} not in {error}"
    assert ranks[0][case] == ranks[1][case]

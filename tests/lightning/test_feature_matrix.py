"""Features tested together, as users combine them: an all-pairs matrix through the ``Trainer`` on 2 gloo ranks.

Factors (every legal pair of two factors' values occurs in some case, see ``tests/pairwise.py``):

- ``stage`` 1 / 2 / 3; ``precision`` ``"32-true"`` / ``"bf16-mixed"`` / ``"16-mixed"`` (fp16 with dynamic loss
  scaling, through Lightning's plugin); ``offload`` none / cpu / nvme / parameters too (stage 3); ``partition`` flat
  / parameter; ``weighted`` loss (the mean over every token of a step, see docs/weighted_loss.md);
  ``accumulate_clip`` (2 micro-batches a step and clipping by norm) or neither;
- ``uneven``: rank 1's loss reaches only the first layer in step 1 and no parameter in step 2 ("legal and trains
  like DDP"), or not;
- ``resume``: a sharded checkpoint saved at the end of the first epoch resumes in a new ``fit`` that must end where
  the uninterrupted one did;
- ``checkpoint``: no ``ModelCheckpoint``, one with ``save_last="link"`` every epoch (and the resume reads its epoch-0
  directory and saves over the existing names and link), or one keeping the best of every step (``save_top_k=1``);
- ``overlap_comm`` on or off; ``bucket_cap_mb`` 25 or tiny (a bucket a parameter); ``shard_size`` ``None`` or 1
  (hybrid sharding with groups of one rank: the gradients are all-reduced across the replicas, one replica writes
  the checkpoints); ``secondary_shard_size`` ``None`` or 1 (stage 3 only: each unit keeps a copy from forward to
  backward, whose gathers read it, see [Note: secondary shards]); ``quantize_gradients`` off or on (on one node
  nothing crosses nodes, so it must change nothing; with ``partition="parameter"`` it is refused, so that pair is
  not legal); ``free_gradients_after_step`` off or on (on: no gradient is held when Lightning's ``zero_grad`` comes
  after the next forward, checked in ``on_before_zero_grad``; off: every step's gradients are still held there);
  ``activation_checkpointing``: none, or each Linear called inside ``torch.utils.checkpoint`` as Hugging Face's
  gradient checkpointing calls a layer (its hooks inside the checkpoint), non-reentrant or reentrant (see [Note:
  reentrant activation checkpointing at stage 3]).

Each case ends with the same parameters as its oracle, a run doing the same maths: in fp32 Lightning's DDP with the
model's oracle variant (a loss reaching every parameter with zeros where rank 1's does not; the weighted loss scaled
by ``N k / W`` so that DDP's mean of means is the global token mean), in 16-bit runs ZeroStrategy(stage=1) with the
same maths factors and nothing else (itself tested against same-maths references in test_mixed_precision.py).
Tolerance: RTOL (1e-5) per tensor, the fp32 parity bar of test_ddp_equivalence.py; the fp32 masters are compared in
16-bit runs. All cases run in one spawn, each in a process group of its own (``run_isolated``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

from tests.lightning.models import TokenSequences, max_rel_diff, result_of
from tests.lightning.training_models import TIMEOUT, final_state, run_isolated
from tests.pairwise import all_pairs, legal_pairs, pairs_of

WORLD_SIZE = 2
VOCAB, LENGTH, BATCH, CLIP = 11, 6, 2, 0.05
STEPS_PER_EPOCH, EPOCHS = 2, 2
RTOL = 1e-5
FACTORS: dict[str, tuple[Any, ...]] = {
    "stage": (1, 2, 3),
    "precision": ("32-true", "bf16-mixed", "16-mixed"),
    "offload": ("none", "cpu", "nvme", "params_cpu", "params_nvme"),
    "partition": ("flat", "parameter"),
    "weighted": (False, True),
    "accumulate_clip": (False, True),
    "uneven": (False, True),
    "resume": (False, True),
    "checkpoint": ("none", "link", "top1"),
    "overlap_comm": (True, False),  # reductions during backward and stage-3 prefetch, or neither
    "bucket_cap_mb": (25, 0.0005),  # one bucket a buffer, or one a parameter
    "shard_size": (None, 1),  # flat, or hybrid: each rank its own shard group, replicas all-reduce the gradients
    "secondary_shard_size": (None, 1),  # stage 3: backward gathers from the slices kept after forward (a full copy)
    "quantize_gradients": (False, True),  # one node: the same as off
    "free_gradients_after_step": (False, True),
    "activation_checkpointing": ("none", "non_reentrant", "reentrant"),
}
OFFLOAD = {  # offload -> (offload_optimizer, offload_params)
    "none": (False, False),
    "cpu": ("cpu", False),
    "nvme": ("nvme", False),
    "params_cpu": ("cpu", "cpu"),
    "params_nvme": ("nvme", "nvme"),
}
MATHS = ("precision", "weighted", "accumulate_clip", "uneven")  # what the oracle must share with a case
PLAIN = {  # the oracle's
    "overlap_comm": True,
    "bucket_cap_mb": 25,
    "shard_size": None,
    "secondary_shard_size": None,
    "quantize_gradients": False,
    "free_gradients_after_step": False,
    "activation_checkpointing": "none",
}


def legal(case: dict[str, Any]) -> bool:
    """Offloading parameters and secondary shards need stage 3 (a ValueError otherwise, tested in
    tests/unit/test_config.py and tests/distributed/test_secondary_shards.py), and ``quantize_gradients`` the flat
    partition (tests/distributed/test_quantized_gradients.py)."""
    if case.get("quantize_gradients") and case.get("partition", "flat") == "parameter":
        return False
    stage3_only = str(case.get("offload", "")).startswith("params") or case.get("secondary_shard_size") is not None
    return not (stage3_only and case.get("stage", 3) != 3)


CASES = all_pairs(FACTORS, legal)


def _samples(accumulate: int) -> int:
    return WORLD_SIZE * BATCH * accumulate * STEPS_PER_EPOCH


def step_weights(accumulate: int) -> list[float]:
    """The global token count of each optimizer step, as Lightning's DistributedSampler (no shuffling) deals the
    samples: rank r gets samples r, r + N, ..., in batches of BATCH, ``accumulate`` batches a step."""
    data = TokenSequences(_samples(accumulate), VOCAB, LENGTH)
    per_step = BATCH * accumulate * WORLD_SIZE
    return [float(data.lengths[s * per_step : (s + 1) * per_step].sum()) for s in range(STEPS_PER_EPOCH)]


class MatrixLM(pl.LightningModule):
    """Embedding -> Linear -> tanh -> Linear -> tanh -> head; at stage 3 every Linear is a unit.

    ``oracle=True`` makes it the fp32 DDP oracle of a case: every loss reaches every parameter, and a weighted loss
    is scaled so that DDP's average is the step's mean over every token."""

    def __init__(
        self, weighted: bool, uneven: bool, accumulate: int, oracle: bool = False, checkpointing: str = "none"
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.a = nn.Linear(8, 15)
        self.b = nn.Linear(15, 15)
        self.head = nn.Linear(15, VOCAB)
        self.weighted, self.uneven, self.accumulate, self.oracle = weighted, uneven, accumulate, oracle
        self.weights = step_weights(accumulate)
        self.checkpointing = checkpointing

    def forward(self, tokens: Tensor) -> Tensor:
        self.first = torch.tanh(self._layer(self.a, self.emb(tokens)))
        return self.head(torch.tanh(self._layer(self.b, self.first)))

    def _layer(self, layer: nn.Module, hidden: Tensor) -> Tensor:
        if self.checkpointing == "none":
            return layer(hidden)
        return checkpoint(layer.__call__, hidden, use_reentrant=self.checkpointing == "reentrant")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        tokens, labels = batch
        logits = self(tokens)
        loss_sum = nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        tokens_in = (labels != -100).sum()
        loss = loss_sum if self.weighted else loss_sum / tokens_in
        self.log("train_loss", loss.detach().float(), on_step=True)
        step = batch_idx // self.accumulate  # within the epoch
        if self.uneven and self.global_rank == 1 and step == 1:
            if self.current_epoch == 0:  # reaches emb and a only
                loss = self.first.float().pow(2).sum() if self.weighted else self.first.float().pow(2).mean()
            else:  # reaches no parameter
                loss = 0 * logits.detach().float().requires_grad_().sum()
            if self.oracle:
                loss = loss + 0 * logits.float().sum()
        if self.oracle and self.weighted:  # DDP averages ranks and Lightning divides by k: undo both, divide by W
            return loss * WORLD_SIZE * self.accumulate / self.weights[step]
        return {"loss": loss, "loss_weight": tokens_in} if self.weighted else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class SaveAtEpochEnd(pl.Callback):
    """``trainer.save_checkpoint(path)`` at the end of the first epoch (a resumed run then continues exactly)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


class HeldBeforeZeroGrad(pl.Callback):
    """Records, where Lightning calls ``zero_grad`` (after the next step's forward), how many gradient tensors the
    engine's optimizer steps still hold and the bytes of gradients ``memory_report()`` counts."""

    def __init__(self) -> None:
        self.record: list[tuple[int, int]] = []

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        engine = trainer.strategy._engine  # type: ignore[attr-defined]
        held = sum(len(step.gradients()) for step in engine.model.steps)
        self.record.append((held, trainer.strategy.memory_report().gradients))  # type: ignore[attr-defined]


def _precision(name: str) -> dict[str, Any]:
    if name == "16-mixed":  # on the CPU fp16 is asked for with the plugin (see CONTRACT.md)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    return {"precision": name}


def _strategy(case: dict[str, Any], root: Path) -> pl.strategies.Strategy:
    from lightning_zero import ZeroStrategy

    if case.get("oracle") == "ddp":
        return DDPStrategy(find_unused_parameters=True, timeout=TIMEOUT)
    offload_optimizer, offload_params = OFFLOAD[case["offload"]]
    nvme = root / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    return ZeroStrategy(
        stage=case["stage"],
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        nvme_path=str(nvme),
        partition=case["partition"],
        weighted_loss=case["weighted"],
        wrap_policy={nn.Linear},
        overlap_comm=case["overlap_comm"],
        bucket_cap_mb=case["bucket_cap_mb"],
        shard_size=case["shard_size"],
        secondary_shard_size=case["secondary_shard_size"],
        quantize_gradients=case["quantize_gradients"],
        free_gradients_after_step=case["free_gradients_after_step"],
        timeout=TIMEOUT,
    )


def _fit_once(case: dict[str, Any], root: Path, epochs: int, ckpt_path: str | None, save: str | None) -> Any:
    accumulate = 2 if case["accumulate_clip"] else 1
    oracle = case.get("oracle") == "ddp"
    model = MatrixLM(case["weighted"], case["uneven"], accumulate, oracle, case["activation_checkpointing"])
    callbacks: list[pl.Callback] = [SaveAtEpochEnd(save)] if save else []
    if case.get("oracle") != "ddp":
        callbacks.append(HeldBeforeZeroGrad())
    if case["checkpoint"] == "link":
        callbacks.append(
            ModelCheckpoint(
                root / "mc", save_last="link", save_top_k=-1, every_n_epochs=1, save_on_train_epoch_end=True
            )
        )
    elif case["checkpoint"] == "top1":
        callbacks.append(ModelCheckpoint(root / "mc", monitor="train_loss", mode="min", every_n_train_steps=1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=_strategy(case, root),
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=CLIP if case["accumulate_clip"] else None,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(callbacks) and case["checkpoint"] != "none",
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        use_distributed_sampler=False,
        **_precision(case["precision"]),
    )
    data = TokenSequences(
        _samples(accumulate), VOCAB, LENGTH
    )  # not shuffled, so that step_weights knows each step's tokens
    sampler = DistributedSampler(data, num_replicas=WORLD_SIZE, rank=dist.get_rank(), shuffle=False)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, sampler=sampler), ckpt_path=ckpt_path)
    return trainer, model


def _listing(folder: Path) -> dict[str, str]:
    """Each entry of ``folder``: ``"link -> target"``, ``"dir"`` or ``"file"``."""
    if not folder.exists():
        return {}
    return {
        p.name: f"link -> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else "file"
        for p in sorted(folder.iterdir())
    }


def fit_matrix_case(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """One case (or oracle) on this rank: its final state, and for ``resume`` the resumed run's."""
    root = Path(case["root"])
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    saved = str(root / "epoch0") if case["resume"] and case.get("oracle") is None else None
    trainer, model = _fit_once(case, root, EPOCHS, None, saved)
    result: dict[str, Any] = {"state": final_state(trainer, model), "mc": _listing(root / "mc")}
    result["held"] = [r for c in trainer.callbacks if isinstance(c, HeldBeforeZeroGrad) for r in c.record]
    if saved:
        source = str(root / "mc" / "epoch=0-step=2.ckpt") if case["checkpoint"] == "link" else saved
        if case["accumulate_clip"] and case["checkpoint"] == "link":
            source = str(root / "mc" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt")
        trainer, model = _fit_once(case, root, EPOCHS, source, None)
        result["resumed"] = final_state(trainer, model)
        result["mc_after_resume"] = _listing(root / "mc")
    return result


def _oracle_of(case: dict[str, Any]) -> dict[str, Any]:
    """fp32: DDP. 16-bit: ZeroStrategy with nothing but the same maths; with accumulation, stage 1 keeps 16-bit
    local gradients over the micro-batches and reduces once, stages 2 and 3 reduce each micro-batch into the 16-bit
    held shard: another rounding, so their oracle is stage 2."""
    maths = {name: case[name] for name in MATHS}
    if case["precision"] == "32-true":
        return {**maths, "oracle": "ddp", "stage": 1, "offload": "none", "partition": "flat", **PLAIN}
    stage = 2 if case["accumulate_clip"] and case["stage"] > 1 else 1
    return {**maths, "oracle": f"zero{stage}", "stage": stage, "offload": "none", "partition": "flat", **PLAIN}


def _key(case: dict[str, Any]) -> str:
    return "/".join(f"{name}={case[name]}" for name in FACTORS if name in case)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("matrix")
    oracles = {}
    for case in CASES:
        oracle = _oracle_of(case)
        oracles.setdefault(_key(oracle) + f"/{oracle['oracle']}", oracle)
    runs = [
        {**case, "resume": False, "checkpoint": "none", "name": f"oracle {key}", "root": str(base / f"o{i}")}
        for i, (key, case) in enumerate(oracles.items())
    ]
    runs += [{**case, "name": _key(case), "root": str(base / f"c{i}")} for i, case in enumerate(CASES)]
    (base / "results").mkdir()
    per_rank = run_isolated(WORLD_SIZE, runs, str(base / "results"), fit=fit_matrix_case)
    by_name = {run["name"]: [per_rank[r][i] for r in range(WORLD_SIZE)] for i, run in enumerate(runs)}
    return {
        "runs": by_name,
        "oracle_names": {_key(c): f"oracle {_key(_oracle_of(c))}/{_oracle_of(c)['oracle']}" for c in CASES},
    }


def test_the_matrix_covers_every_legal_pair() -> None:
    covered = set().union(*(pairs_of(case) for case in CASES))
    assert legal_pairs(FACTORS, legal) <= covered
    assert len(CASES) <= 25, f"{len(CASES)} cases: keep the matrix inside CI's time"


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_each_combination_trains_like_its_oracle(outcomes: dict[str, Any], case: dict[str, Any]) -> None:
    name = _key(case)
    oracle = outcomes["runs"][outcomes["oracle_names"][name]]
    for rank, (ours, theirs) in enumerate(zip(outcomes["runs"][name], oracle, strict=True)):
        ours, theirs = result_of(ours), result_of(theirs)
        diffs = max_rel_diff(theirs["state"], ours["state"])
        assert max(diffs.values()) <= RTOL, f"rank {rank}: {max(diffs.items(), key=lambda kv: kv[1])}"
        if case["resume"]:
            diffs = max_rel_diff(theirs["state"], ours["resumed"])
            assert max(diffs.values()) <= RTOL, f"rank {rank} resumed: {max(diffs.items(), key=lambda kv: kv[1])}"
        held = ours["held"][1:]  # the first zero_grad of the fit follows no step
        assert len(held) == STEPS_PER_EPOCH * EPOCHS - 1, held
        if case["free_gradients_after_step"]:
            assert all(record == (0, 0) for record in held), f"rank {rank}: held after the step: {held}"
        else:
            assert all(tensors > 0 for tensors, _ in held), f"rank {rank}: nothing held: {held}"
        listing = ours["mc_after_resume"] if case["resume"] else ours["mc"]
        if case["checkpoint"] == "link":  # last.ckpt (and, after a resume, Lightning's versioned last-v1.ckpt)
            links = {name: kind for name, kind in listing.items() if name.startswith("last")}
            assert "last.ckpt" in links, listing
            for kind in links.values():
                assert kind.startswith("link -> "), listing
                assert listing.get(Path(kind.removeprefix("link -> ")).name) == "dir", listing
            assert all(kind == "dir" for name, kind in listing.items() if name not in links), listing
        elif case["checkpoint"] == "top1" and not case["resume"]:  # resumed, the first fit's later saves remain
            assert list(listing.values()) == ["dir"], listing  # the best one kept, every other removed
        assert all(kind == "dir" or kind.startswith("link -> ") for kind in listing.values()), listing

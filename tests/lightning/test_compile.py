"""``torch.compile`` inside ``configure_model`` under ZeroStrategy (stages 1-3) trains like Lightning's DDP with the
same compiled model, and compiles nothing after the first optimizer step.

Lightning refuses ``trainer.fit(torch.compile(model))`` for strategies other than its own single-device, DDP and FSDP
ones (``lightning.pytorch.utilities.compile._verify_strategy_supports_compile``), so users compile inside
``configure_model``: each block (``torch.compile(block)``) or the whole inner model (``model.compile()``, which keeps
the module and compiles its ``__call__``, hooks included). See docs/compile.md.

Every fit runs with gradient accumulation (2 micro-batches a step) and clipping by norm, under dynamo with a
recording ``aot_eager`` backend (dynamo and AOT autograd as inductor gets them, without inductor's C++ compile, which
takes about a minute cold on CI's two cores; benchmarks/compile_step.py runs inductor). Each case records every graph
dynamo hands the backend (its operators) and when. It asserts:

- the parameters after the fit equal DDP's (``RTOL`` per tensor);
- no graph is compiled after the first optimizer step, and no guard failed (no recompilation);
- the graphs are DDP's: stage 3 once broke every block into eager layers (the storage check of its resting
  parameters, see [Note: compiled forwards of resting parameters]). Whole-model compile at stage 3 differs from DDP
  by design: the units' hooks are graph breaks inside the loop over the blocks, so dynamo runs the model's
  forward eagerly and compiles each block's forward (the graph of per-block compile); before the fix it also
  compiled every operation on a root parameter as a graph of its own, recompiling for each.

All cases run in one spawn and one process group (``run_on_ranks``), dynamo reset before each.
"""

from __future__ import annotations

import traceback
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import run_on_ranks
from tests.lightning.models import max_rel_diff, result_of

RTOL = 1e-5
VOCAB, LENGTH, WIDTH = 13, 6, 8
STEPS, ACCUMULATE, CLIP = 3, 2, 0.5
STRATEGIES = ("ddp", 1, 2, 3)
# How configure_model compiles: each block wrapped (torch.compile(block): at stage 3 the wrappers are the gather
# units, their hooks outside the graphs), each block's call compiled (block.compile(): the units' hooks inside the
# compiled call), or the inner model's call (model.compile()).
MODES = ("wrap_blocks", "compile_blocks", "compile_model")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, two blocks (stage 3's default policy makes each a gather unit), head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Recorder:
    """A dynamo backend (``aot_eager``) that records each graph's operators and the optimizer step it came in."""

    def __init__(self) -> None:
        self.graphs: list[tuple[int, list[str]]] = []
        self.step = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        ops = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
        self.graphs.append((self.step, ops))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class CompiledLM(pl.LightningModule):
    """Built in ``__init__`` (so stage 3 starts from DDP's weights), compiled in ``configure_model``."""

    def __init__(self, mode: str, optimizer: str, backend: Recorder) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyLM()
        self.mode, self.optimizer_name, self.backend = mode, optimizer, backend
        self.compiled = False

    def configure_model(self) -> None:
        if self.compiled:
            return
        self.compiled = True
        if self.mode == "wrap_blocks":
            for i, block in enumerate(self.net.blocks):
                self.net.blocks[i] = torch.compile(block, backend=self.backend)
        elif self.mode == "compile_blocks":
            for block in self.net.blocks:
                block.compile(backend=self.backend)
        else:
            self.net.compile(backend=self.backend)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self.net(tokens).reshape(-1, VOCAB), labels.reshape(-1))

    def on_train_batch_end(self, *args: Any) -> None:
        self.backend.step = self.trainer.global_step

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def _fit(world_size: int, strategy_name: Any, mode: str) -> dict[str, Any]:
    from torch._dynamo.utils import guard_failures

    from lightning_zero import ZeroStrategy

    torch._dynamo.reset()
    backend = Recorder()
    model = CompiledLM(mode, "sgd" if mode == "compile_model" else "adamw", backend)
    strategy = DDPStrategy() if strategy_name == "ddp" else ZeroStrategy(stage=strategy_name)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    generator = torch.Generator().manual_seed(1)
    samples = world_size * ACCUMULATE * STEPS * 2
    data = TensorDataset(*(torch.randint(0, VOCAB, (samples, LENGTH), generator=generator) for _ in range(2)))
    trainer.fit(model, DataLoader(data, batch_size=2))
    if isinstance(strategy, ZeroStrategy):
        with strategy.gathered_params():
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "state": state,
        "graphs": backend.graphs,
        "guard_failures": {code.co_name: [str(r) for r in reasons] for code, reasons in guard_failures.items()},
        "global_step": trainer.global_step,
    }


def _fit_all(rank: int, world_size: int) -> dict[tuple[Any, str], dict[str, Any]]:
    out = {}
    for mode in MODES:
        for strategy in STRATEGIES:
            try:
                out[strategy, mode] = _fit(world_size, strategy, mode)
            except Exception:
                out[strategy, mode] = {"error": f"rank {rank}, {strategy}/{mode}:\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[tuple[Any, str], dict[str, Any]]]:
    return run_on_ranks(_fit_all, 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_compiled_model_trains_like_ddp_without_recompiling(
    results: list[dict[tuple[Any, str], dict[str, Any]]], stage: int, mode: str
) -> None:
    for rank, out in enumerate(results):
        ddp, ours = result_of(out["ddp", mode]), result_of(out[stage, mode])
        assert ours["global_step"] == STEPS
        diffs = max_rel_diff(ddp["state"], ours["state"])
        assert max(diffs.values()) <= RTOL, f"rank {rank}: {diffs}"
        late = [ops for step, ops in ours["graphs"] if step >= 1]
        assert not late, f"rank {rank}: compiled after the first optimizer step: {late}"
        assert not ours["guard_failures"], f"rank {rank}: recompiled: {ours['guard_failures']}"
        graphs = [ops for _, ops in ours["graphs"]]
        if stage == 3 and mode == "compile_model":  # the loop over hooked blocks runs eagerly, each block compiled
            expected = [ops for _, ops in result_of(out["ddp", "compile_blocks"])["graphs"]]
        else:
            expected = [ops for _, ops in ddp["graphs"]]
        assert graphs == expected, f"rank {rank}: compiled {graphs}, DDP {expected}"
        assert any("linear" in ops for ops in graphs), f"rank {rank}: no block compiled: {graphs}"

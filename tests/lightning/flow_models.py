"""LightningModules whose forwards and backwards run in uncommon flows (tests/lightning/test_forward_backward_flows.py).

Module level, so the processes ``tests.helpers.run_on_ranks`` spawns can import them; each seeds itself, so every
rank and every strategy starts from the same weights.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

BATCH = 4


def gan_loader(samples: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 6, generator=generator), torch.randn(samples, 4, generator=generator))
    return DataLoader(data, batch_size=BATCH)


def regression_loader(samples: int, features: int = 4) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(samples, features, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).tanh()), batch_size=BATCH)


class RootGAN(pl.LightningModule):
    """A manual-optimization GAN whose generator and discriminator are plain submodules: at stage 3 every
    parameter sits in the root unit, and the step runs forwards after the first ``manual_backward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        bce = nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = self.generator(z)  # not detached: the generator gets gradients from d_loss too
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        self.generator.zero_grad()  # a submodule's zero_grad (the GAN idiom) empties what d_loss gave the generator
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return [
            torch.optim.Adam(self.generator.parameters(), lr=1e-2),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-2),
        ]


class DetachedBlock(nn.Module):
    """Uses its weight twice: through ``self.lin`` and detached (a stop-gradient term). The weight's gradient is
    complete before autograd is done with the detached view, which the input's gradient needs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        stop = x @ self.lin.weight.detach().t()
        return torch.tanh(stop + self.lin(x))


class DetachedUse(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([DetachedBlock() for _ in range(2)])  # two units at stage 3

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x = self.inp(batch[0])
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(x.sum(dim=1, keepdim=True), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class TwoLossesRetained(pl.LightningModule):
    """Manual optimization with two losses of one forward: ``manual_backward(l1, retain_graph=True)``, then
    ``manual_backward(l2)`` over the same graph through every stage-3 unit; then a forward whose one backward also
    asks to retain its graph, which nothing uses again (the next forward drops it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(4, 2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        out = self.head(self.blocks(batch[0]))
        self.manual_backward(nn.functional.mse_loss(out[:, :1], batch[1]), retain_graph=True)
        self.manual_backward(out[:, 1].square().mean())
        out = self.head(self.blocks(batch[0] * 0.5))
        self.manual_backward(nn.functional.mse_loss(out[:, 1:], batch[1]), retain_graph=True)
        optimizer.step()
        optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Saliency(pl.LightningModule):
    """Validation computes an input gradient (a saliency map) with ``torch.autograd.grad``: a backward through
    every stage-3 unit that no ``manual_backward`` announced."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
        self.saliency: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.blocks(batch[0]).sum(dim=1, keepdim=True), batch[1])

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        with torch.enable_grad():
            x = batch[0].clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.blocks(x).sum(), x)
        self.saliency.append(float(grad.abs().sum()))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WithBatchNorm(pl.LightningModule):
    """BatchNorm running statistics under gradient accumulation: DDP broadcasts rank 0's buffers only in the
    forwards that reduce, so rank 1's statistics between them are its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ValidatedBatchNorm(WithBatchNorm):
    """Validation inside ``fit``: DDP broadcasts rank 0's buffers in the first forward after a training forward
    whose gradients were reduced, a validation forward too, so every rank validates (and ends) with rank 0's
    statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.val_losses: list[float] = []

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.val_losses.append(loss.item())
        return loss

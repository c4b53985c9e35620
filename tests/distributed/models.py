"""Tiny models with uneven sizes (so 2 and 3 ranks need padding) for parity tests against DDP."""

from __future__ import annotations

import torch
from torch import Tensor, nn

VOCAB = 13
HIDDEN = 15


class Block(nn.Module):
    """A gate parameter of its own around an inner Linear: as a stage-3 unit it nests the Linear's unit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.inner = nn.Linear(width, width)

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden * self.gate + self.inner(hidden)


class TinyLM(nn.Module):
    """Embedding -> 3 Linear -> head; options tie, freeze, add unused parts, nest a block or reuse a layer."""

    def __init__(
        self, tied: bool = False, frozen: bool = False, unused: bool = False, nested: bool = False, reuse: bool = False
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 7)
        self.a = nn.Linear(7, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.c = nn.Linear(HIDDEN, 7)
        self.head = nn.Linear(7, VOCAB)
        if tied:
            self.head.weight = self.emb.weight
        if frozen:
            self.b.requires_grad_(False)
        self.extra = nn.Linear(5, 3) if unused else None
        self.block = Block(HIDDEN) if nested else None
        self.reuse = reuse  # apply `b` twice in one forward
        self.skip_b = False  # when True this rank's forward leaves out `b`

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = torch.tanh(self.a(self.emb(tokens)))
        if not self.skip_b:
            hidden = torch.tanh(self.b(hidden))
        if self.reuse:
            hidden = torch.tanh(self.b(hidden))
        if self.block is not None:
            hidden = torch.tanh(self.block(hidden))
        return self.head(self.c(hidden))


def batch(seed: int, size: int = 4, length: int = 5) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

"""A minimal byte-level GPT trained with ``lightning_zero.ZeroStrategy`` (nanoGPT-style example).

Install the package first (``pip install -e .`` from the repository root), then:

CPU, 2 processes (gloo), ZeRO-2::

    python examples/gpt.py fit --config examples/configs/zero2.yaml

One GPU node with 8 GPUs, ZeRO-3::

    python examples/gpt.py fit --config examples/configs/zero3.yaml \\
        --trainer.accelerator=gpu --trainer.devices=8

Mixed precision (bf16 parameters and gradients, fp32 master shards; on GPUs add the same two flags)::

    python examples/gpt.py fit --config examples/configs/mixed_precision.yaml

Several nodes with torchrun (the same command on every node; NODE0_ADDR: node 0's address, THIS_ADDR: this node's,
JOB_ID: any name shared by the nodes; Lightning's own launcher and SLURM: docs/launching.md)::

    torchrun --nnodes=2 --nproc-per-node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=$NODE0_ADDR:29400 --rdzv-id=$JOB_ID --local-addr=$THIS_ADDR \\
        examples/gpt.py fit --config examples/configs/zero3.yaml \\
        --trainer.accelerator=gpu --trainer.devices=8 --trainer.num_nodes=2

SLURM (one task per GPU; Lightning reads the SLURM environment)::

    srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 \\
        python examples/gpt.py fit --config examples/configs/zero3.yaml \\
        --trainer.accelerator=gpu --trainer.devices=8 --trainer.num_nodes=2

Muon for the hidden matrices and AdamW for the rest (two optimizers, manual optimization), with each tensor owned
whole by one rank (``ZeroStrategy(partition="parameter")``, docs/optimizers.md)::

    python examples/gpt.py fit --config examples/configs/muon.yaml

Any config value can be overridden on the command line, e.g. ``--model.n_layer=8 --trainer.max_steps=500``.
"""

import math
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

IGNORE = -100  # label of padded positions

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"


# ----------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    """Shape of a GPT model."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class GPTLinear(nn.Linear):
    """``nn.Linear`` with GPT-2's initialisation: weight ~ N(0, ``init_std``), bias 0.

    The initialisation lives in ``reset_parameters()`` so that a model created on the meta device (``configure_model``
    under ``ZeroStrategy(stage=3)``, which initialises each module with its ``reset_parameters()``) starts like one
    built directly.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init_std: float = 0.02) -> None:
        self.init_std = init_std
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class GPTEmbedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2's initialisation, N(0, 0.02), in ``reset_parameters()`` (see :class:`GPTLinear`)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = GPTLinear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        # GPT-2 scales the init of the projections into the residual stream by 1 / sqrt(2 * n_layer).
        self.c_proj = GPTLinear(cfg.n_embd, cfg.n_embd, bias=cfg.bias, init_std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            GPTLinear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            GPTLinear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias, init_std=0.02 / math.sqrt(2 * cfg.n_layer)),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``lm_head.weight`` is tied to the token embedding ``wte.weight``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = GPTEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = GPTEmbedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = GPTLinear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def num_params(self) -> int:
        """Number of unique parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)``."""
        seq_len = idx.size(1)
        assert seq_len <= self.config.block_size, f"sequence length {seq_len} > block_size {self.config.block_size}"
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def count_params(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)`` without building it."""
    d, b = cfg.n_embd, int(cfg.bias)
    ln = d * (1 + b)
    per_layer = 2 * ln + 12 * d * d + 9 * b * d  # two LayerNorms + attention (4 d^2) + MLP (8 d^2) with biases
    return cfg.n_layer * per_layer + (cfg.vocab_size + cfg.block_size) * d + ln  # + wte, wpe, ln_f (lm_head tied)


def gpt_config_for_params(target_params: int, vocab_size: int = 256, block_size: int = 256) -> GPTConfig:
    """Pick a GPT shape (head dim 64, width/depth ratio near 64) with about ``target_params`` parameters.

    E.g. ``gpt_config_for_params(25_000_000)`` gives ``n_layer=8, n_head=8, n_embd=512`` (25.4M).
    """
    best: tuple[float, GPTConfig] | None = None
    for n_embd in range(64, 8193, 64):
        cfg = GPTConfig(vocab_size, block_size, n_layer=0, n_head=n_embd // 64, n_embd=n_embd)
        base, per_layer = count_params(cfg), count_params(replace(cfg, n_layer=1)) - count_params(cfg)
        cfg.n_layer = max(1, round((target_params - base) / per_layer))
        score = abs(math.log(count_params(cfg) / target_params)) + 0.1 * abs(math.log(n_embd / cfg.n_layer / 64))
        if best is None or score < best[0]:
            best = (score, cfg)
    assert best is not None
    return best[1]


# ----------------------------------------------------------------------------- lightning module


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class GPTLightningModule(LightningModule):
    """Next-byte language modelling with :class:`GPT`; the model is built in ``configure_model``."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 64,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        variable_length: bool = False,
        optimizer: str = "adamw",
        muon_lr: float = 0.02,
    ) -> None:
        """``variable_length``: each training sequence keeps a random number of real tokens (the rest padded,
        labelled -100), and the loss is the global mean over tokens: needs ``ZeroStrategy(weighted_loss=True)``
        (examples/configs/variable_length.yaml). ``optimizer="muon"``: ``torch.optim.Muon`` (at ``muon_lr``) for
        the blocks' matrices, AdamW for embeddings, biases and norms; needs ``ZeroStrategy(partition="parameter")``
        (examples/configs/muon.yaml)."""
        super().__init__()
        if optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer={optimizer!r}: choose 'adamw' or 'muon'.")
        self.save_hyperparameters()
        self.automatic_optimization = optimizer == "adamw"  # two optimizers step in training_step
        self.config = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        self.model: GPT | None = None
        self.train_ppl = Perplexity(ignore_index=IGNORE)
        self.val_ppl = Perplexity(ignore_index=IGNORE)

    def configure_model(self) -> None:
        """Build the GPT once, inside the strategy's init context (Lightning may call this more than once)."""
        if self.model is None:
            self.model = GPT(self.config)

    def forward(self, idx: Tensor) -> Tensor:
        assert self.model is not None, "call configure_model() first"
        return self.model(idx)

    def _shared_step(self, batch: tuple[Tensor, Tensor], ppl: Perplexity) -> Tensor:
        x, y = batch
        logits = self(x)
        ppl(logits.detach().float(), y)  # accumulates, and caches this batch's value for step-level logging
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | dict[str, Tensor]:
        if self.hparams.get("variable_length"):
            return self._variable_length_step(batch)
        if not self.automatic_optimization:
            return self._two_optimizer_step(batch)
        loss = self._shared_step(batch, self.train_ppl)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl)
        return loss

    def _variable_length_step(self, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        """Padded sequences of random real lengths: the summed loss and its token count, for the strategy to divide
        by the count over every rank and micro-batch (docs/weighted_loss.md)."""
        x, y = batch
        generator = torch.Generator().manual_seed(int(x[:, 0].sum()))  # a length per sequence, from its data
        lengths = torch.randint(1, y.size(1) + 1, (y.size(0),), generator=generator).to(y.device)
        y = y.masked_fill(torch.arange(y.size(1), device=y.device) >= lengths[:, None], IGNORE)
        logits = self(x)
        self.train_ppl(logits.detach().float(), y)
        loss_sum = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE, reduction="sum")
        tokens = (y != IGNORE).sum()
        self.log("train_ppl", self.train_ppl)
        return {"loss": loss_sum, "loss_weight": tokens}

    def _two_optimizer_step(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Muon and AdamW on one backward (Lightning's manual optimization: it steps neither by itself)."""
        optimizers = self.optimizers()
        loss = self._shared_step(batch, self.train_ppl)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            optimizer.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", self.train_ppl)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        mean = getattr(self.trainer.strategy, "global_mean_loss", None)
        if self.hparams.get("variable_length") and mean is not None:
            self.log("train_loss", mean, prog_bar=True)  # the last step's mean over every rank's tokens

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._shared_step(batch, self.val_ppl)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_ppl", self.val_ppl)

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW with weight decay on matrices only (nanoGPT-style), plus warmup + cosine LR per step."""
        assert self.model is not None, "call configure_model() first"
        params = dict(self.model.named_parameters())  # de-duplicated: the tied lm_head weight appears once
        decay = [p for p in params.values() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in params.values() if p.requires_grad and p.dim() < 2]
        hp = self.hparams
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1000
        total = int(total) if math.isfinite(total) else 1000
        lr_lambda = partial(warmup_cosine, warmup=max(1, hp.warmup_steps), total=total)
        if hp.get("optimizer", "adamw") == "muon":
            return self._muon_and_adamw(params, lr_lambda)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _muon_and_adamw(self, params: dict[str, nn.Parameter], lr_lambda: Any) -> Any:
        """Muon orthogonalises the update of each hidden matrix (whole: each rank owns whole tensors), AdamW the
        embeddings (the tied output head among them), biases and norms, as Muon's authors recommend."""
        hp = self.hparams
        hidden = [p for n, p in params.items() if p.requires_grad and p.dim() == 2 and ".blocks." in f".{n}"]
        hidden_ids = {id(p) for p in hidden}
        rest = [p for p in params.values() if p.requires_grad and id(p) not in hidden_ids]
        muon = torch.optim.Muon(hidden, lr=hp.muon_lr, weight_decay=hp.weight_decay, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(rest, lr=hp.lr, betas=tuple(hp.betas), weight_decay=0.0)
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda) for o in (muon, adamw)]
        return [muon, adamw], [{"scheduler": s, "interval": "step"} for s in schedulers]


# ----------------------------------------------------------------------------- data


class ByteWindows(Dataset):
    """``(x, y)`` windows of ``block_size`` bytes every ``stride`` bytes; ``y`` is ``x`` shifted by one."""

    def __init__(self, data: Tensor, block_size: int, stride: int = 1) -> None:
        if data.numel() <= block_size:
            raise ValueError(f"need more than block_size={block_size} bytes, got {data.numel()}")
        self.data, self.block_size, self.stride = data, block_size, stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class ByteDataModule(LightningDataModule):
    """Byte-level (vocab 256) text; the last ``val_fraction`` of the file is the validation split.

    Training uses every offset (stride 1, shuffled); validation uses non-overlapping windows in order.
    """

    def __init__(
        self,
        data_path: str | None = None,
        block_size: int = 64,
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.1,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.data_path = Path(data_path) if data_path else DEFAULT_DATA
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(self.data_path.read_bytes()), dtype=torch.uint8)
        n_val = max(self.hparams.block_size + 1, int(len(data) * self.hparams.val_fraction))
        self.train_set = ByteWindows(data[:-n_val], self.hparams.block_size)
        self.val_set = ByteWindows(data[-n_val:], self.hparams.block_size, stride=self.hparams.block_size)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        hp = self.hparams
        generator = torch.Generator().manual_seed(hp.seed)
        return DataLoader(
            dataset, hp.batch_size, shuffle=shuffle, drop_last=shuffle, num_workers=hp.num_workers, generator=generator
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, shuffle=False)


def main(args: list[str] | None = None) -> None:
    """Command-line entry point: ``python examples/gpt.py {fit,validate} --config ...``."""
    LightningCLI(GPTLightningModule, ByteDataModule, save_config_kwargs={"overwrite": True}, args=args)
    if torch.distributed.is_initialized():  # let the process group's threads end before the interpreter does
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

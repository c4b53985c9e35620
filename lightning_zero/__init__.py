"""lightning-zero: ZeRO stages 1-3 for PyTorch Lightning, in pure PyTorch."""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero.checkpoint import consolidate, convert
from lightning_zero.core.memory import MemoryReport, StepPeak
from lightning_zero.estimate import MemoryEstimate, estimate_memory
from lightning_zero.fabric_precision import ZeroFabricPrecision
from lightning_zero.fabric_strategy import ZeroFabricStrategy
from lightning_zero.gradients import grad_norm
from lightning_zero.loading import load_from_checkpoint
from lightning_zero.monitor import ZeroMonitor
from lightning_zero.precision import ZeroPrecision
from lightning_zero.strategy import ZeroStrategy
from lightning_zero.version import __version__

__all__ = [
    "MemoryEstimate",
    "MemoryReport",
    "StepPeak",
    "ZeroFabricPrecision",
    "ZeroFabricStrategy",
    "ZeroMonitor",
    "ZeroPrecision",
    "ZeroStrategy",
    "__version__",
    "consolidate",
    "convert",
    "estimate_memory",
    "grad_norm",
    "load_from_checkpoint",
]

ZeroStrategy.register_strategies(StrategyRegistry)
ZeroFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

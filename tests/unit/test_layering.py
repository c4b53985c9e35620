"""The layering rules of docs/design.md, each held by a test that fails when the rule is broken.

1. ``lightning_zero.core`` imports neither Lightning, nor ``lightning_zero.checkpoint``, nor the Lightning-side
   options (``lightning_zero.config``: ``state_dict_type``, ``timeout``, ...): loaded alone, no such module loads.
2. The checkpoint package and the estimator import no Lightning either.
3. ``lightning_zero.checkpoint`` reads an engine only through its named-state API: none of its modules names the
   engine's internals (buffers, stores, buckets, steps, units).
4. Only ``core/comm.py`` and ``core/groups.py`` call ``torch.distributed``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_zero

PACKAGE_DIR = Path(lightning_zero.__file__).parent
CORE_MODULES = sorted(p.stem for p in (PACKAGE_DIR / "core").glob("*.py") if p.stem != "__init__")

# The package's __init__ imports the Lightning glue on purpose (it registers the strategies), so each check loads
# modules under an empty parent package: only their own imports run.
CHECK = """
import sys, types
package = types.ModuleType("lightning_zero")
package.__path__ = [{package!r}]
sys.modules["lightning_zero"] = package
for name in {modules!r}:
    __import__(name)
forbidden = {forbidden!r}
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(loaded)
sys.exit(1 if loaded else 0)
"""


def _loaded(modules: list[str], forbidden: list[str]) -> subprocess.CompletedProcess:
    code = CHECK.format(package=str(PACKAGE_DIR), modules=modules, forbidden=forbidden)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_core_imports_neither_lightning_nor_checkpoint_nor_glue_options() -> None:
    modules = [f"lightning_zero.core.{name}" for name in CORE_MODULES]
    forbidden = ["lightning", "pytorch_lightning", "lightning_zero.checkpoint", "lightning_zero.config"]
    result = _loaded(modules, forbidden)
    assert result.returncode == 0, f"the core loaded {result.stdout}{result.stderr}"


def test_the_layering_check_can_fail() -> None:
    """The check itself sees a forbidden import (here: the glue's config imports the core, which is allowed, and the
    config module is what the core must never load)."""
    result = _loaded(["lightning_zero.config"], ["lightning_zero.config"])
    assert result.returncode == 1, result.stdout + result.stderr


def test_checkpoint_and_estimate_do_not_import_lightning() -> None:
    result = _loaded(["lightning_zero.checkpoint", "lightning_zero.estimate"], ["lightning", "pytorch_lightning"])
    assert result.returncode == 0, f"lightning modules loaded: {result.stdout}{result.stderr}"


ENGINE_INTERNALS = {"buffers", "stores", "buckets", "steps", "units", "scheduler", "reducer", "piece_params"}


@pytest.mark.parametrize("path", sorted((PACKAGE_DIR / "checkpoint").glob("*.py")), ids=lambda p: p.name)
def test_checkpoint_reads_engines_only_through_named_state(path: Path) -> None:
    tree = ast.parse(path.read_text())
    touched = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ENGINE_INTERNALS})
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("core.engine")]
    assert not touched, f"{path.name} reads engine internals {touched}; use ZeroEngine.named_state()"
    assert not imports, f"{path.name} imports core.engine; the checkpoint code takes a NamedState"


CORE_WITHOUT_COLLECTIVES = [PACKAGE_DIR / "core" / f"{n}.py" for n in CORE_MODULES if n not in ("comm", "groups")]


@pytest.mark.parametrize("path", CORE_WITHOUT_COLLECTIVES, ids=lambda p: p.name)
def test_only_comm_and_groups_call_torch_distributed_in_core(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names]
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "torch.distributed" not in names, path.name
    assert "torch.distributed" not in modules, path.name

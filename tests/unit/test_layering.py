"""The layering rules of docs/design.md, each held by a test that fails when the rule is broken.

1. The import-linter contracts in pyproject.toml (``[tool.importlinter]``) hold: the glue over the checkpoint code
   over the core; inside the core, the engine over the stages over the stores over the layouts over ``comm``; the core
   imports neither Lightning, nor ``lightning_zero.checkpoint``, nor the Lightning-side options; no import cycle.
   ``lint-imports`` counts imports inside functions and under ``TYPE_CHECKING`` too, so a cycle cannot hide there.
2. ``lightning_zero.checkpoint`` reads an engine only through its named-state API: none of its modules names the
   engine's internals (buffers, stores, buckets, steps, units).
3. Only ``core/comm/`` calls ``torch.distributed``.
4. ``ZeroFabricStrategy`` and what it shares with ``ZeroStrategy`` (``session.py``, ``collectives.py``,
   ``precision_settings.py``, ``process_exit.py``) import no ``lightning.pytorch``: import-linter forbids external
   packages only whole, and these may use Lightning Fabric.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_zero

PACKAGE_DIR = Path(lightning_zero.__file__).parent
PYPROJECT = PACKAGE_DIR.parent / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the package found in ``package_parent``, with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    command = [str(LINT_IMPORTS), "--no-cache", str(PYPROJECT)]
    return subprocess.run(command, cwd=package_parent, env=env, capture_output=True, text=True, check=False)


def test_the_import_contracts_hold() -> None:
    result = _lint_imports(PACKAGE_DIR.parent)
    assert result.returncode == 0, result.stdout + result.stderr


PLANTED = {
    # a layout reaching up into the engine (also a cycle)
    "upward": (
        "core/layout/pieces.py",
        "import lightning_zero.core.engine",
        "lightning_zero.core.layout is not allowed to import lightning_zero.core.engine",
    ),
    # the core reading the Lightning-side options
    "glue options": (
        "core/options.py",
        "import lightning_zero.config",
        "lightning_zero.core is not allowed to import lightning_zero.config",
    ),
    # a cycle hidden in a function between two stores
    "hidden cycle": (
        "core/store/stores.py",
        "def _f():\n    import lightning_zero.core.store.host",
        "It could be made acyclic by removing",
    ),
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_import_breaks_a_contract(tmp_path: Path, plant: str) -> None:
    """The contracts can fail: the same check over a copy of the package with one import planted."""
    path, line, expected = PLANTED[plant]
    copy = tmp_path / "lightning_zero"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / path
    target.write_text(target.read_text() + "\n\n" + line + "\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0, f"planting {line!r} in {path} broke no contract:\n{result.stdout}"
    assert expected in " ".join(result.stdout.split()), result.stdout


ENGINE_INTERNALS = {"buffers", "stores", "buckets", "steps", "units", "scheduler", "reducer", "piece_params"}


@pytest.mark.parametrize("path", sorted((PACKAGE_DIR / "checkpoint").glob("*.py")), ids=lambda p: p.name)
def test_checkpoint_reads_engines_only_through_named_state(path: Path) -> None:
    tree = ast.parse(path.read_text())
    touched = sorted({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ENGINE_INTERNALS})
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("core.engine")]
    assert not touched, f"{path.name} reads engine internals {touched}; use ZeroEngine.named_state()"
    assert not imports, f"{path.name} imports core.engine; the checkpoint code takes a NamedState"


CORE_WITHOUT_COLLECTIVES = sorted(
    p for p in (PACKAGE_DIR / "core").rglob("*.py") if (PACKAGE_DIR / "core" / "comm") not in p.parents
)


@pytest.mark.parametrize("path", CORE_WITHOUT_COLLECTIVES, ids=lambda p: str(p.relative_to(PACKAGE_DIR / "core")))
def test_only_comm_calls_torch_distributed_in_core(path: Path) -> None:
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names]
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "torch.distributed" not in names, path.name
    assert "torch.distributed" not in modules, path.name


FABRIC_SHARED = [
    PACKAGE_DIR / name
    for name in (
        "session.py",
        "collectives.py",
        "precision_settings.py",
        "process_exit.py",
        "fabric_strategy.py",
        "fabric_precision.py",
        "front_door.py",
        "fabric_checkpoints.py",
    )
]


def lightning_trainer_imports(source: str) -> list[str]:
    """The modules of ``lightning.pytorch`` (or ``pytorch_lightning``) that ``source`` imports."""
    tree = ast.parse(source)
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
    return sorted(m for m in modules if m.split(".")[0] == "pytorch_lightning" or m.startswith("lightning.pytorch"))


@pytest.mark.parametrize("path", FABRIC_SHARED, ids=lambda p: p.name)
def test_what_a_fabric_strategy_shares_imports_no_lightning_trainer(path: Path) -> None:
    imported = lightning_trainer_imports(path.read_text())
    assert not imported, f"{path.name} imports {imported}; it sits below ZeroStrategy, shared with a Fabric strategy"


def test_a_planted_lightning_trainer_import_is_found() -> None:
    planted = "def _f():\n    from lightning.pytorch.core.optimizer import _MockOptimizer\nimport pytorch_lightning\n"
    assert lightning_trainer_imports(planted) == ["lightning.pytorch.core.optimizer", "pytorch_lightning"]

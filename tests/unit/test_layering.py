"""The sharding core, the checkpoint package and the estimator never import Lightning (docs/design.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning_zero

PACKAGE_DIR = str(Path(lightning_zero.__file__).parent)

# The package's __init__ imports the Lightning glue on purpose (it registers the strategies), so the
# check loads the core modules under an empty parent package: only their own imports run.
CHECK = f"""
import sys, types
package = types.ModuleType("lightning_zero")
package.__path__ = [{PACKAGE_DIR!r}]
sys.modules["lightning_zero"] = package
import lightning_zero.core.engine, lightning_zero.core.layout, lightning_zero.core.comm, lightning_zero.config
import lightning_zero.core.shard_state, lightning_zero.checkpoint, lightning_zero.estimate
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
print(loaded)
sys.exit(1 if loaded else 0)
"""


def test_core_does_not_import_lightning() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"lightning modules loaded by the core: {result.stdout}{result.stderr}"

"""The documentation site builds with MkDocs in strict mode (any warning, e.g. a broken link, fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_docs_build_strict(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()

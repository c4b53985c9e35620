"""The current core against an earlier commit's, in the same interleaved run of ``bench_zero.py``.

Step times of separate runs on a shared machine drift by more than a change costs; in one run every system
meets the same conditions. This script exports ``lightning_zero/`` of an earlier commit into a temporary
directory under the package name ``lightning_zero_base`` and runs ``bench_zero.py`` with the systems
``base1``-``base3`` (that core) next to ``zero1``-``zero3`` (this one)::

    python benchmarks/ab_core.py 4fc24c8 -- --steps 16 --rss-variants '' --systems \\
        ddp,zero1,base1,zero2,base2,zero3,base3,ddp_bf16,zero1_bf16,base1_bf16,zero2_bf16,base2_bf16,zero3_bf16,base3_bf16

Everything after ``--`` goes to ``bench_zero.py``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_zero_base"


def export(ref: str, directory: Path) -> None:
    """``lightning_zero/`` at ``ref``, renamed to ``PACKAGE`` (imports included), under ``directory``."""
    archive = subprocess.run(["git", "archive", ref, "lightning_zero"], cwd=REPO, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(directory, filter="data")
    (directory / "lightning_zero").rename(directory / PACKAGE)
    for path in (directory / PACKAGE).rglob("*.py"):
        path.write_text(re.sub(r"\blightning_zero\b", PACKAGE, path.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref", help="the earlier commit (any git revision)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for bench_zero.py, after --")
    args = parser.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    with tempfile.TemporaryDirectory() as directory:
        export(args.ref, Path(directory))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([directory, os.environ.get("PYTHONPATH", "")])}
        env["BENCH_BASELINE_PACKAGE"] = PACKAGE
        command = [sys.executable, str(REPO / "benchmarks" / "bench_zero.py"), *bench_args]
        sys.exit(subprocess.run(command, env=env, check=False).returncode)


if __name__ == "__main__":
    main()

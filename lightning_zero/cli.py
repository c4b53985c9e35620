"""The ``lightning-zero`` command: argument parsing, then a call into the library."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from lightning_zero import __version__

    parser = argparse.ArgumentParser(prog="lightning-zero", description="ZeRO for PyTorch Lightning.")
    parser.add_argument("--version", action="version", version=f"lightning-zero {__version__}")
    parser.add_subparsers(dest="command", title="commands")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
    return 0

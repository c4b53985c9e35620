"""The package version (one place, read by the CLI, checkpoints and the package)."""

__version__ = "0.1.0"

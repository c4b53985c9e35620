"""docs/precision.md lists exactly the options ZeroPrecision accepts, with their defaults."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lightning_zero import ZeroPrecision

DOC = Path(__file__).resolve().parents[2] / "docs" / "precision.md"


def _documented() -> dict[str, str]:
    section = DOC.read_text().split("## `ZeroPrecision` options", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| `?([^|`]+?)`? \|", section, flags=re.MULTILINE))


def test_every_option_is_documented_with_its_default() -> None:
    parameters = {n: p for n, p in inspect.signature(ZeroPrecision.__init__).parameters.items() if n != "self"}
    documented = _documented()
    assert list(documented) == list(parameters)
    for name, parameter in parameters.items():
        assert documented[name] == repr(parameter.default).replace("'", '"'), name

"""docs/configuration.md lists exactly the options ZeroStrategy accepts, with their defaults."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lightning_zero import ZeroStrategy

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _documented() -> dict[str, str]:
    rows = re.findall(r"^\| `(\w+)` \| `?([^|`]+?)`? \|", DOC.read_text(), flags=re.MULTILINE)
    return dict(rows)


def test_every_option_is_documented_and_nothing_else() -> None:
    accepted = [name for name in inspect.signature(ZeroStrategy.__init__).parameters if name != "self"]
    assert list(_documented()) == accepted


def test_documented_defaults_match_the_code() -> None:
    documented = _documented()
    for name, parameter in inspect.signature(ZeroStrategy.__init__).parameters.items():
        if name == "self":
            continue
        expected = repr(parameter.default).replace("datetime.", "").replace("'", '"')
        assert documented[name] == expected, name

"""Docstrings that list the package's parts stay in step with the code: the formats in the
order they are asked, the modules of `lazyload.tp`."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_format_protocol_lists_every_built_in_format_in_order():
    from lazyload.formats import formats, protocol

    listed = protocol.__doc__.split("The built-ins, in order:")[1].split("A local glob")[0]
    names = [name for name in re.findall(r"`(\w+)`", listed) if name in {f.name for f in formats()}]
    assert names == [f.name for f in formats()], names


def test_the_tp_package_names_each_of_its_modules():
    import lazyload.tp

    modules = {p.stem for p in (ROOT / "lazyload" / "tp").glob("*.py")} - {"__init__"}
    named = set(re.findall(r"`(\w+)`", lazyload.tp.__doc__))
    assert modules <= named, sorted(modules - named)

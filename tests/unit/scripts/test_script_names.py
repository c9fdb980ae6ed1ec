"""A script run as ``python scripts/bench/NAME.py`` has its own folder first on ``sys.path``: a script
named like an installed module (``multiprocess``, which ``datasets`` imports) would shadow it for every
import in that process."""

from __future__ import annotations

import pkgutil
import sys

from support import ROOT


def test_no_script_is_named_like_an_installed_or_standard_module():
    taken = {m.name for m in pkgutil.iter_modules()} | set(sys.stdlib_module_names)
    scripts = [p for p in (ROOT / "scripts").glob("*/*.py") if p.stem != "__init__"]
    assert scripts
    clashes = sorted(str(p.relative_to(ROOT)) for p in scripts if p.stem in taken)
    assert not clashes, f"rename these scripts: {clashes}"

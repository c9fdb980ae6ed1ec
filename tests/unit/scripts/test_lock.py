"""The environment the suite runs in holds exactly the versions of constraints.txt when
scripts/bootstrap.sh installed it locked (its install stamp says so): a fresh clone tests what the lock
names, not whatever a package index serves that day."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

import pytest
from support import ROOT

NOT_LOCKED = {"pip", "setuptools", "wheel", "distribute", "bert-mp"}
"""What ``pip freeze`` leaves out, and bert_mp itself (installed from the clone)."""


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canon(name)] = version
    return pins


def installed() -> dict[str, str]:
    """Every distribution installed in the running environment's site-packages (what ``pip freeze``
    lists; not what a library vendors on ``sys.path``), versions without a local tag (``+cpu``)."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = {
        canon(d.metadata["Name"]): d.version.split("+")[0]
        for d in importlib.metadata.distributions(path=paths)
    }
    return {n: v for n, v in found.items() if n not in NOT_LOCKED}


def differences(lock: dict[str, str], have: dict[str, str], skip: set[str] = frozenset()) -> list[str]:
    """One line per package whose installed version is not the lock's, or that only one side has."""
    out = []
    for name in sorted((lock.keys() | have.keys()) - skip):
        if lock.get(name) != have.get(name):
            out.append(f"{name}: lock {lock.get(name) or '-'}, installed {have.get(name) or '-'}")
    return out


def test_the_locked_install_holds_exactly_the_lock():
    stamp = Path(sys.prefix) / ".bert_mp_installed"
    if not stamp.is_file():
        pytest.skip("not running in the .venv scripts/bootstrap.sh made (no install stamp)")
    mode, _, torch = stamp.read_text().strip().partition(" torch=")
    if mode != "locked":
        pytest.skip(
            f"installed {mode or 'without a record of the lock'} (BERT_MP_UNLOCKED=1): newest releases"
        )
    skip = {"torch"} if torch else set()  # BERT_MP_TORCH chose another torch
    assert not differences(read_lock(ROOT / "constraints.txt"), installed(), skip)


def test_a_version_off_the_lock_or_a_package_outside_it_is_named():
    lock = {"torch": "2.13.0", "numpy": "2.1.0"}
    assert differences(lock, {"torch": "2.13.0", "numpy": "2.1.0"}) == []
    assert differences(lock, {"torch": "2.13.0", "numpy": "2.2.0", "extra": "1.0"}) == [
        "extra: lock -, installed 1.0",
        "numpy: lock 2.1.0, installed 2.2.0",
    ]
    assert differences(lock, {"numpy": "2.1.0", "torch": "2.12.0"}, skip={"torch"}) == []


def test_the_lock_pins_every_line_exactly():
    text = (ROOT / "constraints.txt").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][0-9A-Za-z.]*", ln) for ln in lines), lines
    assert "bert-mp" not in {canon(ln.partition("==")[0]) for ln in lines}  # the clone itself is not locked

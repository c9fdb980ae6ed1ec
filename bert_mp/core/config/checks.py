"""The checks every section's ``validate()`` uses: each failure is a :class:`ConfigError` naming the key."""

from __future__ import annotations

from typing import Any

from bert_mp.errors import ConfigError


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg} (got {value!r})")


def _choice(value: Any, key: str, choices: tuple) -> None:
    _check(value in choices, key, f"must be one of {', '.join(map(str, choices))}", value)


def _range(value: Any, key: str, lo: float | None = None, hi: float | None = None) -> None:
    if lo is not None and hi is not None:
        _check(lo <= value <= hi, key, f"must be between {lo} and {hi}", value)
    elif lo is not None:
        _check(value >= lo, key, f"must be >= {lo}", value)
    elif hi is not None:
        _check(value <= hi, key, f"must be <= {hi}", value)


def _check_tracker(name: str, key: str) -> None:
    """An experiment tracker Accelerate knows, and whose package is installed."""
    import importlib

    from accelerate.utils import LoggerType

    known = [t.value for t in LoggerType if t.value != "all"]
    _check(name in known, key, f"unknown tracker; choose from {', '.join(known)}", name)
    available = getattr(importlib.import_module("accelerate.utils"), f"is_{name}_available", None)
    if available is not None and not available():
        raise ConfigError(
            f"{key}: tracker {name!r} is not installed; pip install {name.replace('_', '-')}, or drop it"
        )

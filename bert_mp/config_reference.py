"""``bert-mp config [SECTION|KEY]``: every config key with its type, default and docstring.

The descriptions are the field docstrings of the config dataclasses (the string literal under each
field), read from the source with ``ast``, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from typing import Any

from bert_mp.errors import ConfigError


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> docstring for a dataclass and its bases (a base's text is overridden by a subclass)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):  # an annotation get_type_hints could not resolve
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return " | ".join(_type_name(a) for a in inner) + (" | None" if len(inner) < len(args) else "")
    if args:
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def config_rows(root: Any = None) -> list[tuple[str, str, Any, str]]:
    """``(key, type, default, description)`` for every leaf of the config tree, in definition order."""
    from bert_mp.core.config import Config

    rows: list[tuple[str, str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in fields(cls):
            tp = hints.get(f.name, f.type)
            if is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
            else:
                rows.append((f"{prefix}{f.name}", _type_name(tp), _default(f), docs.get(f.name, "")))

    walk(root or Config, "")
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def describe_config(selector: str | None = None, width: int = 100) -> str:
    """The reference for the whole tree, one section (``train``) or the keys under a prefix (``train.fp16``)."""
    rows = config_rows()
    if selector:
        sel = selector.rstrip(".")
        rows = [r for r in rows if r[0].startswith(sel)]
        if not rows:
            sections = sorted({r[0].split(".")[0] for r in config_rows()})
            raise ConfigError(f"no config key matches {selector!r}; sections: {', '.join(sections)}")
    out: list[str] = []
    section = None
    for key, tp, default, doc in rows:
        head = key.split(".")[0]
        if head != section:
            section = head
            out.append(f"{'' if not out else chr(10)}[{section}]")
        out.append(f"  {key}: {tp} = {_fmt(default)}")
        for line in textwrap.wrap(doc or "(no description)", width - 6):
            out.append(f"      {line}")
    return "\n".join(out)


def command(selector: str | None = None) -> int:
    print(describe_config(selector))
    return 0

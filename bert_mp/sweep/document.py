"""The report's document model - sections of text, tables and images - rendered to markdown and
to a self-contained HTML page (plots embedded as base64 PNG) from the same content; the number
formats its cells use."""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_mp.sweep.record import RunEntry


def fmt(x: Any, spec: str = ".4g", none: str = "-") -> str:
    if x is None:
        return none
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def pct(x: Any) -> str:
    return fmt(x * 100 if isinstance(x, (int, float)) else None, ".3g") + ("%" if x is not None else "")


def cost(entry: RunEntry | None) -> str:
    if entry is None or entry.wall_s is None:
        return "-"
    return f"{entry.wall_s:.0f} / {fmt(entry.cpu_s, '.0f')}"


def mib(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x / 2**20:.1f} MiB"


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    caption: str
    path: Path


Block = str | Table | Image


def to_markdown(sections: list[tuple[str, list[Block]]], root: Path, title: str) -> str:
    out = [f"# {title}", ""]
    for heading, blocks in sections:
        out += [f"## {heading}", ""]
        for b in blocks:
            if isinstance(b, Table):
                out.append("| " + " | ".join(b.headers) + " |")
                out.append("| " + " | ".join("---" for _ in b.headers) + " |")
                out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in b.rows]
            elif isinstance(b, Image):
                out.append(f"![{b.caption}]({b.path.relative_to(root).as_posix()})")
            elif b:
                out.append(b)
            else:
                continue
            out.append("")
    return "\n".join(out)


def to_html(sections: list[tuple[str, list[Block]]], title: str) -> str:
    e = html.escape
    body = [f"<h1>{e(title)}</h1>"]
    for heading, blocks in sections:
        body.append(f"<h2>{e(heading)}</h2>")
        for b in blocks:
            if isinstance(b, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in b.headers)
                rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in b.rows)
                body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
            elif isinstance(b, Image):
                data = base64.b64encode(b.path.read_bytes()).decode("ascii")
                body.append(
                    f'<figure><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                    f"<figcaption>{e(b.caption)}</figcaption></figure>"
                )
            elif b:
                body.append(f"<p>{e(b).replace('`', '').replace('**', '')}</p>")
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}"
        "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}"
        "th{background:#f3f3f3}img{max-width:100%}figure{margin:1em 0}"
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )

"""Reading documents from the configured source: builtin, text, jsonl, csv, parquet or the Hub.

Every reader is a generator of document strings, so a corpus of many GB never sits in a Python
list; ``prepare`` streams it into an Arrow-backed ``Dataset``. What was read, dropped and
repaired is counted in :class:`ReadStats` (reported in ``stats.json``). Problems a user can fix
(missing file, wrong column, undecodable bytes in strict mode) raise :class:`DataError` with the
file and line.
"""

from __future__ import annotations

import codecs
import csv
import glob
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

from bert_mp.core.config import DataConfig
from bert_mp.data.whitespace import BLANK_LINES_RE
from bert_mp.errors import DataError

MAX_DOCUMENT_CHARS = 16 * 1024 * 1024
"""A text-file document without blank lines is cut here, so memory stays bounded."""

_READ_CHUNK = 4 * 1024 * 1024
_ERROR_HANDLER = "bert_mp_count_replace"
_replaced = [0]


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _replaced[0] += 1
    return "\ufffd", err.end


codecs.register_error(_ERROR_HANDLER, _count_and_replace)


@dataclass
class ReadStats:
    """What reading the corpus did; written to ``stats.json`` under ``documents``."""

    files: int = 0
    documents_read: int = 0
    dropped_empty: int = 0
    """Documents with no text after stripping whitespace."""
    split_oversize: int = 0
    """Text-file documents longer than MAX_DOCUMENT_CHARS without a blank line, cut into parts."""
    invalid_utf8_replaced: int = 0
    """Undecodable byte sequences replaced with U+FFFD (encoding_errors=replace)."""
    records_without_text: int = 0
    """jsonl/csv/parquet/hub records whose text field is missing, null or not a string."""
    invalid_json_lines: int = 0
    first_problem: str | None = None
    """Where the first skipped record was (file:line), to help fix the input."""
    files_empty: list[str] = field(default_factory=list)
    duplicate_paths: int = 0
    """Files reached more than once (a symlink, overlapping globs): read once, counted here."""
    first_duplicate_path: str | None = None
    binary_files: int = 0
    """Files that look binary (NUL bytes, or mostly non-text, in the first KB): skipped, not read."""
    first_binary_file: str | None = None
    duplicate_documents: int = 0
    """Exact duplicate documents removed (``data.dedupe``)."""

    @property
    def documents_kept(self) -> int:
        return self.documents_read - self.dropped_empty - self.duplicate_documents

    def note(self, where: str) -> None:
        if self.first_problem is None:
            self.first_problem = where


LOCAL_SOURCES = ("text", "jsonl", "csv", "parquet")
"""``data.source`` values read from ``data.paths``."""


def resolve_paths(patterns: list[str], stats: ReadStats | None = None) -> list[Path]:
    """Files matching the paths/globs, sorted and de-duplicated by real path (a file reached twice,
    say through a symlink, is listed once and counted in ``stats``); a pattern matching nothing is
    an error."""
    out: list[Path] = []
    seen = set()
    for pattern in patterns:
        expanded = str(Path(pattern).expanduser())
        if glob.has_magic(expanded):
            matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"data.paths: no file matches {pattern!r}")
        else:
            p = Path(expanded)
            if p.is_dir():
                matches = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith("."))
                if not matches:
                    raise DataError(f"data.paths: folder {pattern!r} has no files")
            elif p.is_file():
                matches = [p]
            else:
                raise DataError(f"data.paths: file not found: {pattern}")
        for m in matches:
            key = m.resolve()
            if key not in seen:
                seen.add(key)
                out.append(m)
            elif stats is not None:
                stats.duplicate_paths += 1
                if stats.first_duplicate_path is None:
                    stats.first_duplicate_path = f"{m} (same file as {key})"
    return out


BINARY_PROBE_BYTES = 1024
_TEXT_CONTROLS = frozenset(b"\t\n\r\f\v\x1b\x08")


def looks_binary(head: bytes) -> bool:
    """Whether the first bytes of a file say it is not text: a NUL byte, or more than 30% of the
    characters undecodable as UTF-8 or control characters other than whitespace.

    A text file in another encoding (Latin-1, say) passes: its few undecodable bytes are replaced
    and counted; random bytes, images, archives and UTF-16 text (full of NULs) do not.
    """
    head = head[:BINARY_PROBE_BYTES]
    if not head:
        return False
    if b"\x00" in head:
        return True
    # a multi-byte character cut at the probe's end is not an error
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head, final=False)
    if not text:
        return False
    bad = text.count("\ufffd") + sum(
        1 for c in text if (ord(c) < 32 or ord(c) == 127) and ord(c) not in _TEXT_CONTROLS
    )
    return bad > 0.3 * len(text)


def _skip_binary(path: Path, stats: ReadStats) -> bool:
    """True (and counted) when ``path`` looks binary."""
    with open(path, "rb") as f:
        head = f.read(BINARY_PROBE_BYTES)
    if not looks_binary(head):
        return False
    stats.binary_files += 1
    if stats.first_binary_file is None:
        stats.first_binary_file = str(path)
    return True


def _decoder(cfg: DataConfig):
    errors = _ERROR_HANDLER if cfg.encoding_errors == "replace" else "strict"
    return codecs.getincrementaldecoder("utf-8")(errors=errors)


def _decode_error(path: Path, e: UnicodeDecodeError, where: str = "") -> DataError:
    return DataError(
        f"{path}{where}: invalid UTF-8 ({e.reason} at byte {e.start}); "
        "fix the file or set data.encoding_errors=replace"
    )


def _read_text_file(path: Path, cfg: DataConfig, stats: ReadStats) -> Iterator[str]:
    """Documents of a text file (``cfg.documents``): the text between blank lines (``blank_line``,
    ``line``; a blank line as :mod:`bert_mp.data.whitespace` defines it) or the whole file
    (``file``); CRLF and CR become LF. A document longer than MAX_DOCUMENT_CHARS is cut at a line
    break, so memory stays bounded."""
    whole = cfg.documents == "file"
    decoder = _decoder(cfg)
    carry = ""
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(_READ_CHUNK)
            final = not raw
            try:
                text = decoder.decode(raw, final=final)
            except UnicodeDecodeError as e:
                raise _decode_error(path, e, f" (near byte {offset + e.start})") from None
            offset += len(raw)
            if "\r" in text:
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            buf = carry + text
            if whole:
                parts = [buf]
                carry = "" if final else parts.pop()
            else:
                parts = BLANK_LINES_RE.split(buf)
                carry = "" if final else parts.pop()
            yield from (p for p in parts if p)  # "" only before the first / after the last blank line
            while len(carry) > MAX_DOCUMENT_CHARS:
                stats.split_oversize += 1
                cut = carry.rfind("\n", 0, MAX_DOCUMENT_CHARS)
                cut = cut if cut > 0 else MAX_DOCUMENT_CHARS
                yield carry[:cut]
                carry = carry[cut:]
            if final:
                break
    if offset == 0:
        stats.files_empty.append(str(path))


def _read_jsonl(path: Path, cfg: DataConfig, stats: ReadStats) -> Iterator[str]:
    errors = _ERROR_HANDLER if cfg.encoding_errors == "replace" else "strict"
    col = cfg.text_column
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8", errors=errors)
            except UnicodeDecodeError as e:
                raise _decode_error(path, e, f":{lineno}") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                stats.invalid_json_lines += 1
                stats.note(f"{path}:{lineno}: invalid JSON ({e.msg})")
                continue
            text = record.get(col) if isinstance(record, dict) else None
            if not isinstance(text, str):
                stats.records_without_text += 1
                stats.note(f"{path}:{lineno}: no string field {col!r}")
                continue
            yield text


def _read_csv(path: Path, cfg: DataConfig, stats: ReadStats) -> Iterator[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long documents are normal in a corpus
    errors = "replace" if cfg.encoding_errors == "replace" else "strict"
    col = cfg.text_column
    with open(path, encoding="utf-8", errors=errors, newline="") as f:
        try:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                return
            if col not in reader.fieldnames:
                raise DataError(
                    f"{path}: no column {col!r} (columns: {', '.join(reader.fieldnames)}); set data.text_column"
                )
            for row in reader:
                text = row.get(col)
                if not isinstance(text, str):
                    stats.records_without_text += 1
                    stats.note(f"{path}:{reader.line_num}: no field {col!r}")
                    continue
                yield text
        except UnicodeDecodeError as e:
            raise _decode_error(path, e) from None
        except csv.Error as e:
            raise DataError(f"{path}: not valid CSV: {e}") from None


def _read_parquet(path: Path, cfg: DataConfig, stats: ReadStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a non-Parquet file
        raise DataError(f"{path}: not a Parquet file ({str(e).splitlines()[0]})") from None
    col = cfg.text_column
    if col not in pf.schema_arrow.names:
        raise DataError(
            f"{path}: no column {col!r} (columns: {', '.join(pf.schema_arrow.names)}); set data.text_column"
        )
    for batch in pf.iter_batches(columns=[col], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                stats.records_without_text += 1
                stats.note(f"{path}: a record has no string {col!r}")
                continue
            yield text


def _read_hub(cfg: DataConfig, stats: ReadStats) -> Iterator[str]:
    """A dataset by Hub name (or a local folder / script-free dataset path) via ``load_dataset``."""
    import datasets

    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=cfg.hub_split, streaming=cfg.streaming)
    except Exception as e:  # offline, unknown name, bad config/split: all end the same way for a user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"cannot load Hub dataset {cfg.hub_name!r} (config={cfg.hub_config!r}, split={cfg.hub_split!r}): {first}"
        ) from None
    names = ds.column_names if not cfg.streaming else (list(ds.features) if ds.features else None)
    if names is not None and cfg.text_column not in names:
        raise DataError(
            f"Hub dataset {cfg.hub_name!r} has no column {cfg.text_column!r} "
            f"(columns: {', '.join(names)}); set data.text_column"
        )
    for row in ds:
        text = row.get(cfg.text_column)
        if not isinstance(text, str):
            stats.records_without_text += 1
            stats.note(f"{cfg.hub_name}: a record has no string {cfg.text_column!r}")
            continue
        yield text


_FILE_READERS = {"text": _read_text_file, "jsonl": _read_jsonl, "csv": _read_csv, "parquet": _read_parquet}


def is_file_source(cfg: DataConfig) -> bool:
    return cfg.source in _FILE_READERS


def _raw_documents(cfg: DataConfig, stats: ReadStats, paths: list[Path] | None) -> Iterator[str]:
    if cfg.source == "builtin":
        from bert_mp.data.builtin_corpus import builtin_documents

        for d in builtin_documents():
            yield d["text"]
    elif cfg.source == "hub":
        yield from _read_hub(cfg, stats)
    else:
        reader = _FILE_READERS[cfg.source]
        for path in resolve_paths(cfg.paths, stats) if paths is None else paths:
            stats.files += 1
            try:
                if cfg.source != "parquet" and _skip_binary(path, stats):
                    continue
                yield from reader(path, cfg, stats)
            except OSError as e:
                raise DataError(f"{path}: cannot read ({e.strerror or e})") from None


def iter_documents(cfg: DataConfig, stats: ReadStats, paths: list[Path] | None = None) -> Iterator[str]:
    """Non-empty documents of the configured source, at most ``max_documents``; counts in ``stats``.

    ``paths``: for a file source, read these files (already resolved) instead of ``cfg.paths``.
    """
    _replaced[0] = 0
    try:
        for text in _raw_documents(cfg, stats, paths):
            if cfg.max_documents is not None and stats.documents_read >= cfg.max_documents:
                break
            stats.documents_read += 1
            if not text.strip():
                stats.dropped_empty += 1
                continue
            yield text
    finally:
        stats.invalid_utf8_replaced += _replaced[0]
        _replaced[0] = 0


def merge_read_stats(parts: list[ReadStats]) -> ReadStats:
    """Counts of several readers (in file order) as one: sums, the first problem, all empty files."""
    out = ReadStats()
    for p in parts:
        for f in fields(ReadStats):
            v = getattr(p, f.name)
            if isinstance(v, int):
                setattr(out, f.name, getattr(out, f.name) + v)
        out.files_empty.extend(p.files_empty)
        for name in ("first_problem", "first_duplicate_path", "first_binary_file"):
            if getattr(out, name) is None:
                setattr(out, name, getattr(p, name))
    return out


def describe_source(cfg: DataConfig) -> str:
    """A short human description of the source, for messages."""
    if cfg.source == "builtin":
        return "the built-in corpus"
    if cfg.source == "hub":
        return f"Hub dataset {cfg.hub_name}" + (f"/{cfg.hub_config}" if cfg.hub_config else "")
    return f"{cfg.source} files {', '.join(cfg.paths)}"

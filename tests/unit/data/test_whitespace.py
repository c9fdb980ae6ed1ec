"""One definition of a blank line for every documents mode and splitter, tested with every Unicode
whitespace character (the space separators, category Zs, among them)."""

from __future__ import annotations

import re
import unicodedata

import pytest
from support import read_documents

from bert_mp.data import segment
from bert_mp.data.segment import _mark_rule, build_splitter, mark_documents, split_sentences
from bert_mp.data.whitespace import BLANK_LINES_RE, LINE_SPACE, is_blank

ALL_CHARS = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
SPACES = sorted(c for c in ALL_CHARS if c.isspace() and c != "\n")
"""Every character Python's str.strip removes (what Google's reader strips lines with), but \\n."""


def test_the_definition_is_pythons_whitespace_and_covers_every_space_separator():
    assert set(re.findall(r"\s", ALL_CHARS)) == {c for c in ALL_CHARS if c.isspace()}
    assert set(re.findall(LINE_SPACE, ALL_CHARS)) == set(SPACES)
    separators = {c for c in ALL_CHARS if unicodedata.category(c) == "Zs"}
    assert len(separators) == 17 and separators <= set(SPACES)
    assert {"\u00a0", "\u3000", "\f", "\v", "\t", "\u2028", "\x85"} <= set(SPACES)
    assert not {"\u200b", "\ufeff", "x"} & set(SPACES)  # zero-width space and BOM are not whitespace


@pytest.mark.parametrize("space", SPACES, ids=lambda c: f"U+{ord(c):04X}")
def test_a_line_of_any_whitespace_is_blank_in_every_mode(tmp_path, monkeypatch, space):
    assert is_blank(space) and is_blank(space * 3 + " ") and is_blank("")
    assert not is_blank(space + "x")
    text = f"Alpha one two.\nBeta three four.\n{space}\nGamma five six.\n{space * 2} \nDelta seven."
    assert BLANK_LINES_RE.split(text) == [
        "Alpha one two.\nBeta three four.",
        "Gamma five six.",
        "Delta seven.",
    ]
    path = tmp_path / "g.txt"
    path.write_text(text, encoding="utf-8")
    for mode in ("blank_line", "line"):  # documents
        docs, _ = read_documents(source="text", paths=[str(path)], documents=mode)
        assert len(docs) == 3, (mode, docs)
    # documents=file and any record: a sentence boundary (no sentence end here but the blank lines)
    prose = f"alpha one two\nbeta three four\n{space}\ngamma five six"
    assert split_sentences(prose) == ["alpha one two\nbeta three four", "gamma five six"]
    assert _mark_rule(prose, "|") == ("alpha one two\nbeta three four|gamma five six|", 2)
    assert mark_documents([prose, prose], "|")[1] == [2, 2]
    # the paragraphs handed to an optional splitter (stubbed: one sentence per paragraph)
    monkeypatch.setattr(segment, "_optional_splitter", lambda name: lambda para: [para])
    assert len(build_splitter("nltk")(prose)) == 2


def test_a_whitespace_character_inside_a_line_is_no_boundary():
    assert BLANK_LINES_RE.split("one\u00a0two\nthree\u3000\nfour") == ["one\u00a0two\nthree\u3000\nfour"]
    assert split_sentences("alpha\u00a0one\nbeta\u3000two") == ["alpha\u00a0one\nbeta\u3000two"]

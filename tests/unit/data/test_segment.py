"""Sentence splitting: boundaries, abbreviations, blank lines, overlong pieces, arbitrary Unicode."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bert_mp.data.segment import (
    _BOUNDARY,
    _mark_rule,
    build_splitter,
    count_markers,
    flatten_ids,
    split_marked_tokens,
    split_sentences,
)
from bert_mp.errors import DataError


def mark_sentences(text: str, marker: str) -> str:
    """``text`` with ``marker`` at every rule boundary (replacing the whitespace there) and at the end."""
    return _mark_rule(text, marker)[0]


def test_splits_on_sentence_ends_and_blank_lines():
    text = (
        'First one. Second "quoted!" Third?  "Fourth," he said. 5 is a number.\n\nNew paragraph\nwrapped line'
    )
    assert split_sentences(text) == [
        "First one.",
        'Second "quoted!"',
        "Third?",
        '"Fourth," he said.',
        "5 is a number.",
        "New paragraph\nwrapped line",
    ]


def test_abbreviations_and_lowercase_do_not_split():
    text = "Use e.g. Python or i.e. Perl. The call f.x. then ok. version 3.12 is out."
    assert split_sentences(text) == [
        "Use e.g. Python or i.e. Perl.",
        "The call f.x. then ok. version 3.12 is out.",
    ]


def test_overlong_pieces_are_cut_at_whitespace():
    word = "abcdefghi "
    out = split_sentences(word * 1000, max_chars=100)
    assert all(0 < len(s) <= 100 for s in out)
    assert "".join(out).replace(" ", "") == (word * 1000).replace(" ", "")
    # no whitespace at all: hard cut
    out = split_sentences("x" * 5000, max_chars=1000)
    assert [len(s) for s in out] == [1000] * 5


def test_empty_and_whitespace_give_no_sentences():
    assert split_sentences("") == []
    assert split_sentences(" \n\n\t \n") == []


def test_unknown_or_missing_splitter_is_a_one_line_error():
    assert build_splitter("rule")("A b. C d.") == ["A b.", "C d."]
    with pytest.raises(DataError):
        build_splitter("nope")
    try:
        import blingfire  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="pip install blingfire"):
            build_splitter("blingfire")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=3000), st.integers(min_value=8, max_value=500))
def test_properties_on_arbitrary_unicode(text, max_chars):
    out = split_sentences(text, max_chars=max_chars)
    assert all(s and s == s.strip() and len(s) <= max_chars for s in out)
    # nothing but whitespace is lost, and order is kept
    assert "".join("".join(out).split()) == "".join(text.split())


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="\x00"), max_size=2000))
def test_marked_form_has_the_same_boundaries(text):
    marked = mark_sentences(text, "\x00")
    assert marked.endswith("\x00")
    assert [s.strip() for s in marked.split("\x00") if s.strip()] == split_sentences(text, max_chars=1 << 30)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([*"ab.!?\"')([] \t\nAZ09", "e.g.", "Dr.", "\n\n", " \n \n "]), max_size=120).map(
        "".join
    )
    | st.text(max_size=500)
)
def test_two_pass_marking_equals_one_pass(text):
    """prepare marks in two passes (sentence ends, then blank lines); the result must equal one
    pass of the combined boundary pattern, marker count included."""
    one, n = _BOUNDARY.subn(lambda m: (m.group(1) or "") + "|", text.strip())
    assert _mark_rule(text, "|") == (one + "|", n + 1)
    assert (
        _mark_rule(text, "\\1[SEP]")[0]
        == _BOUNDARY.sub(lambda m: (m.group(1) or "") + "\\1[SEP]", text.strip()) + "\\1[SEP]"
    )


def test_split_marked_tokens():
    m = 3
    ids = [[10, 11, m, 12, m], [m], [13, 14, 15, 16, 17, m, m, 18, m]]
    flat, lengths, document, empty, cut = split_marked_tokens(ids, m, max_tokens=2)
    assert flat.tolist() == [10, 11, 12, 13, 14, 15, 16, 17, 18]
    assert lengths.tolist() == [2, 1, 2, 2, 1, 1]  # 13..17 cut into 2 + 2 + 1
    assert document.tolist() == [0, 0, 2, 2, 2, 2]
    assert (empty, cut) == (2, 1)
    with pytest.raises(DataError, match="does not keep its"):
        split_marked_tokens([[10, 11]], m, 4)
    # the flat form gives the same, as does one marker id per document
    flat_form = flatten_ids(ids)
    assert flat_form[1].tolist() == [5, 1, 9]
    for got, want in zip(
        split_marked_tokens(flat_form, np.array([m, m, m]), 2), (flat, lengths, document, empty, cut)
    ):
        assert np.array_equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=12), max_size=8), st.data())
def test_count_markers_counts_each_documents_own_marker(ids, data):
    markers = np.array([data.draw(st.integers(0, 4)) for _ in ids], dtype=np.int32)
    flat, doc_lens = flatten_ids(ids)
    assert count_markers(flat, doc_lens, markers).tolist() == [d.count(int(k)) for d, k in zip(ids, markers)]
    assert count_markers(flat, doc_lens, 2).tolist() == [d.count(2) for d in ids]


def test_cutting_an_overlong_sentence_leaves_no_lone_punctuation():
    # characters: the last cut halves what is left instead of leaving the final "."
    out = split_sentences("word " * 30 + ".", max_chars=150)
    assert all(any(c.isalnum() for c in s) for s in out) and all(len(s) <= 150 for s in out)
    # tokens: one token over the limit is two near-equal pieces, not max_tokens + a lone "." (id 9)
    m = 3
    flat, lengths, _, _, cut = split_marked_tokens([[*range(10, 10 + 125), 9, m]], m, max_tokens=125)
    assert cut == 1 and lengths.tolist() == [63, 63] and flat.tolist()[-1] == 9
    _, lengths, _, _, _ = split_marked_tokens([[*([10] * 251), m]], m, max_tokens=125)
    assert lengths.tolist() == [84, 84, 83]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.text(
            alphabet=st.sampled_from(list("ab .!?\"')([]\n\t AZ09e.g.U.S.Mr.\x00|")), min_size=1, max_size=80
        ),
        max_size=12,
    ),
    st.sampled_from(["|", "[SEP]"]),
    st.booleans(),
)
def test_marking_a_block_equals_marking_each_document(texts, marker, lines):
    from bert_mp.data.segment import _mark_rule, mark_documents, mark_lines

    texts = [t for t in texts if t.strip()]
    one = mark_lines if lines else _mark_rule
    marked, counts = mark_documents(texts, marker, lines=lines)
    want = [one(t, marker) for t in texts]
    assert marked == [m for m, _ in want] and counts == [c for _, c in want]


def test_line_marking_takes_lines_as_sentences():
    from bert_mp.data.segment import mark_lines

    assert mark_lines("Dr. Smith arrived. He sat.\nsecond line e.g. this\n", "|") == (
        "Dr. Smith arrived. He sat.|second line e.g. this|",
        2,
    )


def test_unused_character_and_marked_pieces():
    from bert_mp.data.segment import mark_lines, marked_pieces, unused_character

    assert unused_character("plain text") == "\x00"
    assert unused_character("nul \x00 and \ue000") == "\ue001"
    text = "First one. Second [SEP] two!\n\nThird\x00 here"
    pieces = marked_pieces(text, _mark_rule)
    assert pieces == ["First one.", "Second [SEP] two!", "Third\x00 here"]
    assert len(pieces) == _mark_rule(text, "|")[1]
    assert marked_pieces(" a\n b \n", mark_lines) == ["a", " b"]

"""What a blank line is: one definition for every ``data.documents`` mode and sentence splitter.

A line is blank when it holds only whitespace as Python's ``str.strip`` / ``str.isspace`` define
it, which is what Google's ``create_pretraining_data.py`` reader strips each line with: spaces and
tabs, form feeds and vertical tabs, every Unicode space separator (category Zs: the no-break space
U+00A0, the ideographic space U+3000, U+2000-U+200A, ...), and the other characters Python counts as
whitespace (U+0085, U+2028, U+2029, U+001C-U+001F). ``\\s`` in a ``re`` pattern on ``str`` matches
exactly these characters (tested), so the patterns below run in the regular-expression engine, never
a Python loop over characters. Lines end at ``\\n`` only: CRLF and CR are normalised to LF on
reading, and the other line-like separators are whitespace inside a line (as in Google's reader).
"""

from __future__ import annotations

import re

LINE_SPACE = r"[^\S\n]"
"""One whitespace character other than the line break."""
BLANK_LINES = rf"\n(?:{LINE_SPACE}*\n)+"
"""A line break followed by one or more blank lines, each with its line break: a document (or
paragraph) boundary."""
BLANK_LINES_RE = re.compile(BLANK_LINES)


def is_blank(line: str) -> bool:
    """Whether ``line`` (without its line break) is a blank line: empty or only whitespace."""
    return not line or line.isspace()

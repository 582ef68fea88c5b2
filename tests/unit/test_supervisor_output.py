"""``laminar run`` reads its children's output whatever they print: lines split across chunks
and cut at the limit. A real child printing a 1 MiB line is
``tests/integration/test_supervisor_output.py``.
"""

from __future__ import annotations

from laminar.proc.linesplit import LineSplitter


def test_lines_split_across_chunks_and_cut_at_the_limit() -> None:
    split = LineSplitter(limit=8)
    assert split.feed(b"ab") == []
    assert split.feed(b"c\nde\r\n0123456789") == ["abc", "de"]  # \r stripped, as before
    assert split.feed(b"abc") == []
    assert split.feed(b"\n\n") == ["01234567 ... [line truncated: 5 more bytes not shown]", ""]
    assert split.feed(b"\xc3") == []  # a character split between chunks is kept whole
    assert split.feed(b"\xa9t\n") == ["\u00e9t"]
    assert split.feed(b"tail") == []
    assert split.close() == ["tail"]
    assert split.close() == []

"""The generic tool-call format read back as it streams: pure Python, no model."""

from __future__ import annotations

import json

from hypothesis import example, given
from hypothesis import strategies as st

from specdec_native.tools import StreamedAnswer, read_output


@given(
    answer=st.text(),
    ascii_only=st.booleans(),
    spaced=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
@example(answer='a😀"\\\n', ascii_only=True, spaced=False, cuts=[18, 21, 26])
def test_a_streamed_answer_is_the_answer_whatever_the_pieces(
    answer: str, ascii_only: bool, spaced: bool, cuts: list[int]
) -> None:
    text = json.dumps({"response": answer}, ensure_ascii=ascii_only)
    if spaced:
        text = text.replace("{", "{\n  ", 1)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    reader = StreamedAnswer()
    given_text = "".join(
        part for a, b in zip(bounds, bounds[1:]) for part in reader.feed(text[a:b])
    )
    assert given_text == answer == reader.streamed
    assert read_output(text) == (answer, [])


def test_tool_calls_are_read_whole_and_nothing_is_streamed() -> None:
    text = '{"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}'
    reader = StreamedAnswer()
    assert [p for i in range(len(text)) for p in reader.feed(text[i])] == []
    content, calls = read_output(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1})
    ]
    assert read_output(text[:-3]) == (None, [])  # cut short: no calls

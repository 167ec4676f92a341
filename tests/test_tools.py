"""The generic tool-call format: its schema, and read back as it streams (no model)."""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]
from hypothesis import example, given
from hypothesis import strategies as st
from llguidance import LLMatcher

from specdec_native.tools import StreamedAnswer, ToolCall, ToolFormat, conversation, read_output


def test_tool_schemas_keep_their_own_references() -> None:
    # A recursive tree ("#" is the tool's own root), $defs, and a const that only looks like a
    # reference: the output's schema compiles and means what each tool's schema meant.
    tree = {
        "type": "object",
        "properties": {
            "label": {"$ref": "#/$defs/Label"},
            "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
            "kind": {"const": {"$ref": "#/not/a/schema"}},
        },
        "required": ["label", "kind"],
        "$defs": {"Label": {"type": "string", "maxLength": 8}},
    }
    plain = {"type": "object", "properties": {"n": {"type": "integer"}}}
    functions = [{"name": "tree", "parameters": tree}, {"name": "plain", "parameters": plain}]
    schema = ToolFormat(functions, "auto", True, tree).schema()
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) == ""
    kind = {"$ref": "#/not/a/schema"}
    good = {"label": "a", "kind": kind, "children": [{"label": "b", "kind": kind}]}
    bad = {"label": "a", "kind": kind, "children": [{"label": "far too long", "kind": kind}]}
    jsonschema.validate(good, tree)
    valid = jsonschema.Draft202012Validator(schema).is_valid
    for value, ok in ((good, True), (bad, False)):
        assert valid({"tool_calls": [{"name": "tree", "arguments": value}]}) == ok
        assert valid({"response": value}) == ok
    jsonschema.validate({"tool_calls": [{"name": "plain", "arguments": {"n": 1}}]}, schema)
    # Under properties, "default" names a property, not a keyword: its reference moves too.
    named = {
        "type": "object",
        "properties": {"default": {"$ref": "#/$defs/V"}},
        "required": ["default"],
        "$defs": {"V": {"type": "integer"}},
    }
    schema = ToolFormat([{"name": "named", "parameters": named}], "required", True, None).schema()
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) == ""
    valid = jsonschema.Draft202012Validator(schema).is_valid
    assert valid({"tool_calls": [{"name": "named", "arguments": {"default": 3}}]})
    assert not valid({"tool_calls": [{"name": "named", "arguments": {"default": "x"}}]})
    assert "$defs" not in ToolFormat(functions[1:], "required", True, None).schema()


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


def test_a_conversation_writes_calls_and_results_in_the_generic_format() -> None:
    calls = [ToolCall("add", '{"a": 1}', "c1"), ToolCall("mul", '{"b": 2}', "c2")]
    messages = [
        ("user", "sums?", [], None),
        ("assistant", None, calls, None),
        ("tool", "1", [], "c1"),
        ("tool", "2", [], "c2"),
        ("assistant", "1 and 2", [], None),
        ("tool", "3", [], "c3"),
    ]
    out = conversation(messages, None)
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user"]
    assert set(out[0]) == {"role", "content"} and all(set(m) == set(out[0]) for m in out)
    listed = json.loads(out[1]["content"])["tool_calls"]
    assert listed == [
        {"name": "add", "arguments": {"a": 1}},
        {"name": "mul", "arguments": {"b": 2}},
    ]
    # Results in a row share one message; one after an answer starts its own.
    results = [json.loads(line)["tool_response"] for line in out[2]["content"].splitlines()]
    assert results == [
        {"tool_call_id": "c1", "content": "1"},
        {"tool_call_id": "c2", "content": "2"},
    ]
    assert json.loads(out[4]["content"])["tool_response"]["tool_call_id"] == "c3"

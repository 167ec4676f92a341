"""The tool-call formats (generic JSON and <tool_call> tags): their grammars, the chat template's
view of a conversation, and output read back as it streams (no model)."""

from __future__ import annotations

import json
import re
import time
import tracemalloc
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper, grammar_from

from specdec_native.server import _answer_end
from specdec_native.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_CALLS,
    Message,
    StreamedAnswer,
    StreamedText,
    StreamedUnlessCall,
    ToolCall,
    ToolError,
    ToolFormat,
    _tagged_grammar,
    check_schema,
    conversation,
    read_hermes,
    read_llama3,
    read_mistral,
    read_output,
    template_conversation,
    template_syntax,
)

TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml-tools.jinja"
LLAMA3_TEMPLATE = Path(__file__).parent / "templates" / "llama3-tools.jinja"
MISTRAL_TEMPLATE = Path(__file__).parent / "templates" / "mistral-tools.jinja"


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
        Message("user", "sums?", [], None),
        Message("assistant", None, calls, None),
        Message("tool", "1", [], "c1"),
        Message("tool", "2", [], "c2", "mul"),
        Message("assistant", "1 and 2", [], None),
        Message("tool", "3", [], "c3"),
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
        {"tool_call_id": "c2", "name": "mul", "content": "2"},  # its name, where given
    ]
    assert json.loads(out[4]["content"])["tool_response"]["tool_call_id"] == "c3"
    # Text beside calls (as another model may have written them) is kept, before them.
    said = conversation(
        [Message("user", "x", [], None), Message("assistant", "On it.", calls, None)], None
    )
    assert [m["content"] for m in said[1:2]] == ["On it."]
    assert json.loads(said[2]["content"])["tool_calls"][0]["name"] == "add"


def test_a_template_that_takes_tools_and_writes_tags_is_hermes() -> None:
    assert template_syntax(TOOLS_TEMPLATE.read_text()) is HERMES
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
    assert template_syntax(chatml) is GENERIC
    # Tags alone, or tools alone, are not a format the server can read back.
    assert template_syntax(chatml + "<tool_call>") is GENERIC
    assert template_syntax(chatml + "{{ tools }}") is GENERIC
    # Calls written as XML in the same tags (Qwen3-Coder, GLM) are another format.
    xml = TOOLS_TEMPLATE.read_text() + "<function={{ name }}>"
    assert template_syntax(xml) is GENERIC
    # A call as a message of JSON with "parameters", results as ipython messages: Llama 3's.
    assert template_syntax(LLAMA3_TEMPLATE.read_text()) is LLAMA3
    assert template_syntax(chatml + '{{ tools }} "parameters"') is GENERIC
    # Calls as a JSON array after [TOOL_CALLS]: Mistral's; name[ARGS]{...} is another format.
    assert template_syntax(MISTRAL_TEMPLATE.read_text()) is MISTRAL
    assert template_syntax(MISTRAL_TEMPLATE.read_text() + "[ARGS]") is GENERIC


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "$defs": {"Unit": {"enum": ["C", "F"]}},
}


def test_hermes_grammars_compile_for_every_choice() -> None:
    functions = [{"name": "weather", "parameters": WEATHER}, {"name": "time", "parameters": {}}]
    for choice in ("auto", "required", "time"):
        for parallel in (True, False):
            for answer in (None, {"type": "object"}):
                tools = ToolFormat(functions, choice, parallel, answer, HERMES)
                kind, text = tools.constraint()
                assert kind == "lark"
                assert LLMatcher.validate_grammar(grammar_from("lark", text)) == "", text
                assert ("TEXT" in text) == (choice == "auto" and answer is None)
                assert ('("\\n" call)*' in text) == parallel
    generic = ToolFormat(functions, "auto", True, None).constraint()
    assert generic[0] == "json_schema" and "tool_calls" in generic[1]


def test_hermes_output_is_read_as_calls_or_text() -> None:
    two = (
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )
    content, calls = read_hermes(two)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert read_hermes(two[:-4]) == (None, [])  # cut short: no calls
    assert read_hermes('<tool_call>\n{"name": 3}\n</tool_call>') == (None, [])
    assert read_hermes("<tool_call>\nnot json\n</tool_call>") == (None, [])
    assert read_hermes("Sunny, 21 C.") == ("Sunny, 21 C.", [])
    content, calls = read_hermes("Let me look that up.\n" + two)
    assert content == "Let me look that up." and [c.name for c in calls] == ["f", "g"]
    assert read_hermes("Let me look that up.\n" + two[:-4]) == (None, [])
    functions = [{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]
    tools = ToolFormat(functions, "auto", True, None, HERMES)
    assert tools.read(two)[1] and isinstance(tools.streamed(), StreamedText)
    # Only the request's tools are calls.
    assert ToolFormat(functions[:1], "auto", True, None, HERMES).read(two) == (None, [])


def streamed_text(text: str, cuts: list[int]) -> str:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    reader = StreamedText()
    given_text = "".join(
        part for a, b in zip(bounds, bounds[1:]) for part in reader.feed(text[a:b])
    )
    assert given_text == reader.streamed
    return given_text


CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


@given(
    answer=st.text(min_size=1).filter(lambda t: "<tool_call>" not in t),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12),
)
@example(answer="<tool_", cuts=[1, 3])
@example(answer="<tool_cal!", cuts=[5])
@example(answer="Let me see. ", cuts=[11])
def test_hermes_text_streams_unless_it_can_start_a_call(answer: str, cuts: list[int]) -> None:
    # All of it, but for an end that may still open a tag and spaces (the end gives the rest).
    longest = min(len(answer), 10)
    held = next((n for n in range(longest, 0, -1) if "<tool_call>".startswith(answer[-n:])), 0)
    assert streamed_text(answer, cuts) == answer[: len(answer) - held].rstrip()
    # Text before a call is the content beside it: streamed up to the tag, then nothing.
    assert streamed_text(answer + CALL, cuts) == answer.rstrip()
    assert read_hermes(answer + CALL)[0] == (answer.rstrip() or None)
    assert streamed_text(CALL, cuts) == ""


class ByteTokens:
    """A vocabulary of single bytes, for llguidance to check text against a grammar."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class TagTokens(ByteTokens):
    """Single bytes and [TOOL_CALLS] as one special token (257), as Mistral's vocabularies hold
    it (llguidance marks special tokens with a leading 0xff byte)."""

    tokens = [*ByteTokens.tokens, b"\xff[TOOL_CALLS]"]
    special_token_ids = [256, 257]


def grammar_accepts(grammar: str, text: str | list[int], vocab: ByteTokens | None = None) -> bool:
    """Whether `grammar` takes `text` whole: its bytes, or (a list) these tokens of `vocab`."""
    tokenizer = LLTokenizer(TokenizerWrapper(vocab or ByteTokens()))
    matcher = LLMatcher(tokenizer, grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = list(text.encode()) if isinstance(text, str) else text
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


def test_hermes_answers_may_go_on_into_calls() -> None:
    functions = [{"name": "f", "parameters": {}}]
    grammar = ToolFormat(functions, "auto", True, None, HERMES).constraint()[1]
    assert grammar_accepts(grammar, CALL)
    assert grammar_accepts(grammar, "Sunny, 21 C.")
    assert grammar_accepts(grammar, "Let me look that up.\n" + CALL)
    assert grammar_accepts(grammar, "I will call f twice.\n" + CALL + "\n" + CALL)
    assert not grammar_accepts(grammar, "Let me look.\n<tool_call>\nnot a call")
    one = ToolFormat(functions, "auto", False, None, HERMES).constraint()[1]
    assert grammar_accepts(one, "Now f.\n" + CALL)
    assert not grammar_accepts(one, "Now f.\n" + CALL + "\n" + CALL)
    # A call that is required, or an answer under a schema, starts at once.
    required = ToolFormat(functions, "required", True, None, HERMES).constraint()[1]
    assert grammar_accepts(required, CALL)
    assert not grammar_accepts(required, "Now f.\n" + CALL)


def test_a_template_sees_calls_and_results_as_they_were() -> None:
    calls = [ToolCall("add", '{"a": 1}', "c1")]
    out = template_conversation(
        [
            Message("user", "sum?", [], None),
            Message("assistant", None, calls, None),
            Message("tool", "1", [], "c1"),
        ]
    )
    assert out == [
        {"role": "user", "content": "sum?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "1", "tool_call_id": "c1"},
    ]


def test_tool_arguments_name_only_their_properties_unless_told() -> None:
    # As llama.cpp reads tool schemas: objects that list properties take no others, unless
    # their schema says so; the schema the model is shown stays the caller's.
    open_object = {"type": "object", "properties": {"city": {"type": "string"}}}
    told = {**open_object, "additionalProperties": True}
    nested = {"type": "object", "properties": {"where": open_object}}
    functions = [
        {"name": "closed", "parameters": open_object},
        {"name": "told", "parameters": told},
        {"name": "nested", "parameters": nested},
    ]
    tools = ToolFormat(functions, "required", True, None)
    valid = jsonschema.Draft202012Validator(tools.schema()).is_valid

    def call(name: str, arguments: object) -> object:
        return {"tool_calls": [{"name": name, "arguments": arguments}]}

    assert valid(call("closed", {"city": "Oslo"}))
    assert not valid(call("closed", {"city": "Oslo", "type": "string"}))
    assert valid(call("told", {"city": "Oslo", "type": "string"}))
    assert not valid(call("nested", {"where": {"city": "Oslo", "x": 1}}))
    assert '"additionalProperties": false' not in tools.instructions()


def test_combined_schemas_keep_what_they_allow() -> None:
    # Closing stops where objects combine: allOf extending a shared definition, anyOf branches
    # adding properties, a required property another part lists.
    extended = {
        "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {"type": "integer"}}}],
        "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    branches = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "anyOf": [{"properties": {"x": {"type": "integer"}}}, {"required": ["kind"]}],
    }
    elsewhere = {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}
    beside_ref = {
        "$ref": "#/$defs/Base",
        "properties": {"b": {"type": "integer"}},
        "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    dependent = {"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}
    cases = [
        (extended, {"a": 1, "b": 2}),
        (branches, {"kind": "k", "x": 1}),
        (elsewhere, {"a": 1, "b": 2}),
        (beside_ref, {"a": 1, "b": 2}),
    ]
    for parameters, arguments in cases:
        tools = ToolFormat([{"name": "f", "parameters": parameters}], "required", True, None)
        schema = tools.schema()
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) == ""
        jsonschema.validate({"tool_calls": [{"name": "f", "arguments": arguments}]}, schema)
    # llguidance refuses dependentRequired, but such a schema is left as given all the same.
    kept = ToolFormat([{"name": "f", "parameters": dependent}], "required", True, None).schema()
    assert kept["properties"]["tool_calls"]["items"]["anyOf"][0]["properties"]["arguments"] == (
        dependent
    )
    # A required list that is not names is the schema's own problem, not a crash here.
    odd = {"type": "object", "properties": {"a": {}}, "required": [{}]}
    ToolFormat([{"name": "f", "parameters": odd}], "required", True, None).schema()


def test_hermes_output_is_read_in_linear_time() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    text = "\n".join([call] * 60) + '\n<tool_call>\n{"na'  # cut short after 60 calls
    start = time.perf_counter()
    assert read_hermes(text) == (None, [])
    assert len(read_hermes(text.rsplit("\n", 2)[0])[1]) == 60
    # A backtracking reader took seconds at 20 calls, doubling with each one.
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize(
    "syntax,text,content",
    [
        ("generic", '{"response": "Hello wor', "Hello wor"),  # a cut answer: its text
        ("generic", '{"tool_calls": [{"name": "f", "argu', '{"tool_calls": [{"name": "f", "argu'),
        ("generic", '{"response": "Hi"}', "Hi"),
        ("hermes", "Let me look.\n<tool_call>\n{", "Let me look.\n<tool_call>\n{"),
        ("hermes", "Let me look.\n" + CALL, "Let me look."),
        ("hermes", "Sunny. ", "Sunny. "),
        ("llama3", '{"name": "f", "parameters": {}}', ""),
        ("llama3", '{"name": "f", "param', '{"name": "f", "param'),
        ("llama3", " Sunny {not a call}", " Sunny {not a call}"),
        ("mistral", "Let me look. [TOOL_CALLS] [{", "Let me look. [TOOL_CALLS] [{"),
        ("mistral", 'Let me look. [TOOL_CALLS][{"name": "f", "arguments": {}}]', "Let me look."),
        ("mistral", "Sunny [TOOL", "Sunny [TOOL"),
    ],
)
def test_streamed_or_not_the_content_is_the_same(syntax: str, text: str, content: str) -> None:
    named = {s.name: s for s in (GENERIC, HERMES, LLAMA3, MISTRAL)}
    tools = ToolFormat([{"name": "f", "parameters": {}}], "auto", True, None, named[syntax])
    assert tools.output(text)[0] == content
    for cut in range(len(text) + 1):
        reader = tools.streamed()
        streamed = "".join([*reader.feed(text[:cut]), *reader.feed(text[cut:])])
        rest = "".join(
            d.get("content", "")
            for d in _answer_end(tools.output(text, reader.streamed), reader.streamed)
        )
        assert streamed + rest == content


def test_arguments_and_answers_keep_the_numbers_the_model_wrote() -> None:
    def strict(text: str) -> object:  # JSON.parse: no Infinity, no NaN
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {text}"))

    written = '{"x": 1e999, "y": 0.10000000000000000001, "z": [-1e-400, 12345678901234567890]}'
    _, calls = read_output(f'{{"tool_calls": [{{"name": "f", "arguments": {written}}}]}}')
    _, tagged = read_hermes(f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>')
    for arguments in (calls[0].arguments, tagged[0].arguments):
        value = strict(arguments)
        assert isinstance(value, dict) and value["z"][1] == 12345678901234567890
        assert "0.10000000000000000001" in arguments  # not rounded to a float's 0.1
    assert strict(read_output('{"response": -1e400}')[0] or "") is not None
    assert read_output('{"response": NaN}') == (None, [])  # no JSON, no answer
    # Arguments written as a string are JSON text all the same.
    assert (
        tagged
        and read_hermes('<tool_call>\n{"name": "f", "arguments": "Paris"}\n</tool_call>')[1][
            0
        ].arguments
        == '"Paris"'
    )


def test_a_string_answer_under_a_response_format_is_json_streamed_or_not() -> None:
    tools = ToolFormat([{"name": "f", "parameters": {}}], "auto", True, {"type": "string"}, GENERIC)
    text = '{"response": "hello"}'
    assert tools.output(text) == ('"hello"', [])
    reader = tools.streamed()
    streamed = "".join(reader.feed(text))
    rest = "".join(
        d.get("content", "")
        for d in _answer_end(tools.output(text, reader.streamed), reader.streamed)
    )
    assert streamed + rest == '"hello"'


def test_llama3_output_is_one_call_or_text() -> None:
    functions = [{"name": "weather", "parameters": WEATHER}, {"name": "time", "parameters": {}}]
    for choice in ("auto", "required", "time"):
        for answer in (None, {"type": "object"}):
            kind, text = ToolFormat(functions, choice, True, answer, LLAMA3).constraint()
            assert kind == "lark"
            assert LLMatcher.validate_grammar(grammar_from("lark", text)) == "", text
    grammar = ToolFormat(functions, "auto", True, None, LLAMA3).constraint()[1]
    call = '{"name": "weather", "parameters": {"city": "Paris"}}'
    assert grammar_accepts(grammar, call)
    assert grammar_accepts(grammar, "It is sunny in {Paris}.")
    assert not grammar_accepts(grammar, '{"name": "weather", "parameters": {"town": "Paris"}}')
    assert not grammar_accepts(grammar, "  {not a call}")
    assert not grammar_accepts(grammar, call + "\n" + call)  # one call per message
    # An answer under a response format may have a "name" of its own: it stays an answer.
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    answered = ToolFormat(functions, "auto", True, person, LLAMA3)
    assert grammar_accepts(answered.constraint()[1], '{"name": "Alice", "age": 3}')
    assert grammar_accepts(answered.constraint()[1], call)
    assert answered.read('{"name": "Alice", "age": 3}') == (None, [])  # the text as it is
    assert answered.read(call)[1][0].name == "weather"
    required = ToolFormat(functions, "required", True, None, LLAMA3).constraint()[1]
    assert grammar_accepts(required, call) and not grammar_accepts(required, "Sunny.")
    content, calls = read_llama3(call)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Paris"})
    ]
    assert read_llama3("Sunny.") == ("Sunny.", [])
    assert read_llama3(call[:-3]) == (None, [])
    assert read_llama3('{"parameters": {}}') == (None, [])
    reader = StreamedUnlessCall()
    assert [p for c in call for p in reader.feed(c)] == []
    reader = StreamedUnlessCall()
    assert "".join(p for c in " Sunny {x}" for p in reader.feed(c)) == " Sunny {x}"


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "f", "arguments": {}}]'


def test_mistral_output_is_text_then_one_array_of_calls() -> None:
    functions = [{"name": "f", "parameters": {}}, {"name": "g", "parameters": WEATHER}]
    for choice in ("auto", "required", "g"):
        for parallel in (True, False):
            for answer in (None, {"type": "object"}):
                kind, text = ToolFormat(functions, choice, parallel, answer, MISTRAL).constraint()
                assert kind == "lark"
                assert LLMatcher.validate_grammar(grammar_from("lark", text)) == "", text
    grammar = ToolFormat(functions, "auto", True, None, MISTRAL).constraint()[1]
    two = '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"city": "X"}}]'
    for text in (MISTRAL_CALL, two, "Sunny.", "Let me look. " + MISTRAL_CALL):
        assert grammar_accepts(grammar, text), text
    # The id the templates write is allowed: 9 letters and digits.
    assert grammar_accepts(grammar, MISTRAL_CALL[:-2] + ', "id": "a1b2c3d4e"}]')
    assert not grammar_accepts(grammar, MISTRAL_CALL[:-2] + ', "id": "a1b2"}]')
    assert not grammar_accepts(grammar, MISTRAL_CALL + " and more")
    assert not grammar_accepts(grammar, "[TOOL_CALLS] []")
    assert not grammar_accepts(grammar, '[TOOL_CALLS] [{"name": "h", "arguments": {}}]')
    one = ToolFormat(functions, "auto", False, None, MISTRAL).constraint()[1]
    assert grammar_accepts(one, MISTRAL_CALL) and not grammar_accepts(one, two)
    required = ToolFormat(functions, "required", True, None, MISTRAL).constraint()[1]
    assert grammar_accepts(required, two) and not grammar_accepts(required, "Sunny.")

    content, calls = read_mistral("Let me look. " + two, {"f", "g"})
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {}), ("g", {"city": "X"})]
    assert calls[0].id != calls[1].id
    assert read_mistral("Sunny.") == ("Sunny.", [])
    assert read_mistral(two[:-2]) == (None, [])  # cut short
    assert read_mistral(two, {"f"}) == (None, [])  # not the request's tool
    assert read_mistral('[TOOL_CALLS] [{"name": "f", "arguments": {}, "x": 1}]') == (None, [])
    assert read_mistral("[TOOL_CALLS] []") == (None, [])


def test_a_tag_that_is_a_special_token_is_that_token() -> None:
    """Where [TOOL_CALLS] is one special token, calls open with that token, never with its
    spelling; text may still come before it."""
    functions = [{"name": "f", "parameters": {}}]
    tools = ToolFormat(functions, "auto", True, None, MISTRAL, {MISTRAL_CALLS: 257})
    grammar = tools.constraint()[1]
    call = list(MISTRAL_CALL[len(MISTRAL_CALLS) :].encode())
    assert grammar_accepts(grammar, [257, *call], TagTokens())
    assert grammar_accepts(grammar, [*b"Let me look.", 257, *call], TagTokens())
    assert grammar_accepts(grammar, list(b"Sunny."), TagTokens())
    assert not grammar_accepts(grammar, list(MISTRAL_CALL.encode()), TagTokens())
    # A tag with a "/" in it (a closing tag, say) is text a Lark regex can hold.
    slashed = _tagged_grammar(tools, "</tag>", '"x"', None)
    assert grammar_accepts(slashed, "a</tag>x") and not grammar_accepts(slashed, "</tag>")


def test_mistral_templates_get_ids_they_take() -> None:
    """Mistral's templates refuse call ids that are not 9 letters and digits: an OpenAI
    client's ids reach them mapped, a call's and its result's alike."""
    call = ToolCall("f", "{}", "call_0123456789abcdef01234567")
    messages: list[Message] = [
        Message("user", "f?", [], None),
        Message("assistant", None, [call], None),
        Message("tool", "done", [], call.id),
    ]
    tools = ToolFormat([{"name": "f", "parameters": {}}], "auto", True, None, MISTRAL)
    out, listed = MISTRAL.chat(messages, tools)
    mapped = out[1]["tool_calls"][0]["id"]
    assert re.fullmatch("[A-Za-z0-9]{9}", mapped) and out[2]["tool_call_id"] == mapped
    assert listed == tools.template_tools()
    kept = ToolCall("f", "{}", "a1b2c3d4e")
    assert MISTRAL.chat([Message("assistant", None, [kept], None)], None)[0][0]["tool_calls"][0][
        "id"
    ] == ("a1b2c3d4e")
    # A result must name its call: the template writes each with its call's id.
    with pytest.raises(ToolError, match=r"messages\[2\]: a tool message needs the tool_call_id"):
        MISTRAL.chat([*messages[:2], Message("tool", "done", [], None)], tools)
    # 9 characters that are not all letters and digits are mapped too.
    assert re.fullmatch("[A-Za-z0-9]{9}", MISTRAL.template_id("call_1234"))
    assert MISTRAL.template_id("call_1234") != "call_1234"
    # Other formats leave ids as they are.
    assert HERMES.chat(messages, tools)[0][2]["tool_call_id"] == call.id


def test_a_schemas_own_options_keep_it_lenient_unless_strict() -> None:
    own = {"x-guidance": {"whitespace_flexible": True}}
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, **own}
    check_schema(tags, "tools[0].function.parameters", strict=False)
    with pytest.raises(ToolError, match="uniqueItems"):
        check_schema(tags, "tools[0].function.parameters", strict=True)
    lenient = {**tags, "x-guidance": {"lenient": True}}
    with pytest.raises(ToolError, match="uniqueItems"):
        check_schema(lenient, "response_format", strict=True)


def test_checked_schemas_are_not_kept_whole() -> None:
    check_schema({"type": "object"}, "response_format", strict=False)  # llguidance loaded
    tracemalloc.start()
    try:
        for i in range(16):
            text = {"type": "string", "description": f"{i} " + "x" * 1_000_000}
            check_schema({"type": "object", "properties": {"a": text}}, "tools[0]", strict=False)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 4_000_000  # 16 MB of schemas checked


def test_a_named_function_is_called_once_unless_parallel_calls_are_asked_for() -> None:
    """As OpenAI, vLLM and llama-server answer a tool_choice that names a function."""
    from specdec_native.openai_api import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice, parallel, one in (
        (named, None, True),
        (named, False, True),
        (named, True, False),
        ("required", None, False),
        ("auto", None, False),
        ("required", False, True),
    ):
        body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
        body |= {"tool_choice": choice, "parallel_tool_calls": parallel}
        tools_format = ChatCompletionRequest.model_validate(body).tool_format()
        assert tools_format is not None and tools_format.parallel is not one
        calls = json.dumps(tools_format.schema())
        assert ('"maxItems": 1' in calls) is one

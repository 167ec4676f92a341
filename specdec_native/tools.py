"""Tool calls: in the model's own format where its chat template has one, else in a generic
JSON format, for models whatever their chat template. Either way a grammar built from the
tools' parameter schemas holds the output to the format.

The generic format: the model sees the tools in a system message and answers with one JSON
object:

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    {"response": "It is sunny."}

Earlier calls and tool results in the conversation are written back in the same format: an
assistant's calls as its JSON, the tools' results as a user message (templates that only know
user and assistant turns take that too).

The "hermes" format, of chat templates that take `tools` and write calls in <tool_call> tags
(Qwen 2.5 and 3, QwQ, Hermes 2 Pro and 3, ...): the template renders the tools and the conversation,
calls included, and the model answers in text or with calls, one JSON object per tag:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The "llama3" format, of chat templates that take `tools` and write a call as the whole
message, one JSON object with its "parameters" (Llama 3.1-3.3's; their results come back as
"ipython" messages, which the template writes): the model answers in text or with one call:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

In all, `tool_choice` picks what the grammar allows ("auto": an answer or calls; "required":
calls; a named function: calls of it).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

MAX_TOOLS = 128
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def template_syntax(template: str) -> str:
    """The tool-call format a Jinja chat template's text writes: "hermes" where it takes the
    tools and writes calls as JSON ({"name": ..., "arguments": ...}) in <tool_call> tags;
    "llama3" where it writes a call as a message of JSON ({"name": ..., "parameters": ...})
    and results as "ipython" messages; else "generic" (a template that knows no tools, or
    writes calls another way: Qwen3-Coder's and GLM's XML inside the tags)."""
    if re.search(r"\btools\b", template) is None:
        return "generic"
    xml_calls = "<function=" in template or "<arg_key>" in template
    if CALL_OPEN in template and '"name"' in template and '"arguments"' in template:
        return "generic" if xml_calls else "hermes"
    if '"parameters"' in template and "ipython" in template:
        return "llama3"
    return "generic"


class ToolError(ValueError):
    """Tools, a tool choice or a conversation that cannot be used: the message names it."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolFormat:
    """What a request with tools asks of the output, and how to read it back."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"} per tool
    choice: str  # "auto", "required", or a function's name
    parallel: bool
    response_schema: dict[str, Any] | bool | None  # the answer's schema (response_format)
    syntax: str = "generic"  # how calls are written: "generic", "hermes" or "llama3"
    tag_tokens: bool = False  # the hermes tags are special tokens of the vocabulary

    def constraint(self) -> tuple[str, str]:
        """The grammar of the whole output, as (kind, text) for the engine."""
        if self.syntax == "hermes":
            return ("lark", self._hermes_grammar())
        if self.syntax == "llama3":
            return ("lark", self._llama3_grammar())
        return ("json_schema", json.dumps(self.schema()))

    def _calls(self, defs: dict[str, Any], arguments: str = "arguments") -> list[dict[str, Any]]:
        """The schema of each call the choice allows: {"name": ..., `arguments`: {...}}."""
        called = self.functions
        if self.choice not in ("auto", "required"):
            called = [f for f in self.functions if f["name"] == self.choice]
        return [
            _object(
                {
                    "name": {"const": f["name"]},
                    arguments: _embedded(_closed_arguments(f["parameters"]), f"tool{i}", defs),
                }
            )
            for i, f in enumerate(called)
        ]

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the whole output in the generic format."""
        defs: dict[str, Any] = {}
        calls = self._calls(defs)
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        out = _object({"tool_calls": array})
        if self.choice == "auto":
            answer = self.response_schema
            answer = {"type": "string"} if answer is None else _embedded(answer, "response", defs)
            out = {"anyOf": [out, _object({"response": answer})]}
        return {**out, "$defs": defs} if defs else out

    def _hermes_grammar(self) -> str:
        """The Lark grammar (llguidance's, with embedded JSON schemas) of the output in the
        hermes format: calls in tags, or (tool_choice "auto") an answer, text with no tag in
        it or JSON of the response format's schema. A text answer may go on into calls, as
        models write them ("Let me look that up." and a call), or after their thinking."""
        call = self._call_schema("arguments")
        # Tags that are special tokens (Qwen's) are written by name: their bytes spelt out
        # are text the model never saw.
        opened, closed = (
            (CALL_OPEN, CALL_CLOSE) if self.tag_tokens else (f'"{CALL_OPEN}"', f'"{CALL_CLOSE}"')
        )
        more = ' ("\\n" call)*' if self.parallel else ""
        lines = [
            f"calls: call{more}",
            f"call: {opened} body",
            f'body: "\\n" %json {json.dumps(call)} "\\n" {closed}',
        ]
        if self.choice != "auto":
            return "\n".join(["start: calls", *lines])
        if self.response_schema is not None:
            return "\n".join([f"start: calls | %json {json.dumps(self.response_schema)}", *lines])
        lines.append(f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{CALL_OPEN}(.|\\n)*/")
        if self.tag_tokens:
            lead = "TEXT call"  # the tag token ends the text
        else:
            # Text and the tag as one lexeme: the text alone would take the tag's first bytes.
            lead = "LEAD body"
            lines.append(f'LEAD: TEXT "{CALL_OPEN}"')
        return "\n".join([f"start: calls | TEXT | {lead}{more}", *lines])

    def _call_schema(self, arguments: str) -> dict[str, Any]:
        """The JSON schema of one call, written on one line and spaced as the templates write
        calls back (json.dumps)."""
        defs: dict[str, Any] = {}
        calls = self._calls(defs, arguments)
        call: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
        if defs:
            call = {**call, "$defs": defs}
        call["x-guidance"] = {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
        }
        return call

    def _llama3_grammar(self) -> str:
        """The Lark grammar of the output in the llama3 format: one call, the whole output,
        or (tool_choice "auto") an answer: text that does not open with "{", or JSON of the
        response format's schema."""
        schema = self._call_schema("parameters")
        call = f"%json {json.dumps(schema)}"
        if self.choice != "auto":
            return f"start: {call}"
        if self.response_schema is not None:
            # Both open with "{": llguidance needs the same JSON options on both, else it
            # drops the answer where it shares the call's lexemes ({"name": "...).
            answer = {} if self.response_schema is True else self.response_schema
            if isinstance(answer, dict):
                answer = {**answer, "x-guidance": schema["x-guidance"]}
            return f"start: {call} | %json {json.dumps(answer)}"
        return "\n".join([f"start: {call} | TEXT", "TEXT: /(.|\\n)+/ & ~/\\s*\\{(.|\\n)*/"])

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, tool calls); None for text that is not a complete output
        of the format (cut short by max_tokens, say)."""
        if self.syntax == "hermes":
            return read_hermes(text)
        if self.syntax == "llama3":
            return read_llama3(text, {f["name"] for f in self.functions})
        return read_output(text)

    def streamed(self) -> StreamedAnswer | StreamedText | StreamedUnlessCall:
        """A reader of the output as it comes, giving the answer's text once it is known."""
        if self.syntax == "hermes":
            return StreamedText()
        return StreamedUnlessCall() if self.syntax == "llama3" else StreamedAnswer()

    def instructions(self) -> str:
        """The system message's text that tells the model the tools and the format."""
        listed = json.dumps(self.functions, ensure_ascii=False)
        how = (
            'To call tools, answer {"tool_calls": [{"name": <tool>, "arguments": {...}}]}.'
            if self.choice != "auto"
            else 'Answer in JSON: {"tool_calls": [{"name": <tool>, "arguments": {...}}]} to '
            'call tools, or {"response": <your answer>} to answer the user.'
        )
        return f"You can use these tools:\n{listed}\n{how}"


def _embedded(schema: Any, name: str, defs: dict[str, Any]) -> Any:
    """`schema` for use inside the output's schema. One with local references ("#",
    "#/$defs/X": pydantic writes them) moves to the root's $defs under `name`, its references
    rewritten to point inside it, since "#" now means the output's root."""
    base = f"#/$defs/{name}"
    try:
        moved = _rebased(schema, base)
    except RecursionError:
        raise ToolError("tools: a schema is nested too deeply") from None
    if moved == schema:  # no local references: it stays where it is
        return schema
    defs[name] = moved
    return {"$ref": base}


_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: left as they are
# Keywords whose value maps names to schemas (there, a property named "default" is a schema).
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(keyword, value) for each value under `schema`'s keywords that may hold schemas: every
    value but those of data keywords, the members of name-to-schema maps one by one."""
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            yield from ((key, v) for v in value.values())
        else:
            yield key, value


def _rebuilt(schema: dict[str, Any], child: Callable[[str, Any], Any]) -> dict[str, Any]:
    """`schema` with each value _subschemas gives replaced by child(keyword, value)."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: child(key, v) for name, v in value.items()}
        else:
            out[key] = child(key, value)
    return out


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#...") moved under `base`."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema

    def child(key: str, value: Any) -> Any:
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            return base + value[1:]
        return _rebased(value, base)

    return _rebuilt(schema, child)


# Keywords whose subschemas combine with their neighbours' properties: an object there is a
# part of one, and closing it would refuse the other parts' properties.
_COMBINING = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "$ref")
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def _closed_arguments(schema: Any) -> Any:
    """A tool's parameters as the grammar holds them (_closed); as given where an object
    extends another (allOf, or a $ref beside keywords of its own: the shared definition must
    stay open) or asks for properties by count or dependency."""
    return schema if _extends(schema) else _closed(schema)


# What may stand beside a $ref without extending what it points to.
_ANNOTATIONS = {"$ref", "$defs", "definitions", "title", "description", "$comment", "default"}
_EXTENDING = ("allOf", "dependentRequired", "minProperties")


def _extends(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_extends(v) for v in schema)
    if not isinstance(schema, dict):
        return False
    if any(key in schema for key in _EXTENDING):
        return True
    if "$ref" in schema and set(schema) - _ANNOTATIONS - set(_DATA_KEYWORDS):
        return True
    return any(_extends(v) for _, v in _subschemas(schema))


def _closed(schema: Any, part: bool = False) -> Any:
    """`schema` with objects that list their properties closed to others where it does not say
    (additionalProperties false), as llama.cpp reads tool schemas: a function takes no
    arguments it does not name, and small models asked for open objects invent keys. Objects
    that are a part of a combination (`part`, or beside allOf, anyOf, $ref ...) stay as
    they are, and so do those that require a property they do not list."""
    if isinstance(schema, list):
        return [_closed(v, part) for v in schema]
    if not isinstance(schema, dict):
        return schema
    # Under a combining keyword (dependentSchemas' members included) a subschema is a part.
    out = _rebuilt(schema, lambda key, value: _closed(value, key in _COMBINING))
    listed = out.get("properties")
    required = out.get("required", [])
    if (
        not part
        and isinstance(listed, dict)
        and not set(out) & {*_OPEN_KEYWORDS, *_COMBINING}
        and isinstance(required, list)
        and all(isinstance(name, str) and name in listed for name in required)
    ):
        out["additionalProperties"] = False
    return out


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def tool_format(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel: bool | None,
    response_schema: dict[str, Any] | bool | None,
    syntax: str = "generic",
    tag_tokens: bool = False,
) -> ToolFormat | None:
    """The format a request's `tools` and `tool_choice` ask for, calls written in `syntax`;
    None where no tool may be called (no tools, or tool_choice "none")."""
    functions = [_function(t) for t in tools or []]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools: two tools have the same name")
    if len(functions) > MAX_TOOLS:
        raise ToolError(f"tools: at most {MAX_TOOLS} tools, got {len(functions)}")
    choice = _choice(tool_choice, bool(functions))
    if choice == "none" or not functions:
        return None
    if choice not in ("auto", "required") and choice not in names:
        raise ToolError(f"tool_choice: no tool is named {choice!r}")
    return ToolFormat(functions, choice, parallel is not False, response_schema, syntax, tag_tokens)


def _function(tool: Any) -> dict[str, Any]:
    function = tool.function
    parameters = function.parameters
    if parameters is None or parameters == {}:
        parameters = {"type": "object"}
    out = {"name": function.name}  # in OpenAI's order, as templates show them
    if function.description:
        out["description"] = function.description
    return {**out, "parameters": parameters}


def _choice(tool_choice: Any, have_tools: bool) -> str:
    if tool_choice is None:
        return "auto" if have_tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice in ("required", "auto") and not have_tools:
            raise ToolError(f"tool_choice: {tool_choice!r} needs tools")
        return tool_choice
    if not have_tools:
        raise ToolError("tool_choice: names a function but no tools were given")
    return str(tool_choice.function.name)


def conversation(
    messages: list[tuple[str, str | None, list[ToolCall], str | None]],
    format: ToolFormat | None,
) -> list[dict[str, str]]:
    """The messages as the chat template takes them: (role, content, tool_calls,
    tool_call_id) each; the tools' instructions in the system message; calls and results
    written in the generic format."""
    out: list[dict[str, str]] = []
    after_tool = False  # consecutive tool results share one user message
    for role, content, calls, call_id in messages:
        if role == "tool":
            result = {"tool_response": {"tool_call_id": call_id, "content": content or ""}}
            text = json.dumps(result, ensure_ascii=False)
            if after_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and calls:
            listed = [{"name": c.name, "arguments": _arguments(c)} for c in calls]
            content = json.dumps({"tool_calls": listed}, ensure_ascii=False)
        out.append({"role": role, "content": content or ""})
    if format is not None:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {
                "role": "system",
                "content": out[0]["content"] + "\n\n" + format.instructions(),
            }
        else:
            out.insert(0, {"role": "system", "content": format.instructions()})
    return out


def template_conversation(
    messages: list[tuple[str, str | None, list[ToolCall], str | None]],
) -> list[dict[str, Any]]:
    """The messages as a chat template that knows tools takes them: (role, content,
    tool_calls, tool_call_id) each, calls with their arguments as objects."""
    out: list[dict[str, Any]] = []
    for role, content, calls, call_id in messages:
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments(c)},
                }
                for c in calls
            ]
        if role == "tool" and call_id is not None:
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except (json.JSONDecodeError, RecursionError):
        raise ToolError(
            f"messages: the arguments of tool call {call.id!r} are not JSON: {call.arguments!r}"
        ) from None


def read_output(text: str) -> tuple[str | None, list[ToolCall]]:
    """The generated JSON as (content, tool calls); None for text that is not a complete
    output of the format (cut short by max_tokens, say)."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None, []
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        calls = [
            ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False))
            for c in value["tool_calls"]
        ]
        return None, calls
    if isinstance(value, dict) and "response" in value:
        answer = value["response"]
        return (answer if isinstance(answer, str) else json.dumps(answer)), []
    return None, []


def read_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Output in the hermes format as (content, tool calls): text with no tag is an answer;
    text before the first tag is the content beside the calls (None when there is none);
    calls must be complete tags of JSON objects with a name and arguments, else None, []. The
    grammar writes each call on three lines (tag, JSON on one line, tag), so it is read line
    by line, in linear time whatever the output."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    lines = text[start:].split("\n")
    if len(lines) % 3:
        return None, []
    calls = []
    for i in range(0, len(lines), 3):
        opened, body, closed = lines[i : i + 3]
        if opened != CALL_OPEN or closed != CALL_CLOSE:
            return None, []
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, RecursionError):
            return None, []
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None, []
        arguments = value.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(value["name"], arguments))
    return text[:start].rstrip() or None, calls


def read_llama3(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Output in the llama3 format as (content, tool calls): text that opens with "{" is a
    call, a JSON object with a name and parameters (else None, []); other text is an answer."""
    if not text.lstrip().startswith("{"):
        return text, []
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None, []
    if (
        not isinstance(value, dict)
        or set(value) != {"name", "parameters"}
        or not isinstance(value["name"], str)
        or (names is not None and value["name"] not in names)
    ):
        return None, []  # not a call (a JSON answer of the response format, say): text
    arguments = value["parameters"]
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return None, [ToolCall(value["name"], arguments)]


class StreamedUnlessCall:
    """Reads llama3 output as it comes: text is the answer, given as it comes once its first
    character that is no space is not "{"; a call is read whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.streamed = ""  # the answer's text given so far
        self._answer: bool | None = None  # None: not known yet

    def feed(self, piece: str) -> Iterator[str]:
        self.text += piece
        if self._answer is None:
            head = self.text.lstrip()
            if not head:
                return
            self._answer = not head.startswith("{")
        if self._answer and len(self.text) > len(self.streamed):
            given = self.text[len(self.streamed) :]
            self.streamed = self.text
            yield given


class StreamedText:
    """Reads hermes output as it comes: its text is given as it comes, but for what could
    still be the start of a call's tag or the spaces before one; once a tag comes, the rest
    is calls, read whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.streamed = ""  # the text given so far
        self._calls = False  # a tag came: the rest is calls

    def feed(self, piece: str) -> Iterator[str]:
        # Only the new text and the tag's length before it can hold a tag not seen yet.
        seen = max(len(self.text) - len(CALL_OPEN) + 1, 0)
        self.text += piece
        if self._calls:
            return
        end = self.text.find(CALL_OPEN, seen)
        if end >= 0:
            self._calls = True
        else:
            end = len(self.text) - _tag_start(self.text)
        given = self.text[len(self.streamed) : end].rstrip()
        if given:
            self.streamed += given
            yield given


def _tag_start(text: str) -> int:
    """The length of the longest end of `text` that a call's tag starts with."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


_ANSWER_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')


class StreamedAnswer:
    """Reads the output as it comes and gives the answer's text as soon as it is known: the
    characters of {"response": "..."} once decoded. Tool calls (and answers that are not
    strings) are read whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self._start: int | None = None  # where the answer's string starts in text
        self._given = 0  # characters of the string's raw text already given
        self.streamed = ""  # the answer's text given so far

    def feed(self, piece: str) -> Iterator[str]:
        self.text += piece
        if self._start is None:
            match = _ANSWER_START.match(self.text)
            if match is None:
                return
            self._start = match.end()
        raw = self.text[self._start :]
        end = _complete_prefix(raw, self._given)
        if end > self._given:
            try:
                decoded = json.loads('"' + raw[self._given : end] + '"')
            except json.JSONDecodeError:  # not the format after all: read whole at the end
                self._start = len(self.text) + 1
                return
            self._given = end
            self.streamed += decoded
            yield decoded


def _complete_prefix(raw: str, start: int) -> int:
    """How much of a JSON string's raw text (no opening quote) decodes whole: up to its closing
    quote or an escape not yet complete; a high surrogate waits for its pair."""
    i = start
    while i < len(raw):
        c = raw[i]
        if c == '"':
            break
        if c != "\\":
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            i += 2
            continue
        if i + 6 > len(raw):
            break
        try:
            code = int(raw[i + 2 : i + 6], 16)
        except ValueError:  # not JSON: nothing past it decodes
            break
        if 0xD800 <= code < 0xDC00:  # a pair: \ud83d\ude00
            if i + 12 > len(raw):
                break
            i += 12
        else:
            i += 6
    return i

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
(Qwen 2.5 and 3, QwQ, Hermes 2 Pro and 3, ...): the template renders the tools and the
conversation, calls included, and the model answers in text or with calls, one JSON object
per tag:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The "llama3" format, of chat templates that take `tools` and write a call as the whole
message, one JSON object with its "parameters" (Llama 3.1-3.3's; their results come back as
"ipython" messages, which the template writes): the model answers in text or with one call:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

The "mistral" format, of chat templates that take `tools` and write calls as one JSON array
after [TOOL_CALLS] (Mistral 7B v0.3's, Nemo's): the model answers in text or with calls
(an "id" as the templates write them back may follow the arguments; the template sees each
call's id as 9 letters and digits, the only ids these templates take):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]

In all, `tool_choice` picks what the grammar allows ("auto": an answer or calls; "required":
calls; a named function: calls of it).
"""

from __future__ import annotations

import decimal
import hashlib
import json
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

MAX_TOOLS = 128
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_NINE = re.compile(r"[A-Za-z0-9]{9}")
# JSON under a schema is written compactly unless the schema says otherwise (its own
# "x-guidance"): one space after ':' and ',', no newlines. Keys and punctuation are then forced,
# so they are drafted for free, and no token goes to whitespace a small model may loop on.
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
# The same for a schema a client did not send as strict: keywords llguidance cannot enforce
# (uniqueItems, not, if, contains, ...) are left out of the grammar, as llama-server leaves
# them out of its own, where strict they are refused (OpenAI refuses them too).
LENIENT_JSON = {**COMPACT_JSON, "lenient": True}


class ToolError(ValueError):
    """Tools, a tool choice or a conversation that cannot be used: the message names it."""


def with_json_options(schema: Any, options: dict[str, Any]) -> Any:
    """`schema` with `options` as its "x-guidance", under its own where it has one; lenient
    only where `options` are (a strict schema's own options cannot make it lenient)."""
    if not isinstance(schema, dict):
        return schema
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):  # llguidance names what is wrong with it
        return schema
    merged = {**options, **own}
    if not options.get("lenient"):
        merged.pop("lenient", None)
    return {**schema, "x-guidance": merged}


def check_schema(schema: Any, where: str, strict: bool, what: str = "") -> None:
    """A ToolError naming `where` (and `what` it is) for a schema llguidance refuses; `strict`,
    also for one with keywords it cannot enforce."""
    if not isinstance(schema, dict):  # true or false: the engine says what false means
        return
    options = COMPACT_JSON if strict else LENIENT_JSON
    try:
        text = json.dumps(with_json_options(schema, options), sort_keys=True)
        why = _refusals.get(text)
    except RecursionError:
        raise ToolError(f"{where}: the schema is nested too deeply") from None
    if why:
        if strict and "Unimplemented" in why:
            why += ' (sent without "strict": true, such keywords are not enforced)'
        raise ToolError(f"{where}: {what + ': ' if what else ''}{why}")


def _refusal(schema: str) -> str:
    """Why llguidance refuses a JSON schema ("" if it does not)."""
    from llguidance import LLMatcher

    grammar = LLMatcher.grammar_from_json_schema(schema)
    refused, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return "; ".join(messages) if refused else ""


class _Refusals:
    """_refusal remembered for the latest schemas, by their digest: agents send the same tools
    with every request, and a schema's text may be megabytes (a client sending many must not
    make the server keep them)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._seen: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, schema: str) -> str:
        key = hashlib.sha256(schema.encode()).digest()
        with self._lock:
            if key in self._seen:
                self._seen.move_to_end(key)
                return self._seen[key]
        why = _refusal(schema)
        with self._lock:
            self._seen[key] = why
            while len(self._seen) > self._size:
                self._seen.popitem(last=False)
        return why


_refusals = _Refusals(256)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    id: str = field(default_factory=_call_id)

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


class Streamed(Protocol):
    """Reads an output with tools as it comes, giving its answer's text once it is known."""

    streamed: str  # the answer's text given so far

    def feed(self, piece: str) -> Iterator[str]: ...


class Message(NamedTuple):
    """A chat message as the tool formats take it."""

    role: str
    content: str | None
    calls: list[ToolCall]
    call_id: str | None  # a tool message's: the call it answers
    name: str | None = None  # OpenAI's participant name, or a tool message's function


class ToolSyntax:
    """How tool calls are written, one object per format. This one is the generic format,
    for any chat template: the server lists the tools in the system message and reads one
    JSON object back. The others are the formats of Jinja templates that take `tools`."""

    name = "generic"
    templated = False  # the chat template renders the tools and the calls
    tags: tuple[str, ...] = ()  # texts that a vocabulary may hold as one special token each

    def takes(self, template: str) -> bool:
        """Whether a Jinja template (one that names `tools`) writes calls this way."""
        return True

    def grammar(self, fmt: ToolFormat) -> tuple[str, str]:
        """The grammar of the whole output, as (kind, text) for the engine."""
        return ("json_schema", json.dumps(fmt.schema()))

    def read(self, fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, tool calls); None, [] for text that is not a complete
        output of the format (cut short by max_tokens, say)."""
        return read_output(text, json_answer=fmt.response_schema is not None)

    def reader(self, fmt: ToolFormat) -> Streamed:
        # An answer under a response format is JSON text, given whole at the end.
        return StreamedAnswer() if fmt.response_schema is None else ReadAtEnd()

    def chat(
        self, messages: list[Message], fmt: ToolFormat | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and the tools as the chat template takes them."""
        return conversation(messages, fmt), None

    def __repr__(self) -> str:
        return f"<tool syntax {self.name}>"

    def __eq__(self, other: object) -> bool:
        """A format is its name too: ``decoder.tool_syntax == "hermes"``."""
        if isinstance(other, str):
            return other == self.name
        return isinstance(other, ToolSyntax) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class _Templated(ToolSyntax):
    templated = True

    def chat(
        self, messages: list[Message], fmt: ToolFormat | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        listed = None if fmt is None else fmt.template_tools()
        return template_conversation(messages, self.template_id), listed

    def template_id(self, call_id: str) -> str:
        """A call's id as the template takes it."""
        return call_id


class _Hermes(_Templated):
    """Calls as JSON ({"name", "arguments"}) in <tool_call> tags, one per line."""

    name = "hermes"
    tags = (CALL_OPEN, CALL_CLOSE)

    def takes(self, template: str) -> bool:
        # Qwen3-Coder's and GLM's XML inside the same tags is another format.
        xml_calls = "<function=" in template or "<arg_key>" in template
        written = CALL_OPEN in template and '"name"' in template and '"arguments"' in template
        return written and not xml_calls

    def grammar(self, fmt: ToolFormat) -> tuple[str, str]:
        call = json.dumps(fmt.json_calls("arguments"))
        body = f'"\\n" %json {call} "\\n" {fmt.tag(CALL_CLOSE)}'
        return ("lark", _tagged_grammar(fmt, CALL_OPEN, body, '"\\n"'))

    def read(self, fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
        return read_hermes(text, fmt.names)

    def reader(self, fmt: ToolFormat) -> Streamed:
        return StreamedText(CALL_OPEN)


class _Llama3(_Templated):
    """A call as the whole message: one JSON object with its "parameters"."""

    name = "llama3"

    def takes(self, template: str) -> bool:
        return '"parameters"' in template and "ipython" in template

    def grammar(self, fmt: ToolFormat) -> tuple[str, str]:
        """One call, the whole output, or (tool_choice "auto") an answer: text that does not
        open with "{", or JSON of the response format's schema."""
        schema = fmt.json_calls("parameters")
        call = f"%json {json.dumps(schema)}"
        if fmt.choice != "auto":
            return ("lark", f"start: {call}")
        if fmt.response_schema is not None:
            # Both open with "{": llguidance needs the same JSON options on both, else it
            # drops the answer where it shares the call's lexemes ({"name": "...).
            answer = {} if fmt.response_schema is True else fmt.response_schema
            if isinstance(answer, dict):
                answer = {**answer, "x-guidance": schema["x-guidance"]}
            return ("lark", f"start: {call} | %json {json.dumps(answer)}")
        text = "TEXT: /(.|\\n)+/ & ~/\\s*\\{(.|\\n)*/"
        return ("lark", "\n".join([f"start: {call} | TEXT", text]))

    def read(self, fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
        return read_llama3(text, fmt.names)

    def reader(self, fmt: ToolFormat) -> Streamed:
        return StreamedUnlessCall()


class _Mistral(_Templated):
    """Calls as one JSON array after [TOOL_CALLS], each {"name", "arguments"} and maybe an
    "id" of 9 letters and digits, as the templates write them back."""

    name = "mistral"
    tags = (MISTRAL_CALLS,)

    def takes(self, template: str) -> bool:
        # Newer templates write `[TOOL_CALLS]name[ARGS]{...}`: another format.
        return MISTRAL_CALLS in template and "[ARGS]" not in template

    def grammar(self, fmt: ToolFormat) -> tuple[str, str]:
        calls = json.dumps(fmt.json_calls("arguments", with_id=True, array=True))
        # Templates write the tag with a space after it (Mistral 7B v0.3) or none (Nemo).
        return ("lark", _tagged_grammar(fmt, MISTRAL_CALLS, f'" "? %json {calls}', None))

    def read(self, fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
        return read_mistral(text, fmt.names)

    def reader(self, fmt: ToolFormat) -> Streamed:
        return StreamedText(MISTRAL_CALLS)

    def chat(
        self, messages: list[Message], fmt: ToolFormat | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        for i, m in enumerate(messages):
            if m.role == "tool" and m.call_id is None:
                raise ToolError(
                    f"messages[{i}]: a tool message needs the tool_call_id of its call "
                    "(this chat template writes each result with its call's id)"
                )
        return super().chat(messages, fmt)

    def template_id(self, call_id: str) -> str:
        # Mistral's templates refuse ids that are not 9 letters and digits (some, shorter
        # ones): others are mapped to 9 hex digits, the same for a call and its result.
        if _NINE.fullmatch(call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]


GENERIC, HERMES, LLAMA3, MISTRAL = ToolSyntax(), _Hermes(), _Llama3(), _Mistral()
SYNTAXES = (HERMES, LLAMA3, MISTRAL)  # in the order they are tried on a template


def template_syntax(template: str) -> ToolSyntax:
    """The tool-call format a Jinja chat template's text writes: one of SYNTAXES where it
    takes the tools and writes calls that way, else GENERIC (a template that knows no tools,
    or writes calls another way)."""
    if re.search(r"\btools\b", template) is None:
        return GENERIC
    return next((s for s in SYNTAXES if s.takes(template)), GENERIC)


def _tagged_grammar(fmt: ToolFormat, tag: str, body: str, separator: str | None) -> str:
    """The Lark grammar (llguidance's, with embedded JSON schemas) of calls that each open
    with `tag` and go on with `body`, one after another with `separator` between them (None:
    one tag for all); with tool_choice "auto", or an answer: text with no tag in it, or JSON
    of the response format's schema. A text answer may go on into calls, as models write
    them ("Let me look that up." and a call), or after their thinking."""
    opened = fmt.tag(tag)
    more = f" ({separator} call)*" if fmt.parallel and separator else ""
    lines = [f"calls: call{more}", f"call: {opened} body", f"body: {body}"]
    if fmt.choice != "auto":
        return "\n".join(["start: calls", *lines])
    if fmt.response_schema is not None:
        answer = json.dumps(with_json_options(fmt.response_schema, LENIENT_JSON))
        return "\n".join([f"start: calls | %json {answer}", *lines])
    # A "/" would end Lark's regex.
    escaped = re.escape(tag).replace("/", "\\/")
    lines.append(f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{escaped}(.|\\n)*/")
    if tag in fmt.tag_tokens:
        lead = "TEXT call"  # the tag token ends the text
    else:
        # Text and the tag as one lexeme: the text alone would take the tag's first bytes.
        lead = "LEAD body"
        lines.append(f"LEAD: TEXT {opened}")
    return "\n".join([f"start: calls | TEXT | {lead}{more}", *lines])


@dataclass(frozen=True)
class ToolFormat:
    """What a request with tools asks of the output, and how to read it back."""

    functions: list[dict[str, Any]]  # {"name", "description", "parameters"} per tool
    choice: str  # "auto", "required", or a function's name
    parallel: bool
    response_schema: dict[str, Any] | bool | None  # the answer's schema (response_format)
    syntax: ToolSyntax = GENERIC  # how calls are written
    # The syntax's tags that are special tokens of the vocabulary, with their ids.
    tag_tokens: Mapping[str, int] = field(default_factory=dict)

    def constraint(self) -> tuple[str, str]:
        """The grammar of the whole output, as (kind, text) for the engine."""
        return self.syntax.grammar(self)

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The output as (content, tool calls); None, [] for text that is not a complete
        output of the format (cut short by max_tokens, say)."""
        return self.syntax.read(self, text)

    def streamed(self) -> Streamed:
        """A reader of the output as it comes, giving the answer's text once it is known."""
        return self.syntax.reader(self)

    def output(self, text: str, streamed: str | None = None) -> tuple[str, list[ToolCall]]:
        """The output as (content, calls), given what of its content a stream gave as it came
        (`streamed`; None: what a stream would have given): streamed or not, a client gets
        the same content. Output that is not the format after all (cut short by max_tokens,
        say) is its text as it is, but for an answer whose text was streamed (a JSON string
        cut short): that text."""
        if streamed is None:
            reader = self.streamed()
            for _ in reader.feed(text):
                pass
            streamed = reader.streamed
        content, calls = self.read(text)
        if content is None and not calls:
            content = text
        content = content or ""
        return (content if content.startswith(streamed) else streamed), calls

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def tag(self, text: str) -> str:
        """A tag as a Lark grammar writes it: by id where it is one special token (the token
        the model was trained on, not its spelling), else its text."""
        token = self.tag_tokens.get(text)
        return json.dumps(text) if token is None else f"<[{token}]>"

    def _calls(
        self, defs: dict[str, Any], arguments: str = "arguments", with_id: bool = False
    ) -> list[dict[str, Any]]:
        """The schema of each call the choice allows: {"name": ..., `arguments`: {...}}, and
        an optional "id" of 9 letters and digits `with_id`."""
        called = self.functions
        if self.choice not in ("auto", "required"):
            called = [f for f in self.functions if f["name"] == self.choice]
        out = []
        for i, f in enumerate(called):
            call = _object(
                {
                    "name": {"const": f["name"]},
                    arguments: _embedded(_closed_arguments(f["parameters"]), f"tool{i}", defs),
                }
            )
            if with_id:
                call["properties"]["id"] = {"type": "string", "pattern": f"^{_NINE.pattern}$"}
            out.append(call)
        return out

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
        out = {**out, "$defs": defs} if defs else out
        return {**out, "x-guidance": LENIENT_JSON}  # strict schemas were checked alone

    def json_calls(
        self, arguments: str, with_id: bool = False, array: bool = False
    ) -> dict[str, Any]:
        """The JSON schema of one call (or, `array`, of a list of them, one with
        parallel_tool_calls false), written on one line and spaced as the templates write
        calls back (json.dumps)."""
        defs: dict[str, Any] = {}
        calls = self._calls(defs, arguments, with_id)
        out: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
        if array:
            out = {"type": "array", "items": out, "minItems": 1}
            if not self.parallel:
                out["maxItems"] = 1
        if defs:
            out = {**out, "$defs": defs}
        out["x-guidance"] = LENIENT_JSON  # strict tools were checked alone (tool_format)
        return out

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

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
    syntax: ToolSyntax = GENERIC,
    tag_tokens: Mapping[str, int] | None = None,
) -> ToolFormat | None:
    """The format a request's `tools` and `tool_choice` ask for, calls written in `syntax`
    (`tag_tokens`: its tags that are special tokens, with their ids); None where no tool may
    be called (no tools, or tool_choice "none")."""
    if len(tools or []) > MAX_TOOLS:
        raise ToolError(f"tools: at most {MAX_TOOLS} tools, got {len(tools or [])}")
    functions = [_function(t, i) for i, t in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools: two tools have the same name")
    choice = _choice(tool_choice, bool(functions))
    if choice == "none" or not functions:
        return None
    named = choice not in ("auto", "required")
    if named and choice not in names:
        raise ToolError(f"tool_choice: no tool is named {choice!r}")
    # A named function is called once, as OpenAI, vLLM and llama-server answer it, unless
    # parallel_tool_calls asks for more.
    parallel = parallel is True if named else parallel is not False
    return ToolFormat(functions, choice, parallel, response_schema, syntax, dict(tag_tokens or {}))


def _function(tool: Any, i: int) -> dict[str, Any]:
    function = tool.function
    parameters = function.parameters
    if parameters is None or parameters == {}:
        parameters = {"type": "object"}
    where, strict = f"tools[{i}].function.parameters", function.strict is True
    check_schema(parameters, where, strict, f"the schema of {function.name}")
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
    messages: list[Message],
    format: ToolFormat | None,
) -> list[dict[str, str]]:
    """The messages as the chat template takes them: (role, content, tool_calls,
    tool_call_id) each; the tools' instructions in the system message; calls and results
    written in the generic format."""
    out: list[dict[str, str]] = []
    after_tool = False  # consecutive tool results share one user message
    for role, content, calls, call_id, name in messages:
        if role == "tool":
            response = {"tool_call_id": call_id, **_named(name), "content": content or ""}
            result = {"tool_response": response}
            text = json.dumps(result, ensure_ascii=False)
            if after_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and calls:
            if content:  # text the calls came with (another model's, say): its own message
                out.append({"role": role, "content": content} | _named(name))
            listed = [{"name": c.name, "arguments": _arguments(c)} for c in calls]
            content = json.dumps({"tool_calls": listed}, ensure_ascii=False)
        out.append({"role": role, "content": content or ""} | _named(name))
    if format is not None:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {
                "role": "system",
                "content": out[0]["content"] + "\n\n" + format.instructions(),
            }
        else:
            out.insert(0, {"role": "system", "content": format.instructions()})
    return out


def _named(name: str | None) -> dict[str, str]:
    """A message's name for the chat template (llama.cpp's Jinja rendering passes it too)."""
    return {} if name is None else {"name": name}


def template_conversation(
    messages: list[Message], template_id: Callable[[str], str] = str
) -> list[dict[str, Any]]:
    """The messages as a chat template that knows tools takes them: (role, content,
    tool_calls, tool_call_id) each, calls with their arguments as objects and their ids as
    `template_id` gives them."""
    out: list[dict[str, Any]] = []
    for role, content, calls, call_id, name in messages:
        message: dict[str, Any] = {"role": role, "content": content or ""} | _named(name)
        if calls:
            message["tool_calls"] = [
                {
                    "id": template_id(c.id),
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments(c)},
                }
                for c in calls
            ]
        if role == "tool" and call_id is not None:
            message["tool_call_id"] = template_id(call_id)
        out.append(message)
    return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.arguments)
    except (json.JSONDecodeError, RecursionError):
        raise ToolError(
            f"messages: the arguments of tool call {call.id!r} are not JSON: {call.arguments!r}"
        ) from None


def read_output(text: str, json_answer: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The generated JSON as (content, tool calls); None for text that is not a complete
    output of the format (cut short by max_tokens, say). `json_answer`: the answer is JSON
    under a response format, given as JSON text even when it is a string."""
    try:
        value = _parse_json(text)
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            calls = [ToolCall(c["name"], _json_text(c["arguments"])) for c in value["tool_calls"]]
            return None, calls
        if isinstance(value, dict) and "response" in value:
            answer = value["response"]
            plain = isinstance(answer, str) and not json_answer
            return (answer if plain else _json_text(answer)), []
    except (ValueError, RecursionError):
        pass
    return None, []


def _parse_json(text: str) -> Any:
    """JSON text as values whose numbers keep what was written (1e999 is no float)."""
    return json.loads(text, parse_float=decimal.Decimal, parse_constant=_not_json)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _json_text(value: Any) -> str:
    """A value _parse_json read, as JSON text again, its numbers as written."""
    if isinstance(value, dict):
        items = (f"{_json_text(k)}: {_json_text(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_json_text(v) for v in value) + "]"
    if isinstance(value, decimal.Decimal):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def read_hermes(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Output in the hermes format as (content, tool calls): text with no tag is an answer;
    text before the first tag is the content beside the calls (None when there is none);
    calls must be complete tags of calls (_read_call), else None, []. The grammar writes each
    call on three lines (tag, JSON on one line, tag), so it is read line by line, in linear
    time whatever the output."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    lines = text[start:].split("\n")
    if len(lines) % 3:
        return None, []
    calls = []
    for i in range(0, len(lines), 3):
        opened, body, closed = lines[i : i + 3]
        call = _read_call(body, "arguments", names)
        if opened != CALL_OPEN or closed != CALL_CLOSE or call is None:
            return None, []
        calls.append(call)
    return text[:start].rstrip() or None, calls


def read_llama3(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Output in the llama3 format as (content, tool calls): text that opens with "{" is a
    call (_read_call), else None, [] (a JSON answer of the response format, say); other text
    is an answer."""
    if not text.lstrip().startswith("{"):
        return text, []
    call = _read_call(text, "parameters", names)
    return (None, []) if call is None else (None, [call])


def read_mistral(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Output in the mistral format as (content, tool calls): text with no [TOOL_CALLS] is an
    answer; text before it is the content beside the calls (None when there is none); after
    it, a JSON array of calls (_read_call, an "id" allowed: the call gets one of its own,
    as a model's may repeat), else None, []."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return text, []
    try:
        listed = _parse_json(text[start + len(MISTRAL_CALLS) :])
        if not isinstance(listed, list) or not listed:
            return None, []
        calls = [_call_of(value, "arguments", names, ("id",)) for value in listed]
    except (ValueError, RecursionError):
        return None, []
    if not all(calls):
        return None, []
    return text[:start].rstrip() or None, [c for c in calls if c is not None]


def _read_call(text: str, arguments: str, names: set[str] | None) -> ToolCall | None:
    """A call written as JSON text (_call_of), or None."""
    try:
        value = _parse_json(text)
        return _call_of(value, arguments, names)
    except (ValueError, RecursionError):
        return None


def _call_of(
    value: Any, arguments: str, names: set[str] | None, optional: tuple[str, ...] = ()
) -> ToolCall | None:
    """A call: an object with a "name" (one of `names`, where given) and its `arguments`,
    and of the `optional` keys no others; else None."""
    if not isinstance(value, dict) or not {"name", arguments} <= set(value):
        return None
    if set(value) - {"name", arguments, *optional}:
        return None
    name = value["name"]
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    given = value[arguments]
    if isinstance(given, str):  # arguments a model wrote as a string of JSON
        try:
            given = _parse_json(given)
        except (ValueError, RecursionError):
            pass
    return ToolCall(name, _json_text(given))


class ReadAtEnd:
    """Gives nothing as the output comes: all of it is read at the end."""

    streamed = ""

    def feed(self, piece: str) -> Iterator[str]:
        yield from ()


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
    """Reads output whose calls open with `tag` (hermes, mistral) as it comes: its text is
    given as it comes, but for what could still be the start of the tag or the spaces before
    it; once the tag comes, the rest is calls, read whole at the end."""

    def __init__(self, tag: str = CALL_OPEN) -> None:
        self.tag = tag
        self.text = ""
        self.streamed = ""  # the text given so far
        self._calls = False  # a tag came: the rest is calls

    def feed(self, piece: str) -> Iterator[str]:
        # Only the new text and the tag's length before it can hold a tag not seen yet.
        seen = max(len(self.text) - len(self.tag) + 1, 0)
        self.text += piece
        if self._calls:
            return
        end = self.text.find(self.tag, seen)
        if end >= 0:
            self._calls = True
        else:
            end = len(self.text) - _tag_start(self.text, self.tag)
        given = self.text[len(self.streamed) : end].rstrip()
        if given:
            self.streamed += given
            yield given


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
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

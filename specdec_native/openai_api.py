"""The server's request bodies: OpenAI's chat and completion requests (and llama.cpp's
`speculative` object) as pydantic models, read from JSON within bounds.

Every bound is here: the body's size, its nesting, its numbers, the `stop` list. A body that
breaks one is a `BodyError` naming the field, never an exception from deep inside a parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Callable, Literal, Optional, TypeVar, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .tools import (
    COMPACT_JSON,
    GENERIC,
    LENIENT_JSON,
    ToolCall,
    ToolError,
    ToolFormat,
    ToolSyntax,
    check_schema,
    tool_format,
    with_json_options,
)
from .tools import Message as ToolMessage

MAX_BODY_BYTES = 4 << 20
STRICT_DESCRIPTION = (
    "true: a schema keyword that cannot be enforced is a 400 (uniqueItems, not, if, contains, "
    "...); otherwise such keywords are ignored and the rest enforced"
)
MAX_NUMBER_DIGITS = 20  # 2**64 - 1 has 20: no field means anything past it
MAX_STOPS = 16  # OpenAI takes 4; llama.cpp users send a few more
MAX_STOP_CHARS = 512
MAX_SPECULATIVE = 64
MAX_INT = 1 << 30
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # a request's choices (n, times its prompts): each takes a slot
MAX_LOGIT_BIAS = 1024
MAX_GRAMMAR_CHARS = 1 << 20
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _used_unless(off: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Whether a field's value asks for something: not None and not what `off` accepts (a value
    of the wrong type asks for something this server cannot tell)."""

    def used(value: Any) -> bool:
        if value is None:
            return False
        try:
            return not off(value)
        except TypeError:
            return True

    return used


def _at_most(limit: float) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and v <= limit


# Fields that would change what is generated and that this server does not implement, OpenAI's
# and llama-server's (its samplers, set to anything but off): a request using them gets a 400
# rather than a silently different answer. llama.cpp's web UI sends the off values.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "suffix": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
    "typical_p": _used_unless(lambda v: not isinstance(v, bool) and v >= 1),
    "mirostat": _used_unless(lambda v: v == 0 and not isinstance(v, bool)),
    "dynatemp_range": _used_unless(_at_most(0)),
    "top_n_sigma": _used_unless(_at_most(0)),
    "xtc_probability": _used_unless(_at_most(0)),
    "dry_multiplier": _used_unless(_at_most(0)),
    "n_probs": _used_unless(_at_most(0)),
    "min_keep": _used_unless(_at_most(1)),  # a sampler always keeps one token
    "grammar_lazy": _used_unless(lambda v: v is False),
    "lora": _used_unless(lambda v: v == []),
    "modalities": _used_unless(lambda v: v == ["text"]),  # this server writes text only
    "audio": lambda v: v is not None,
}


class BodyError(ValueError):
    """A body the server refuses: `status` (400 or 413), a message, the field it concerns."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def _null_is_off(cls: Any, value: Any) -> Any:
    """A switch sent as null is off, as OpenAI reads its nullable switches (stream, echo)."""
    return False if value is None else value


class _Body(BaseModel):
    # Strict: "1" is not a number, 1.0 not an integer, 1 not a boolean. Unknown fields (a
    # client's "user", "metadata", ...) are ignored, as OpenAI does.
    model_config = ConfigDict(strict=True, extra="ignore")


class Speculative(_Body):
    """llama.cpp's per-request speculation settings."""

    model_config = ConfigDict(strict=True, extra="forbid")
    n_max: Optional[int] = Field(None, ge=0, le=MAX_SPECULATIVE, description="K; 0: no drafting")
    n_min: int = Field(0, ge=0, le=MAX_SPECULATIVE, description="accepted; speed only")
    p_min: float = Field(0.0, ge=0.0, le=1.0, description="stop a draft below this probability")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema."""

    name: Optional[str] = Field(None, max_length=256)
    description: Optional[str] = None
    json_schema: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: Optional[bool] = Field(None, description=STRICT_DESCRIPTION)


class ResponseFormat(_Body):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None
    # llama-server's shorthand: {"type": "json_object", "schema": {...}}
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of an object")
    strict: Optional[bool] = Field(None, description=STRICT_DESCRIPTION)

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, schema: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # Arguments are a JSON object: a call's arguments string holds one.
        if schema is not None and schema.get("type", "object") != "object":
            raise ValueError('must be the schema of an object ("type": "object")')
        return schema


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="JSON text")


class ToolCallItem(_Body):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class _Sampling(_Body):
    """How to sample, and what specdec and llama-server add to it: what every endpoint that
    generates takes."""

    temperature: Optional[float] = Field(
        None, ge=0.0, le=100.0, description="default: the server's (1 unless serve --temp)"
    )
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, le=MAX_INT)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(
        None, ge=-(1 << 63), le=(1 << 64) - 1, description="-1: a random seed, as llama-server's"
    )
    user: Optional[str] = Field(None, description="the end user's id (accepted, not used)")
    stop: Union[str, list[str], None] = Field(
        None, description=f"at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"
    )
    speculative: Optional[Speculative] = None
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (as a string): a bias in [-100, 100] added to its logit"
    )
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repeat_penalty: Optional[float] = Field(
        None,
        gt=0.0,
        description="llama-server's: the logits of the last repeat_last_n tokens (prompt "
        "included) divided by this where positive, multiplied where negative; 1: off",
    )
    repeat_last_n: Optional[int] = Field(
        None,
        ge=-1,
        le=MAX_INT,
        description="llama-server's: default the server's (64 unless serve --repeat-last-n); "
        "-1: all, 0: none",
    )
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="chat: variables for a Jinja chat template, as llama-server's"
    )
    ngram_index: bool = Field(
        True,
        description="false: neither draft from the server's shared n-gram index (earlier "
        "requests' outputs) nor add this request's output to it",
    )
    ignore_eos: bool = Field(
        False,
        description="llama-server's: never generate an end-of-generation token, so that the "
        "answer runs to max_tokens (not with response_format, json_schema, grammar or tools)",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stops(cls, stop: Any) -> Any:
        items = [stop] if isinstance(stop, str) else stop
        if stop is None:
            return None
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ValueError("must be a non-empty string or a list of them")
        if len(items) > MAX_STOPS:
            raise ValueError(f"takes at most {MAX_STOPS} strings, got {len(items)}")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"strings are at most {MAX_STOP_CHARS} characters")
        return items

    @property
    def sampling_seed(self) -> int | None:
        """The engine's seed: None for none or llama-server's -1 (random), else in [0, 2**64)."""
        return None if self.seed is None or self.seed == -1 else self.seed % (1 << 64)

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_biases(cls, bias: Any) -> Any:
        if isinstance(bias, dict):
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"takes at most {MAX_LOGIT_BIAS} tokens")
            for key, value in bias.items():
                if not (key.isascii() and key.isdigit() and len(key) <= 9):
                    raise ValueError(f"keys are token ids, got {key!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"values are numbers, got {value!r}")
                if not -100 <= value <= 100:
                    raise ValueError(f"values are in [-100, 100], got {value}")
            return {k: float(v) for k, v in bias.items()}
        return bias

    @property
    def token_biases(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Prediction(_Body):
    """OpenAI's predicted outputs: the output the client expects (a file before its edit)."""

    type: Literal["content"]
    content: Union[str, list[TextPart]]

    @property
    def text(self) -> str:
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class _Generation(_Sampling):
    """What the chat and completion endpoints take."""

    model: Optional[str] = Field(None, max_length=256)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    n_predict: Optional[int] = Field(
        None, ge=-1, le=MAX_INT, description="llama-server's max_tokens; -1: no limit"
    )
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[int] = Field(
        None, ge=1, le=MAX_CHOICES, description="choices, each its own generation"
    )
    response_format: Optional[ResponseFormat] = None
    json_schema: Union[dict[str, Any], bool, None] = Field(
        None, description="llama-server's: the output matches this JSON schema"
    )
    grammar: Optional[str] = Field(
        None,
        max_length=MAX_GRAMMAR_CHARS,
        description="llama-server's: a GBNF grammar the output matches (or Lark syntax)",
    )
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    prediction: Optional[Prediction] = Field(
        None,
        description="the output expected, drafted by copying it where the output keeps to it "
        "(speed only: the output is the model's whatever it says)",
    )

    def tool_format(
        self, syntax: ToolSyntax = GENERIC, tag_tokens: Mapping[str, int] | None = None
    ) -> ToolFormat | None:
        """What the tools and tool_choice ask of the output, calls written in `syntax`
        (`tag_tokens`: its tags that are special tokens, with their ids); None where no tool
        may be called."""
        try:
            answer = self._response_schema
            return tool_format(
                self.tools, self.tool_choice, self.parallel_tool_calls, answer, syntax, tag_tokens
            )
        except ToolError as e:
            raise BodyError(str(e), str(e).split(":")[0]) from None

    def constraint(self, tools: ToolFormat | None) -> tuple[str, str] | None:
        """The grammar the output must match, as (kind, text): that of `tools` (the body's
        tool_format), else response_format, llama-server's json_schema or its grammar
        (BodyError when more than one is given)."""
        if self.grammar:
            if tools is not None or self._response_schema is not None:
                raise BodyError(
                    "give one of grammar, response_format, json_schema and tools", "grammar"
                )
            return ("lark", self.grammar)
        schema = self._response_schema
        if self._strict_response:  # an answer beside tools too: their grammar is lenient
            try:
                check_schema(schema, "response_format", strict=True)
            except ToolError as e:
                raise BodyError(str(e), "response_format") from None
        if tools is not None:
            try:
                return tools.constraint()
            except ToolError as e:
                raise BodyError(str(e), "tools") from None
            except RecursionError:
                raise BodyError("tools: a schema is nested too deeply", "tools") from None
        if schema is None:
            return None
        if schema == _ANY_OBJECT:
            return ("json_object", "")
        options = COMPACT_JSON if self._strict_response else LENIENT_JSON
        return ("json_schema", json.dumps(with_json_options(schema, options)))

    @property
    def _strict_response(self) -> bool:
        """Whether the answer's schema was sent as strict (response_format's json_schema)."""
        fmt = self.response_format
        return fmt is not None and fmt.json_schema is not None and fmt.json_schema.strict is True

    @property
    def _response_schema(self) -> dict[str, Any] | bool | None:
        """The schema response_format or json_schema ask of the answer."""
        fmt = self.response_format
        schema: Any = None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise BodyError(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format",
                )
            schema = fmt.json_schema.json_schema
        elif fmt is not None and fmt.type == "json_object":
            schema = fmt.schema_
            if schema is None and self.json_schema is None:
                return _ANY_OBJECT
        if self.json_schema is not None:
            if schema is not None or (fmt is not None and fmt.type != "text"):
                raise BodyError("give response_format or json_schema, not both", "json_schema")
            schema = self.json_schema
        return schema  # type: ignore[no-any-return]

    _stream_null_is_off = field_validator("stream", mode="before")(_null_is_off)

    @field_validator("n_predict")
    @classmethod
    def _predicts_something(cls, n: Optional[int]) -> Optional[int]:
        if n == 0:
            raise ValueError("must be -1 (no limit) or at least 1")
        return n

    @model_validator(mode="after")
    def _stream_options_when_streaming(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def n_choices(self) -> int:
        """The choices this request asks for: n for each of its prompts."""
        return self.n or 1

    def choice_seed(self, i: int) -> int | None:
        """Choice i's seed: the request's (or random), one more for each choice after the
        first, so that sampled choices differ and a seed repeats them all."""
        seed = self.sampling_seed
        return None if seed is None else (seed + i) % (1 << 64)

    @property
    def token_limit(self) -> int | None:
        # llama-server's n_predict wins over max_tokens, as there; OpenAI's current
        # max_completion_tokens over its deprecated max_tokens, as vLLM reads them.
        for limit in (self.n_predict, self.max_completion_tokens, self.max_tokens):
            if limit is not None:
                return None if limit == -1 else limit
        return None


class ContentPart(_Body):
    type: str
    text: Optional[str] = None
    refusal: Optional[str] = Field(None, description="an assistant's refusal part's text")

    @property
    def words(self) -> str:
        return (self.text if self.type == "text" else self.refusal) or ""


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = Field(
        None, description="null only for an assistant's tool calls"
    )
    tool_calls: Optional[list[ToolCallItem]] = None
    tool_call_id: Optional[str] = Field(None, max_length=256)
    name: Optional[str] = Field(None, max_length=256)

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        # Text parts are lines, as llama-server and vLLM join them.
        return "\n".join(part.words for part in self.content)

    @model_validator(mode="before")
    @classmethod
    def _not_the_functions_api(cls, data: Any) -> Any:
        # OpenAI's older functions API: its messages would read as calls without their call.
        older = isinstance(data, dict) and (
            data.get("function_call") is not None or data.get("role") == "function"
        )
        if older:
            raise ValueError(
                "'function_call' and the 'function' role (the older functions API) are not "
                "taken: send 'tool_calls' and 'tool' messages"
            )
        return data

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("'content' is needed (null only for an assistant's tool calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant's message has 'tool_calls'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id', the id of the call it answers")
        return self

    def for_tools(self) -> ToolMessage:
        calls = [
            ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls or []
        ]
        return ToolMessage(self.role, self.text, calls, self.tool_call_id, self.name)

    @field_validator("content", mode="after")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart]) -> str | list[ContentPart]:
        if isinstance(content, list):
            for part in content:
                if part.type not in ("text", "refusal"):
                    raise ValueError("only text content parts are supported (and refusal parts)")
                if part.type == "text" and part.text is None:
                    raise ValueError("a text part needs 'text'")
                if part.type == "refusal" and part.refusal is None:
                    raise ValueError("a refusal part needs 'refusal'")
        return content


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _tool_messages_answer_calls(self) -> ChatCompletionRequest:
        # As OpenAI reads a conversation: each call of an assistant's message is answered by a
        # tool message right after it (in any order), and a tool message answers one of them.
        unanswered: list[str] = []
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                if m.tool_call_id not in unanswered:
                    raise ValueError(
                        f"'messages[{i}]': a tool message answers a call of the assistant "
                        f"message before it, and none there is {m.tool_call_id!r} unanswered"
                    )
                unanswered.remove(m.tool_call_id)
                continue
            if unanswered:
                raise ValueError(
                    f"'messages[{i - 1}]': the calls {unanswered} have no tool message answering "
                    "them before the next message"
                )
            unanswered = [c.id for c in m.tool_calls or []]
        if unanswered:
            raise ValueError(
                f"the last message's calls {unanswered} have no tool message answering them"
            )
        return self

    @property
    def n_logprobs(self) -> int | None:
        """How many alternatives per token to report (None: no logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise BodyError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class ResponseTool(FunctionDefinition):
    """A function tool of OpenAI's Responses API (the chat API's function, flattened)."""

    type: Literal["function"]

    @model_validator(mode="before")
    @classmethod
    def _a_function(cls, tool: Any) -> Any:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(
                f"only function tools are served here, not {kind!r} (OpenAI's hosted tools "
                "run on OpenAI's servers)"
            )
        return tool


class ResponseToolChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class TextFormat(JsonSchemaFormat):
    """The Responses API's text.format: text, any JSON object, or JSON under a schema (chat's
    response_format.json_schema, flattened; its name and an object schema needed)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")

    @model_validator(mode="after")
    def _a_named_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError("a json_schema format needs 'name' and 'schema'")
        return self


class TextConfig(_Body):
    format: Optional[TextFormat] = None


# The Responses API's include value that asks for the output text's logprobs.
TEXT_LOGPROBS = "message.output_text.logprobs"


class ResponsesRequest(_Sampling):
    """OpenAI's Responses API (POST /v1/responses), served statelessly: answered as the chat
    request it maps to (`chat()`), nothing stored, so the conversation comes whole as input."""

    model: Optional[str] = Field(None, max_length=256)
    input: Union[str, list[dict[str, Any]]] = Field(
        description="text, or items: messages (input_text and output_text parts), "
        "function_call and function_call_output; reasoning items are skipped"
    )
    instructions: Optional[str] = Field(None, description="a system message before the input")
    max_output_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    stream: bool = False
    tools: Optional[list[ResponseTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponseToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[TextConfig] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: Optional[list[str]] = Field(
        None, description=f"{TEXT_LOGPROBS!r} gives the output text's logprobs; others: none"
    )
    metadata: Optional[dict[str, str]] = Field(None, description="given back as sent")
    truncation: Optional[Literal["auto", "disabled"]] = Field(
        None,
        description="auto: an input too long for the context drops its oldest items (after "
        "the system ones) until it fits; disabled (the default): it is a 400",
    )
    previous_response_id: Optional[str] = Field(
        None, description="not taken: nothing is stored, send the conversation as input"
    )
    conversation: Any = Field(None, description="not taken: nothing is stored")
    background: Optional[bool] = Field(None, description="not taken: answers come at once")

    _stream_null_is_off = field_validator("stream", mode="before")(_null_is_off)

    @model_validator(mode="after")
    def _stateless(self) -> ResponsesRequest:
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"'{name}' is not taken: this server stores no responses; send the whole "
                    "conversation as 'input' (earlier output items included)",
                )
        if self.background:
            raise ValueError("'background' is not taken: responses are answered at once")
        if self.logprobs and self.tools and self.tool_choice != "none":
            # The output's tokens are the tool format's: they are not the text's.
            raise ValueError(f"{TEXT_LOGPROBS!r} is not given with tools")
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the text's logprobs are asked for (top_logprobs alone asks for none, as at
        OpenAI)."""
        return TEXT_LOGPROBS in (self.include or [])

    def chat(self) -> ChatCompletionRequest:
        """The chat request this asks for."""
        body: dict[str, Any] = self.model_dump(
            include=set(_Sampling.model_fields), exclude_unset=True, by_alias=True
        )
        body.update(
            messages=_response_messages(self.instructions, self.input),
            stream=self.stream,
            parallel_tool_calls=self.parallel_tool_calls,
        )
        if self.model is not None:
            body["model"] = self.model
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        choice = self.tool_choice
        body["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, ResponseToolChoice)
            else choice
        )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        try:
            return validated(body, ChatCompletionRequest)
        except BodyError as e:
            raise in_responses_terms(e) from None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _a_known_choice(cls, choice: Any) -> Any:
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise ValueError(
                "is 'none', 'auto', 'required' or a function ({\"type\": \"function\", "
                f'"name": ...}}), not {choice.get("type")!r}'
            )
        return choice


# A chat request's names for what the Responses API names otherwise: the chat checks' errors
# reach its clients in its own terms.
_RESPONSES_TERMS = (
    (re.compile(r"messages(\[\d+\])?"), "input"),
    (
        re.compile(r"response_format( of type json_schema needs json_schema\.schema)?"),
        "text.format",
    ),
    (re.compile(r"(tools\[\d+\])\.function"), r"\1"),
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
)


def in_responses_terms(e: Exception) -> Exception:
    """A chat request's refusal (a BodyError, or a ValueError of the tools' reading) as the
    Responses API request it was mapped from names it; other errors as they are."""
    if not isinstance(e, (BodyError, ToolError)) and type(e) is not ValueError:
        return e
    message, param = (e.message, e.param) if isinstance(e, BodyError) else (str(e), None)
    for pattern, name in _RESPONSES_TERMS:
        message = pattern.sub(name, message)
        param = None if param is None else pattern.sub(name, param)
    return BodyError(message, param, e.status if isinstance(e, BodyError) else 400)


def _response_messages(instructions: str | None, given: str | list[dict[str, Any]]) -> list[Any]:
    """The Responses API's instructions and input as chat messages: a function_call item joins
    the assistant message before it (calls made together are one message)."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given
    called: set[str] = set()
    answered: set[str] = set()
    for i, item in enumerate(items):
        message = _response_message(i, item)
        if message is None:
            continue
        # As OpenAI reads the input: an output answers a call before it, and every call has one.
        for call in message.get("tool_calls") or []:
            called.add(call["id"])
        if message["role"] == "tool":
            if message["tool_call_id"] not in called:
                raise BodyError(
                    f"'input[{i}]': no function_call before it has call_id "
                    f"{message['tool_call_id']!r}",
                    "input",
                )
            answered.add(message["tool_call_id"])
        calls = message.get("tool_calls")
        last = messages[-1] if messages else None
        if (
            calls
            and message["content"] is None
            and last is not None
            and last["role"] == "assistant"
        ):
            last["tool_calls"] = [*(last.get("tool_calls") or []), *calls]
        else:
            messages.append(message)
    if not messages:
        raise BodyError("'input' needs at least one message", "input")
    if called - answered:
        raise BodyError(
            f"'input': the function_call items {sorted(called - answered)} have no "
            "function_call_output",
            "input",
        )
    return messages


_INPUT_TEXT = ("input_text", "output_text", "text")


def _response_message(i: int, item: Any) -> dict[str, Any] | None:
    """Input item i as a chat message; None for an item that carries no text for the model."""
    where = f"'input[{i}]'"
    if not isinstance(item, dict):
        raise BodyError(f"{where}: each item is an object", "input")
    kind = item.get("type") or "message"  # EasyInputMessage: no type, or null
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise BodyError(
                f"{where}: a message's role is user, system, developer or assistant", "input"
            )
        return {"role": role, "content": _input_text(where, item.get("content"))}
    if kind == "function_call":
        call: dict[str, Any] = {k: item.get(k) for k in ("call_id", "name", "arguments")}
        if not all(isinstance(v, str) for v in call.values()):
            raise BodyError(
                f"{where}: a function_call needs call_id, name and arguments (text)", "input"
            )
        _check_call_id(where, call["call_id"])
        if not 1 <= len(call["name"]) <= 64:
            raise BodyError(f"{where}: a function's name has 1 to 64 characters", "input")
        function = {"name": call["name"], "arguments": call["arguments"]}
        tool_call = {"id": call["call_id"], "type": "function", "function": function}
        return {"role": "assistant", "content": None, "tool_calls": [tool_call]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise BodyError(f"{where}: a function_call_output needs call_id", "input")
        _check_call_id(where, item["call_id"])
        output = _input_text(where, item.get("output"))
        return {"role": "tool", "tool_call_id": item["call_id"], "content": output}
    if kind == "reasoning":
        return None  # a model's reasoning from elsewhere: this model reads none
    raise BodyError(
        f"{where}: items of type {kind!r} are not taken (message, function_call, "
        "function_call_output)",
        "input",
    )


def _check_call_id(where: str, call_id: str) -> None:
    if not call_id or len(call_id) > 256:
        raise BodyError(f"{where}: a call_id has 1 to 256 characters", "input")


def _input_text(where: str, content: Any) -> str:
    """A message's or a tool output's content: text, or text parts (joined as lines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for part in content:
            if part.get("type") not in _INPUT_TEXT:
                raise BodyError(
                    f"{where}: only text parts are taken (input_text, output_text), got "
                    f"{part.get('type')!r}",
                    "input",
                )
            if not isinstance(part.get("text"), str):
                raise BodyError(f"{where}: a text part's 'text' is a string", "input")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BodyError(f"{where}: content is text or a list of text parts", "input")


Prompt = Union[Annotated[str, Field(min_length=1)], Annotated[list[int], Field(min_length=1)]]


class CompletionRequest(_Generation):
    prompt: Union[Prompt, Annotated[list[Prompt], Field(min_length=1, max_length=MAX_CHOICES)]] = (
        Field(
            description=f"text, or token ids; or a batch of them (at most {MAX_CHOICES} choices in "
            "all), answered as a choice each, in order"
        )
    )
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: Optional[int] = Field(
        None, ge=0, le=MAX_INT, description="0 (with echo): score the prompt, generate nothing"
    )
    echo: bool = Field(
        False,
        description="the text starts with the prompt, and logprobs cover its tokens (the "
        "first null where nothing came before it): what a scorer such as lm-eval reads",
    )

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[Prompt]:
        if isinstance(self.prompt, str) or all(type(t) is int for t in self.prompt):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def n_choices(self) -> int:
        return (self.n or 1) * len(self.prompts)

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt scored, nothing generated."""
        return self.echo and self.token_limit == 0

    @model_validator(mode="after")
    def _no_chat_fields(self) -> CompletionRequest:
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools are for /v1/chat/completions")
        if self.chat_template_kwargs:
            raise ValueError("chat_template_kwargs are for /v1/chat/completions")
        if self.token_limit == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it scores the prompt with echo")
        if self.echo and self.stream:
            raise ValueError("echo is answered whole: send it without stream")
        if self.n_choices > MAX_CHOICES:
            raise ValueError(f"n times the prompts is at most {MAX_CHOICES}, got {self.n_choices}")
        return self

    _echo_null_is_off = field_validator("echo", mode="before")(_null_is_off)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, p: Any) -> Any:
        def one(p: Any) -> bool:
            return (isinstance(p, str) and bool(p)) or (
                isinstance(p, list) and bool(p) and all(type(t) is int for t in p)
            )

        if one(p):
            return p
        if isinstance(p, list) and p and all(one(q) for q in p):
            if len(p) > MAX_CHOICES:
                raise ValueError(f"a batch holds at most {MAX_CHOICES} prompts, got {len(p)}")
            return p[0] if len(p) == 1 else p  # a batch of one is one prompt
        raise ValueError(
            "must be a non-empty string or a list of token ids, or a batch (a list) of them"
        )


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise BodyError(f"the body has an integer of more than {MAX_NUMBER_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BodyError("the body has a number too large for a 64-bit float")
    return value


def _no_constant(name: str) -> float:
    raise BodyError(f"the body has {name}, which is not JSON")


def read_json(raw: bytes) -> Any:
    """The body as Python values, or a BodyError: invalid JSON, numbers past any field's range,
    NaN/Infinity, nesting past the parser's recursion limit."""
    if len(raw) > MAX_BODY_BYTES:
        raise BodyError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413)
    try:
        return json.loads(
            raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError("the request body is nested too deeply") from None


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


class TokenizeRequest(_Body):
    """llama-server's /tokenize: text to the target's token ids."""

    content: str = ""  # llama-server's: none is no tokens
    add_special: bool = Field(False, description="add the model's own start tokens (BOS)")
    parse_special: bool = Field(True, description="read special tokens' text as those tokens")
    with_pieces: bool = Field(False, description="each id with its text (or bytes, if not UTF-8)")


class DetokenizeRequest(_Body):
    """llama-server's /detokenize: token ids to text."""

    tokens: list[int] = []  # llama-server's: none is no text


Body = TypeVar("Body", bound=BaseModel)


def validated(body: Any, model: type[Body]) -> Body:
    """`body` as `model`; the first problem found as a BodyError."""
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors(include_url=False, include_input=False)[0]
        param = _field_path(error["loc"])
        msg = str(error["msg"]).removeprefix("Value error, ")
        if not param:  # a check of the whole body: its message names the fields
            raise BodyError(msg) from None
        raise BodyError(f"'{param}': {msg}", param=param.split(".")[0].split("[")[0]) from None


# The generating endpoints: /v1/chat/completions, /v1/completions, /v1/responses.
Endpoint = Literal["chat", "completion", "response"]


def parse_body(
    body: Any, endpoint: Endpoint
) -> tuple[ChatCompletionRequest | CompletionRequest, ResponsesRequest | None]:
    """The body validated for `endpoint` ("chat", "completion" or "response"), as the request
    it asks for (a response's: the chat request it maps to, and itself); the first problem
    found as a BodyError."""
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    for name, used in UNSUPPORTED.items():
        if name in body and used(body[name]):
            raise BodyError(f"'{name}' is not supported by this server", param=name)
    if endpoint != "completion" and body.get("echo"):
        raise BodyError("'echo' is for /v1/completions", param="echo")
    if endpoint == "response":
        ask = validated(body, ResponsesRequest)
        return ask.chat(), ask
    if endpoint == "chat":
        return validated(body, ChatCompletionRequest), None
    return validated(body, CompletionRequest), None


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for an endpoint that reads `model` itself: its schema, with the models it
    uses under components (`components_of` collects them)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def components_of(*models: type[BaseModel]) -> dict[str, Any]:
    """The schemas the request models refer to, for the OpenAPI document's components."""
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.get("$defs", {}))
    return out

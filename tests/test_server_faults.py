"""The server against hostile clients and shutdowns: raw sockets that hang up, crafted bodies,
SIGTERM with requests queued and streams running. A real server process on 127.0.0.1; every
loop is bounded."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_process import Server, start

from specdec_native import models
from specdec_native.openai_api import MAX_BODY_BYTES

COUNTING = "Count from one to one thousand in words: one, two, three, four,"


def raw_request(server: Server, path: str, body: dict[str, object]) -> socket.socket:
    """Sends a request on a raw socket and returns the socket, unread."""
    data = json.dumps(body).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_response(sock: socket.socket) -> bytes:
    """A whole HTTP response from a raw socket: its headers, then its Content-Length's bytes
    (they may come in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := sock.recv(4096)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            (
                line.split(b":")[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            b"0",
        )
    )
    while len(body) < length and (chunk := sock.recv(4096)):
        body += chunk
    return head + b"\r\n\r\n" + body


def wait_for(what: str, ok: object, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(ok) and ok():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {seconds} s: {what}")


def wait_idle(server: Server, what: str, seconds: float = 20) -> None:
    """Waits until the server runs nothing and nothing waits."""

    def idle() -> bool:
        gauges = server.metrics()
        running = gauges["specdec:num_requests_running"]
        return running == 0 and gauges["specdec:num_requests_waiting"] == 0

    wait_for(what, idle, seconds)


@pytest.fixture(scope="module")
def server(smollm2_q40: Path) -> Iterator[Server]:
    # Two slots and a small queue: hung-up requests that kept running would hold them all.
    s = start(smollm2_q40, "--draft", "ngram", "-c", "2048", "-np", "2", "--max-queue", "4")
    yield s
    assert s.stop() == 0


def test_clients_that_hang_up_unstreamed_free_their_slots(server: Server) -> None:
    before = server.metrics()
    body = {"prompt": COUNTING, "max_tokens": 1500, "temperature": 0}
    socks = [raw_request(server, "/v1/completions", body) for _ in range(6)]
    wait_for(
        "two running, four waiting",
        lambda: server.metrics()["specdec:num_requests_waiting"] == 4,
    )
    for sock in socks:
        sock.close()
    # Each is cancelled within a step: the slots are free long before 1,500 tokens.
    wait_idle(server, "the hung-up requests stopped", seconds=10)
    after = server.metrics()
    key = 'specdec:requests_total{finish_reason="disconnect"}'
    assert after[key] - before.get(key, 0) == 6  # counted, and named
    assert server.stderr().count("finish_reason=disconnect") >= 6  # and logged
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200 and r.json()["timings"]["queue_ms"] < 2000


@pytest.mark.parametrize(
    "raw,match",
    [
        (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", "digits"),
        (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "digits"),
        (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b".0}", "too large"),
        (b'{"prompt": "x", "temperature": NaN}', "NaN"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (json.dumps({"prompt": "x", "stop": ["ab"] * 300_000}).encode(), "at most 16"),
        (json.dumps({"prompt": "x", "stop": "z" * 3_000_000}).encode(), "at most 512"),
        (json.dumps({"prompt": "x", "max_tokens": True}).encode(), "max_tokens"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), "stream"),
        (json.dumps({"prompt": "x", "speculative": {"n_max": 1e3}}).encode(), "speculative"),
    ],
)
def test_crafted_bodies_get_a_400_on_a_connection_that_stays_open(
    server: Server, raw: bytes, match: str
) -> None:
    with httpx.Client(timeout=30) as client:
        started = time.monotonic()
        r = client.post(
            server.url + "/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert match in error["message"] and error["type"] == "invalid_request_error"
        assert time.monotonic() - started < 5
        assert client.get(server.url + "/health").status_code == 200  # the same connection
    assert "Traceback" not in server.stderr()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_client_that_hangs_up_in_its_body_is_counted_and_logged_without_a_traceback(
    server: Server, path: str
) -> None:
    rejected = 'specdec:requests_rejected_total{status="499"}'
    before = server.metrics().get(rejected, 0.0)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            'Content-Length: 1000\r\n\r\n{"prompt": '.encode()
        )
    wait_for("the hang-up counted", lambda: server.metrics().get(rejected, 0.0) == before + 1)
    assert "Traceback" not in server.stderr()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_connections_that_never_finish_a_request_are_closed(server: Server) -> None:
    # Within uvicorn's keep-alive time (5 s), as between requests: nothing sent, half a head,
    # or a header line now and then (each within the time) hold no connection for ever.
    port = int(server.url.rsplit(":", 1)[1])
    heads = [b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"GET /health"]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=15) for _ in heads]
    started = time.monotonic()
    for sock, head in zip(socks, heads):
        sock.sendall(head)
    for _ in range(3):
        time.sleep(1.5)
        socks[1].sendall(b"X-Slow: 1\r\n")
    for sock in socks:
        assert sock.recv(4096) == b""  # closed by the server
        sock.close()
    assert time.monotonic() - started < 12
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_pipelined_request_longer_than_the_head_bound_is_answered(server: Server) -> None:
    # Sent behind another on one connection, it begins as soon as the first is answered, and
    # runs past the 5 s a connection gets to send a request head: it is not cut off.
    # About 7 s on a 2-core machine, target alone.
    slow = {"prompt": COUNTING, "max_tokens": 800, "temperature": 0, "speculative": {"n_max": 0}}
    body = json.dumps(slow).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        second = read_response(sock)
    assert second.startswith(b"HTTP/1.1 200"), second[:200]
    assert json.loads(second.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
    ],
    ids=["bad-length", "bad-encoding", "not-http"],
)
def test_a_request_that_is_not_http_gets_an_openai_shaped_400(server: Server, head: bytes) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        response = read_response(sock)
    status, _, rest = response.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 400")
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["message"].startswith("not a valid HTTP request")
    assert error["type"] == "invalid_request_error"


def test_abandoned_vocabulary_calls_lock_nobody_out(server: Server) -> None:
    # Each of these takes a vocabulary thread seconds; clients that send them and hang up
    # leave only the calls already begun (two threads) holding admissions.
    text = "lorem ipsum dolor sit amet " * 140_000
    data = json.dumps({"content": text}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    for _ in range(16):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            head = (
                "POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(data)}\r\n\r\n"
            )
            sock.sendall(head.encode() + data)
    time.sleep(1)
    r = httpx.post(server.url + "/tokenize", json={"content": "hi"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_streamed_prompt_over_the_context_is_a_400_before_any_stream(server: Server) -> None:
    body = {"prompt": "word " * 3000, "max_tokens": 4, "stream": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_a_stream_cut_at_the_grace_limit_ends_cleanly_and_queued_requests_get_503(
    smollm2_q40: Path,
) -> None:
    s = start(smollm2_q40, "--draft", "ngram", "-c", "2048", "-np", "1", "--grace", "2")
    body = {"prompt": COUNTING, "max_tokens": 1500, "temperature": 0}
    url = s.url + "/v1/completions"
    events: list[str] = []
    try:
        with (
            ThreadPoolExecutor(3) as pool,
            httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream,
        ):
            lines = stream.iter_lines()
            events.append(next(lines))  # running: it has a slot
            queued = [
                pool.submit(httpx.post, url, json=body, timeout=60),
                pool.submit(httpx.post, url, json={**body, "stream": True}, timeout=60),
            ]
            wait_for("two waiting", lambda: s.metrics()["specdec:num_requests_waiting"] == 2)
            # A body that stalls half-way: admitted before it arrives, refused at SIGTERM.
            stalled = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), 10)
            stalled.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt": '
            )
            wait_for("three waiting", lambda: s.metrics()["specdec:num_requests_waiting"] == 3)
            signalled = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            stalled_answer = read_response(stalled)
            stalled.close()
            refused = [f.result() for f in queued]
            refused_after = time.monotonic() - signalled
            events += [line for line in lines if line]
            cut_after = time.monotonic() - signalled
        code = s.proc.wait(timeout=60)
    finally:
        s.stop()
    for r in refused:
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "shutting_down"
    assert stalled_answer.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in stalled_answer
    assert refused_after < 1.5  # at once, not after the grace period
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["timings"]["predicted_n"] < 1500  # cut, not finished
    assert 1.5 < cut_after < 10
    assert code == 0
    log = s.stderr()
    assert "finish_reason=grace" in log and log.count("finish_reason=shutdown") == 2
    # What ended the server, and what it found, in the log's order.
    said = [log.index(line) for line in (
        "shutting down signal=SIGTERM running=1 waiting=2 grace_s=2",
        "cutting running requests running=1",
        "stopped",
    )]  # fmt: skip
    assert said == sorted(said)
    assert "Traceback" not in log


def open_fds(server: Server) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_json_logs_are_json_and_a_request_that_is_not_http_is_counted(
    tiny_pair: models.ModelPair,
) -> None:
    s = start(tiny_pair.target, "-t", "1", "-c", "256", "--log-format", "json")
    try:
        key = 'specdec:requests_rejected_total{status="400"}'
        before = s.metrics().get(key, 0)
        port = int(s.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GARBAGE\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 400")
        assert s.metrics()[key] == before + 1
    finally:
        assert s.stop() == 0
    lines = [json.loads(line) for line in s.stderr().splitlines()]  # every line JSON
    assert any(line["message"] == "serving" for line in lines)
    assert lines[-1]["message"] == "stopped"
    assert any(line["message"] == "refused" and line.get("status") == 400 for line in lines)


def test_sigterm_again_while_exiting_still_exits_0(tiny_pair: models.ModelPair) -> None:
    # An orchestrator may signal twice; after the drain, Python restores default handlers as
    # it finalizes, and a SIGTERM then killed the exit (-15).
    s = start(tiny_pair.target, "-t", "1", "-c", "256")
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while s.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0


def test_connections_whose_clients_still_send_do_not_hold_up_the_exit(
    tiny_pair: models.ModelPair,
) -> None:
    # A refused body's connection lingers (reading what its client still sends) so that the
    # client reads its answer; a shutdown ends that at once.
    s = start(tiny_pair.target, "-t", "1", "-c", "256")
    port = int(s.url.rsplit(":", 1)[1])
    opened = []
    for path, size in (("/nope", 1 << 20), ("/v1/completions", 64 << 20)):  # a 404, a 413
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode())
        sock.sendall(b"x" * 1000)
        assert read_response(sock).split(b" ")[1] in (b"404", b"413")
        opened.append(sock)
    signalled = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0
    assert time.monotonic() - signalled < 3.0  # not the 5 s a connection may linger
    for sock in opened:
        sock.close()


def test_a_soak_of_hostile_traffic_loses_nothing_and_leaks_nothing(
    tiny_pair: models.ModelPair,
) -> None:
    # 500 requests at concurrency 8 against 4 slots: streamed and not, clients that hang up
    # mid-request or mid-stream, bad bodies. Every one is answered or counted; afterwards no slot
    # is held and fds and RSS are back where they were.
    s = start(
        tiny_pair.target, "--draft", tiny_pair.draft, "-t", "1", "-c", "4096",
        "-np", "4", "--max-queue", "8",
    )  # fmt: skip
    url = s.url + "/v1/completions"
    rng = random.Random(7)
    kinds = ["plain", "stream", "hang_up", "stream_hang_up", "bad_body"]
    plan = [rng.choice(kinds) for _ in range(500)]

    def one(i: int) -> str:
        body = {"prompt": [1, 250 + i % 50], "max_tokens": rng.choice([8, 300, 3000])}
        kind = plan[i]
        if kind == "bad_body":
            r = httpx.post(url, content=b'{"prompt": [1], "top_p": -1}', timeout=60)
            assert r.status_code == 400, r.text
        elif kind == "hang_up":
            sock = raw_request(s, "/v1/completions", body)
            time.sleep(rng.uniform(0, 0.05))
            sock.close()
        elif kind == "stream_hang_up":
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                if r.status_code == 200:
                    next(r.iter_lines())
        else:
            stream = kind == "stream"
            with httpx.stream("POST", url, json={**body, "stream": stream}, timeout=60) as r:
                text = "".join(r.iter_lines())
                assert r.status_code in (200, 503), text
                if r.status_code == 200 and stream:
                    assert text.endswith("data: [DONE]")
        return kind

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(16)))  # warm: allocator pools, metric label sets
        wait_for("idle", lambda: s.metrics()["specdec:num_requests_running"] == 0)
        fds, rss, before = open_fds(s), s.rss_mib(), s.metrics()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(16, 500)))
        wait_idle(s, "every request ended")
        after = s.metrics()
        # Every request reached the server and was counted once: as a run (however it ended)
        # or as a refusal (a bad body, a full queue).
        counted = sum(
            v - before.get(k, 0)
            for k, v in after.items()
            if k.startswith(("specdec:requests_total{", "specdec:requests_rejected_total{"))
        )
        assert counted == 484
        assert after.get('specdec:requests_total{finish_reason="disconnect"}', 0) > 0
        # A hung-up connection's fd closes when the server reads its end: leaked ones never do.
        wait_for("the fds back", lambda: open_fds(s) <= fds + 2, seconds=5)
        assert s.rss_mib() - rss < 16
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.stderr()


def test_a_chunked_body_past_the_limit_gets_its_413_and_the_connection_closes(
    server: Server,
) -> None:
    # Its client is still sending: left open, it would block until the keep-alive timeout.
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            sock.sendall(chunk)
        answer = read_response(sock)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        sock.settimeout(2.0)
        try:
            assert sock.recv(4096) == b""  # closed by the server
        except ConnectionResetError:
            pass  # closed with what it did not read still in its buffer


def test_an_echo_cut_before_its_prompt_was_scored_is_an_error_not_a_short_score(
    smollm2_q40: Path,
) -> None:
    # Partial logprobs would read as a whole score, and a far too likely one.
    s = start(smollm2_q40, "-t", "1", "-c", "2048", "--request-timeout", "0.01")
    try:
        body = {"prompt": "word " * 1500, "max_tokens": 1, "logprobs": 1, "echo": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_scored", r.text
        # Echo without logprobs is its text alone: nothing to cut short.
        r = httpx.post(s.url + "/v1/completions", json={**body, "logprobs": None}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("word word")
    finally:
        assert s.stop() == 0


def test_echo_offsets_are_the_clients_text_where_the_tokenizer_adds_a_space(
    tiny_pair: models.ModelPair,
) -> None:
    s = start(tiny_pair.target, "-t", "1", "-c", "256")  # a BOS, and a space before the text
    try:
        body = {"prompt": "the cat", "max_tokens": 0, "logprobs": 0, "echo": True}
        choice = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    finally:
        s.stop()
    text, lp = choice["text"], choice["logprobs"]
    assert text == "the cat" and lp["token_logprobs"][0] is not None  # the BOS is not echoed
    assert lp["text_offset"][0] == 0
    for token, at in list(zip(lp["tokens"], lp["text_offset"]))[1:]:
        assert text[at:].startswith(token), (token, at, text)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_of_several_choices_takes_a_slot_each_and_a_hang_up_frees_them_all(
    server: Server, stream: bool
) -> None:
    before = server.metrics()
    body = {"prompt": COUNTING, "max_tokens": 1500, "temperature": 0, "n": 3, "stream": stream}
    sock = raw_request(server, "/v1/completions", body)
    wait_for(
        "two running, one waiting",
        lambda: (
            server.metrics()["specdec:num_requests_waiting"] == 1
            and server.metrics()["specdec:num_requests_running"] == 2
        ),
    )
    if stream:  # a stream opens once every choice has a slot: nothing sent yet
        sock.settimeout(1.0)
        with pytest.raises(TimeoutError):
            sock.recv(1)
    sock.close()
    wait_idle(server, "all three stopped", seconds=10)
    assert "Traceback" not in server.stderr()  # a stream that never opened leaves nothing behind
    key = 'specdec:requests_total{finish_reason="disconnect"}'
    assert server.metrics()[key] - before.get(key, 0) == 3
    # One prompt of a batch cannot be served: its error answers at once (streamed too: before
    # any event), the other abandoned.
    batch = {**body, "n": 1, "prompt": ["word " * 3000, COUNTING]}
    refused = httpx.post(server.url + "/v1/completions", json=batch, timeout=60)
    assert refused.status_code == 400 and "context" in refused.json()["error"]["message"]
    key = 'specdec:requests_total{finish_reason="abandoned"}'
    wait_for(  # cut, not run to its 1,500 tokens
        "the other abandoned", lambda: server.metrics().get(key, 0) - before.get(key, 0) == 1
    )
    too_many = httpx.post(
        server.url + "/v1/completions", json={**body, "n": 16}, timeout=30
    )  # more than the slots and the queue hold together: never admitted, whatever the load
    assert too_many.status_code == 400 and "fewer choices" in too_many.json()["error"]["message"]

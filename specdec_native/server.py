"""The OpenAI-compatible HTTP server behind `specdec-cli serve`.

A thin layer: it maps requests to SpeculativeDecoder calls, and results and their stats to
OpenAI response shapes, llama.cpp-style `timings` and Prometheus metrics. It owns no generation
state: a request is one `agenerate`/`astream_events` call with its own cancel flag, so a client
that goes away stops its own generation and nothing else.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse

from specdec_native import _core
from specdec_native.decoder import AUTO, GenerationResult, SpeculativeDecoder

log = logging.getLogger("specdec.server")

MAX_BODY_BYTES = 4 << 20
# Fields of the OpenAI API that would change what is generated and that this server does not
# implement: a request using them gets a 400 rather than a silently different answer.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v not in (None, False),
    "top_logprobs": lambda v: v not in (None, 0),
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "logit_bias": lambda v: bool(v),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
}


@dataclass(frozen=True)
class ServerSettings:
    model_alias: str
    api_key: str | None = None
    n_parallel: int = 1  # requests generating at once (the decoder's slots)
    max_queue: int = 16
    request_timeout: float | None = None
    n_draft: int | str = AUTO
    grace: float = 30.0  # seconds running requests get to finish after SIGTERM


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.headers = kind, code, headers

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Metrics:
    """vLLM's spec-decode metric names under a `specdec:` prefix, and the serving basics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.drafts = Counter(
            "specdec:spec_decode_num_drafts", "Steps that drafted at least one token", registry=r
        )
        self.draft_tokens = Counter(
            "specdec:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.accepted_tokens = Counter(
            "specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            "specdec:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by draft position (from 0)",
            ["position"],
            registry=r,
        )
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens", registry=r)
        self.prompt_tokens_cached = Counter(
            "specdec:prompt_tokens_cached", "Prompt tokens reused from the cache", registry=r
        )
        self.generation_tokens = Counter(
            "specdec:generation_tokens", "Generated tokens", registry=r
        )
        self.requests = Counter(
            "specdec:requests", "Finished requests, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "specdec:requests_rejected", "Requests refused, by HTTP status", ["status"], registry=r
        )
        self.fallbacks = Counter(
            "specdec:fallbacks",
            "Requests in which `auto` fell back to target-only decoding, by reason",
            ["reason"],
            registry=r,
        )
        self.running = Gauge("specdec:num_requests_running", "Requests generating", registry=r)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests queued", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram(
            "specdec:time_to_first_token_seconds",
            "Time to first token",
            buckets=buckets,
            registry=r,
        )
        self.itl = Histogram(
            "specdec:inter_token_latency_seconds",
            "Mean time between tokens of a request",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.e2e = Histogram(
            "specdec:e2e_request_latency_seconds",
            "Request latency, queue included",
            buckets=buckets,
            registry=r,
        )

    def observe(self, result: GenerationResult, seconds: float, waited: float) -> None:
        s = result.stats
        self.drafts.inc(s.n_speculative_steps)
        self.draft_tokens.inc(s.n_drafted)
        self.accepted_tokens.inc(s.n_accepted)
        for pos, n in enumerate(s.accepted_at):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        self.prompt_tokens.inc(s.n_prompt)
        self.prompt_tokens_cached.inc(s.n_prompt_cached)
        self.generation_tokens.inc(s.n_generated)
        self.requests.labels(finish_reason=result.finish_reason).inc()
        if s.fallback_reason or s.draft_error:
            self.fallbacks.labels(reason=s.draft_error or s.fallback_reason).inc()
        if s.n_generated:
            self.ttft.observe(waited + s.t_first_token - s.t_queue)
        if s.n_generated > 1:
            self.itl.observe(
                max(s.t_total - (s.t_first_token - s.t_queue), 0.0) / (s.n_generated - 1)
            )
        self.e2e.observe(seconds)


# -- request parsing ---------------------------------------------------------------------------


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise RequestError(400, f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:
        raise RequestError(400, f"'{name}' must be in [{lo}, {hi}], got {v}", param=name)
    return float(v)


def _integer(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(400, f"'{name}' must be an integer", param=name)
    if not lo <= v <= hi:
        raise RequestError(400, f"'{name}' must be in [{lo}, {hi}], got {v}", param=name)
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    return list(items)


def _speculation(body: dict[str, Any], default: int | str) -> tuple[int | str, float]:
    """llama.cpp's per-request `speculative` object: n_max (0: off), n_min, p_min."""
    spec = body.get("speculative")
    if spec is None:
        return default, 0.0
    if not isinstance(spec, dict):
        raise RequestError(400, "'speculative' must be an object", param="speculative")
    unknown = set(spec) - {"n_max", "n_min", "p_min"}
    if unknown:
        raise RequestError(
            400, f"unknown 'speculative' fields: {', '.join(sorted(unknown))}", param="speculative"
        )
    n_max = _integer(spec, "n_max", 0, 64, None)
    _integer(spec, "n_min", 0, 64, 0)  # a floor on draft length: speed only, never results
    p_min = _number(spec, "p_min", 0.0, 1.0, 0.0)
    return (default if n_max is None else n_max), p_min


def _message_text(i: int, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise RequestError(400, f"messages[{i}] must be an object", param="messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        raise RequestError(400, f"messages[{i}].role must be a string", param="messages")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(
                    400, f"messages[{i}]: only text content parts are supported", param="messages"
                )
            if not isinstance(part.get("text"), str):
                raise RequestError(
                    400, f"messages[{i}]: a text part needs 'text'", param="messages"
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{i}].content must be a string", param="messages")
    if "\0" in content or "\0" in role:
        raise RequestError(400, f"messages[{i}] contains a NUL character", param="messages")
    return {"role": role, "content": content}


@dataclass
class Job:
    """One parsed request: what to generate, and how."""

    prompt: str | list[int]
    kwargs: dict[str, Any]
    stream: bool
    include_usage: bool


def _parse(body: Any, chat: bool, decoder: SpeculativeDecoder, settings: ServerSettings) -> Job:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    for name, used in UNSUPPORTED.items():
        if name in body and used(body[name]):
            raise RequestError(400, f"'{name}' is not supported by this server", param=name)
    n = _integer(body, "n", 1, 1 << 30, 1)
    if n != 1:
        raise RequestError(400, "'n' > 1 is not supported: send one request per choice", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", param="model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list", param="messages")
        prompt: str | list[int] = decoder.apply_chat_template(
            [_message_text(i, m) for i, m in enumerate(messages)]
        )
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]  # a batch of one
        if isinstance(p, str):
            if not p:
                raise RequestError(400, "'prompt' is empty", param="prompt")
            prompt = p
        elif (
            isinstance(p, list)
            and p
            and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        ):
            prompt = p
        else:
            raise RequestError(
                400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt"
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", param="stream_options")
    n_draft, p_min = _speculation(body, settings.n_draft)
    limit = decoder.n_ctx
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30, None)
    max_tokens = _integer(body, "max_tokens", 1, 1 << 30, max_tokens)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(400, "'seed' must be an integer", param="seed")
    kwargs: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0.0, 100.0, 1.0),
        "top_p": _number(body, "top_p", 1e-9, 1.0, 1.0),
        "top_k": _integer(body, "top_k", 0, 1 << 30, 0),
        "min_p": _number(body, "min_p", 0.0, 1.0, 0.0),
        "seed": None if seed is None else seed % (1 << 64),
        "stop": _stop(body),
        "n_draft": n_draft,
        "draft_p_min": p_min,
    }
    if settings.request_timeout:
        kwargs["deadline"] = time.monotonic() + settings.request_timeout
    # Without max_tokens, generate until the end token or a full context, as OpenAI does.
    kwargs["max_tokens"] = min(max_tokens or limit, limit)
    return Job(prompt, kwargs, stream, bool(options.get("include_usage")))


# -- responses ---------------------------------------------------------------------------------


def _finish_reason(result: GenerationResult) -> str:
    # OpenAI knows "stop" and "length"; a full context or a deadline ends the text by length.
    return "stop" if result.finish_reason == "stop" else "length"


def _usage(result: GenerationResult) -> dict[str, int]:
    s = result.stats
    return {
        "prompt_tokens": s.n_prompt,
        "completion_tokens": s.n_generated,
        "total_tokens": s.n_prompt + s.n_generated,
        "prompt_tokens_details": {"cached_tokens": s.n_prompt_cached},  # type: ignore[dict-item]
    }


def timings(result: GenerationResult, waited: float) -> dict[str, Any]:
    """llama.cpp's `timings` object, plus what speculation did and how long the request waited
    for the engine (`waited`, seconds)."""
    s = result.stats
    gen = s.t_generation
    return {
        "cache_n": s.n_prompt_cached,
        "prompt_n": s.n_prompt - s.n_prompt_cached,
        "prompt_ms": s.t_prompt * 1e3,
        "predicted_n": s.n_generated,
        "predicted_ms": gen * 1e3,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.n_drafted,
        "draft_n_accepted": s.n_accepted,
        "acceptance_rate": s.acceptance_rate,
        "fallback_reason": s.draft_error or s.fallback_reason,
        "queue_ms": waited * 1e3,
        "shared_steps": s.n_shared_steps,
        "finish_reason": result.finish_reason,
    }


class Server:
    """The decoder, the admission count, the metrics; request handling on top."""

    def __init__(
        self,
        load: Callable[[], SpeculativeDecoder],
        settings: ServerSettings,
        on_fatal: Callable[[], None] = lambda: None,
    ) -> None:
        self.load = load
        self.on_fatal = on_fatal
        self.settings = settings
        self.metrics = Metrics()
        self.decoder: SpeculativeDecoder | None = None
        self.ready = False
        self.load_error: str | None = None
        self.admitted = 0  # running + waiting

    async def start(self) -> None:
        """Loads the models and warms up (costs calibrated, one tiny generation), off the event
        loop; /health answers 503 until this is done."""
        loop = asyncio.get_running_loop()
        try:
            self.decoder = await loop.run_in_executor(None, self.load)
            await loop.run_in_executor(None, self._warm_up, self.decoder)
        except Exception as e:  # a server without its model stops (and says why)
            self.load_error = (
                str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
            )
            log.error("loading failed: %s", self.load_error)
            self.on_fatal()
            return
        self.ready = True
        log.info("ready: %s", self.settings.model_alias)

    def _warm_up(self, decoder: SpeculativeDecoder) -> None:
        decoder.generate("Hello", 4, n_draft=self.settings.n_draft, temperature=0.0)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close()

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise RequestError(
                401,
                "invalid or missing API key",
                kind="authentication_error",
                code="invalid_api_key",
            )

    def admit(self) -> None:
        if not self.ready or self.decoder is None:
            raise RequestError(
                503, "the model is still loading", kind="server_error", headers={"Retry-After": "5"}
            )
        if self.admitted >= self.settings.n_parallel + self.settings.max_queue:
            raise RequestError(
                503,
                "the server is at capacity; try again shortly",
                kind="server_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.admitted += 1
        self._update_gauges()

    def release(self) -> None:
        self.admitted -= 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        # n_parallel requests generate; the rest wait for a slot.
        n = self.settings.n_parallel
        self.metrics.running.set(min(self.admitted, n))
        self.metrics.waiting.set(max(self.admitted - n, 0))

    async def handle(self, request: Request, chat: bool) -> Response:
        started = time.monotonic()
        try:
            self.check_auth(request)
            body = await _read_json(request)
            self.admit()
        except RequestError as e:
            self.metrics.rejected.labels(status=str(e.status)).inc()
            return e.response()
        assert self.decoder is not None
        admitted_here = True
        try:
            job = _parse(body, chat, self.decoder, self.settings)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            if job.stream:
                admitted_here = False  # the stream releases it when it ends
                return EventSourceResponse(
                    self._stream(job, rid, chat, started),
                    ping=15,
                    sep="\n",
                    # On SIGTERM a running stream goes on to its end, within the grace period
                    # (by default sse-starlette cuts it at once).
                    shutdown_grace_period=self.settings.grace,
                )
            result = await self.decoder.agenerate(job.prompt, **job.kwargs)
            waited = self._finish(rid, result, started)
            return JSONResponse(self._completion(rid, chat, result, waited))
        except RequestError as e:
            self.metrics.rejected.labels(status=str(e.status)).inc()
            return e.response()
        except _core.ContextOverflowError as e:
            self.metrics.rejected.labels(status="400").inc()
            return RequestError(400, str(e), code="context_length_exceeded").response()
        except (ValueError, TypeError) as e:
            self.metrics.rejected.labels(status="400").inc()
            return RequestError(400, str(e)).response()
        except RuntimeError as e:  # the model or the backend failed (non-finite logits, ...)
            log.error("request failed: %s: %s", type(e).__name__, e)
            return RequestError(500, f"{type(e).__name__}: {e}", kind="server_error").response()
        finally:
            if admitted_here:
                self.release()

    def _finish(self, rid: str, result: GenerationResult, started: float) -> float:
        """Counts and logs a finished request; returns the seconds it waited for the engine."""
        seconds = time.monotonic() - started
        # Requests queue for the engine's thread before its own clock starts.
        waited = max(seconds - result.stats.t_total, result.stats.t_queue)
        self.metrics.observe(result, seconds, waited)
        s = result.stats
        fields = {
            "id": rid,
            "prompt_tokens": s.n_prompt,
            "cached_tokens": s.n_prompt_cached,
            "completion_tokens": s.n_generated,
            "finish_reason": result.finish_reason,
            "acceptance_rate": round(s.acceptance_rate, 3),
            "fallback_reason": s.draft_error or s.fallback_reason,
            "latency_s": round(seconds, 3),
        }
        log.info("request", extra={"fields": fields})
        return waited

    def _completion(
        self, rid: str, chat: bool, result: GenerationResult, waited: float
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(result)}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
            choice["logprobs"] = None
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.settings.model_alias,
            "choices": [choice],
            "usage": _usage(result),
            "timings": timings(result, waited),
        }

    def _chunk(self, rid: str, chat: bool, text: str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["text"] = text or ""
            choice["logprobs"] = None
        return {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.settings.model_alias,
            "choices": [choice],
        }

    async def _stream(self, job: Job, rid: str, chat: bool, started: float) -> AsyncIterator[str]:
        assert self.decoder is not None
        try:
            if chat:
                first = self._chunk(rid, chat, None, None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield json.dumps(first)
            # A client that goes away cancels this task: leaving the loop stops the generation.
            async for item in self.decoder.astream_events(job.prompt, **job.kwargs):
                if isinstance(item, str):
                    yield json.dumps(self._chunk(rid, chat, item, None))
                    continue
                waited = self._finish(rid, item, started)
                last = self._chunk(rid, chat, None if chat else "", _finish_reason(item))
                last["timings"] = timings(item, waited)
                yield json.dumps(last)
                if job.include_usage:
                    usage = self._chunk(rid, chat, None, None)
                    usage["choices"] = []
                    usage["usage"] = _usage(item)
                    yield json.dumps(usage)
            yield "[DONE]"
        except (_core.ContextOverflowError, ValueError, TypeError) as e:
            yield json.dumps({"error": {"message": str(e), "type": "invalid_request_error"}})
        except RuntimeError as e:  # the model or the backend failed mid-stream
            log.error("request failed: %s: %s", type(e).__name__, e)
            yield json.dumps(
                {"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}}
            )
        finally:
            self.release()


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        extra = " ".join(f"{k}={v}" for k, v in fields.items()) if fields else ""
        return f"[specdec] {self.formatTime(record)} {record.getMessage()} {extra}".rstrip()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname.lower()}
        out["message"] = record.getMessage()
        out.update(getattr(record, "fields", None) or {})
        return json.dumps(out)


def configure_log(log_format: str) -> None:
    """One line per event on stderr: `key=value` text, or one JSON object ("json")."""
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _TextFormatter())
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def create_app(
    load: Callable[[], SpeculativeDecoder],
    settings: ServerSettings,
    on_fatal: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The FastAPI app; `load` builds the decoder (called once, off the event loop), and
    `on_fatal` is called when that fails."""
    server = Server(load, settings, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A thread per admitted request: each only waits for its text (the decoder's own
        # scheduler thread runs every decode, for all of them in one batch per step).
        loop = asyncio.get_running_loop()
        workers = settings.n_parallel + settings.max_queue + 1
        loop.set_default_executor(ThreadPoolExecutor(workers, thread_name_prefix="request"))
        starting = asyncio.create_task(server.start())
        yield
        starting.cancel()
        server.close()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> JSONResponse:
        return e.response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle(request, chat=False)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        server.check_auth(request)
        model = {"id": settings.model_alias, "object": "model", "owned_by": "specdec", "created": 0}
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/health")
    async def health() -> Response:
        if server.ready:
            return JSONResponse({"status": "ok"})
        if server.load_error:
            return JSONResponse({"status": "error", "error": server.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

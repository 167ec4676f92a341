"""The OpenAI-compatible HTTP server behind `specdec-cli serve`.

A thin layer: it maps requests to SpeculativeDecoder calls, and results and their stats to
OpenAI response shapes, llama.cpp-style `timings` and Prometheus metrics. A request is one
`generate` call on a worker thread with its own cancel flag (a `Run`): a client that goes away,
streamed or not, cancels its own generation and nothing else, and whatever ends a run, its end is
counted and logged in one place.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import h11
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from specdec_native import __version__, _core, responses
from specdec_native.decoder import (
    AUTO,
    EngineClosedError,
    GenerationResult,
    GenerationSettings,
    SpeculativeDecoder,
    TokenLogprob,
)
from specdec_native.openai_api import (
    MAX_BODY_BYTES,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    ResponsesRequest,
    TokenizeRequest,
    components_of,
    in_responses_terms,
    openapi_body,
    parse_body,
    read_json,
    validated,
)
from specdec_native.tools import GENERIC, Streamed, ToolCall, ToolFormat
from specdec_native.tools import Message as ToolMessage

log = logging.getLogger("specdec.server")
# The ids of a request's answer, by endpoint, as OpenAI's begin.
RESPONSE_ID_PREFIX: dict[Endpoint, str] = {
    "chat": "chatcmpl-",
    "completion": "cmpl-",
    "response": "resp_",
}

# /health says ready once the models are loaded and the warm-up is done, or this many seconds
# into the warm-up, whichever is first: on a busy machine a warm-up can take minutes, and a
# readiness probe must not give up on a server that works (requests wait for the warm-up).
WARM_UP_BOUND = 20.0
# /tokenize and /detokenize: threads of their own, and calls admitted at once (more get a 503,
# as requests past the queue do: each holds its body, up to MAX_BODY_BYTES).
VOCAB_THREADS = 2
VOCAB_CALLS_ADMITTED = 16
SERVER_STATE = "specdec_server"  # the Server, in the app's lifespan state
# Names the build that answered, as OpenAI's field does.
SYSTEM_FINGERPRINT = f"specdec-{__version__}"
# A body slower than this (a client that stalls half-way) gets a 408: it holds an admission.
BODY_SECONDS = 60.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: OpenAI's defaults, unless the
    operator set others (`serve --temp`, `--repeat-penalty`, ... as llama-server takes them)."""

    temperature: float = 1.0  # OpenAI's; the Python API's is greedy
    top_k: int = GenerationSettings.top_k
    top_p: float = GenerationSettings.top_p
    min_p: float = GenerationSettings.min_p
    presence_penalty: float = GenerationSettings.presence_penalty
    frequency_penalty: float = GenerationSettings.frequency_penalty
    repeat_penalty: float = GenerationSettings.repeat_penalty
    repeat_last_n: int = GenerationSettings.repeat_last_n


@dataclass(frozen=True)
class ServerSettings:
    model_alias: str
    api_key: str | None = None
    n_parallel: int = 1  # requests generating at once (the decoder's slots)
    max_queue: int = 16
    request_timeout: float | None = None
    n_draft: int | str = AUTO
    grace: float = 30.0  # seconds running requests get to finish after SIGTERM
    ngram_index_file: Path | None = None  # the shared n-gram index: loaded at start, saved at exit
    sampling: SamplingDefaults = SamplingDefaults()


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

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


DRAFT_SOURCES = ("model", "ngram", "index", "grammar", "prediction")  # stats.drafted_by_*


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
        self.draft_tokens_by_source = Counter(
            "specdec:draft_tokens_by_source",
            "Draft tokens proposed, by source: model, ngram (the request's own text), index "
            "(earlier requests' outputs), grammar (forced tokens), prediction (the output a "
            "request predicted)",
            ["source"],
            registry=r,
        )
        self.accepted_tokens_by_source = Counter(
            "specdec:accepted_tokens_by_source",
            "Draft tokens accepted, by source",
            ["source"],
            registry=r,
        )
        self.index_tokens = Gauge(
            "specdec:ngram_index_tokens", "Tokens the shared n-gram index holds", registry=r
        )
        self.index_bytes = Gauge(
            "specdec:ngram_index_bytes", "The shared n-gram index's estimated bytes", registry=r
        )
        self.prompt_tokens = Counter("specdec:prompt_tokens", "Prompt tokens", registry=r)
        self.prompt_tokens_cached = Counter(
            "specdec:prompt_tokens_cached", "Prompt tokens reused from the cache", registry=r
        )
        self.generation_tokens = Counter(
            "specdec:generation_tokens", "Generated tokens", registry=r
        )
        self.requests = Counter(
            "specdec:requests",
            "Requests that ran, by how they ended: a finish reason, or disconnect, shutdown, "
            "grace, abandoned",
            ["finish_reason"],
            registry=r,
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
        self.threads = Gauge(
            "specdec:threads",
            "Threads the decodes use now (fewer while cores are busy)",
            registry=r,
        )
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

    def observe(
        self,
        result: GenerationResult,
        finish_reason: str,
        seconds: float,
        waited: float,
        generated: int,
    ) -> None:
        """One run's counts, as its client was told them (`finish_reason`, `generated` tokens)."""
        s = result.stats
        self.drafts.inc(s.n_speculative_steps)
        self.draft_tokens.inc(s.n_drafted)
        self.accepted_tokens.inc(s.n_accepted)
        for pos, n in enumerate(s.accepted_at):
            if n:
                self.accepted_per_pos.labels(position=str(pos)).inc(n)
        for source in DRAFT_SOURCES:
            self.draft_tokens_by_source.labels(source=source).inc(
                getattr(s, f"drafted_by_{source}")
            )
            self.accepted_tokens_by_source.labels(source=source).inc(
                getattr(s, f"accepted_by_{source}")
            )
        self.prompt_tokens.inc(s.n_prompt)
        self.prompt_tokens_cached.inc(s.n_prompt_cached)
        self.generation_tokens.inc(generated)
        self.requests.labels(finish_reason=finish_reason).inc()
        if s.fallback_reason or s.draft_error:
            self.fallbacks.labels(reason=s.draft_error or s.fallback_reason).inc()
        if s.n_generated:
            self.ttft.observe(waited + s.t_first_token - s.t_queue)
        if s.n_generated > 1:
            self.itl.observe(
                max(s.t_total - (s.t_first_token - s.t_queue), 0.0) / (s.n_generated - 1)
            )
        self.e2e.observe(seconds)


# -- requests ----------------------------------------------------------------------------------


@dataclass
class Job:
    """One parsed request: what to generate, and how."""

    prompt: str | list[int]
    settings: GenerationSettings
    stream: bool
    include_usage: bool
    tools: ToolFormat | None = None  # the output is read back as tool calls or an answer
    echo: bool = False  # the answer starts with the prompt (and its logprobs, if asked)
    scores_only: bool = False  # echo with max_tokens 0: the one token generated is not given


def _sampling(
    body: ChatCompletionRequest | CompletionRequest, defaults: SamplingDefaults
) -> dict[str, Any]:
    """The body's sampling fields, each the server's default where the body leaves it out."""
    return {
        name: default if getattr(body, name) is None else getattr(body, name)
        for name, default in asdict(defaults).items()
    }


def _jobs(
    body: ChatCompletionRequest | CompletionRequest,
    decoder: SpeculativeDecoder,
    settings: ServerSettings,
    fit: bool = False,
) -> list[Job]:
    """Maps a validated body to its generations: one per choice, n for each prompt, in order.
    `fit`: a chat too long for the context drops its oldest turns until it fits (the
    Responses API's truncation "auto")."""
    syntax = decoder.tool_syntax if isinstance(body, ChatCompletionRequest) else GENERIC
    tools = body.tool_format(syntax, decoder.special_tokens(syntax.tags))
    constraint = body.constraint(tools)
    prompts: list[str | list[int]]
    if isinstance(body, ChatCompletionRequest):
        given = [m.for_tools() for m in body.messages]

        def render(chat: list[ToolMessage]) -> str:
            messages, listed = syntax.chat(chat, tools)
            return decoder.apply_chat_template(
                messages, tools=listed, chat_template_kwargs=body.chat_template_kwargs
            )

        def fits(prompt: str) -> bool:
            return not _too_long(decoder, prompt)

        prompts = [_fitted(given, render, fits) if fit else render(given)]
    else:
        prompts = body.prompts
    spec = body.speculative
    limit = decoder.n_ctx
    echo = isinstance(body, CompletionRequest) and body.echo
    scores_only = isinstance(body, CompletionRequest) and body.scores_only
    generation = GenerationSettings.checked(
        # Without max_tokens, generate until the end token or a full context, as OpenAI does.
        max_tokens=1 if scores_only else min(body.token_limit or limit, limit),
        **_sampling(body, settings.sampling),
        seed=body.choice_seed(0),
        stop=body.stops,
        n_draft=settings.n_draft if spec is None or spec.n_max is None else spec.n_max,
        draft_p_min=0.0 if spec is None else spec.p_min,
        deadline=(
            time.monotonic() + settings.request_timeout if settings.request_timeout else None
        ),
        constraint=constraint,
        logprobs=body.n_logprobs,
        logit_bias=body.token_biases,
        ngram_index=body.ngram_index,
        ignore_eos=body.ignore_eos,
        prompt_logprobs=body.n_logprobs if echo else None,
        prediction=body.prediction.text if body.prediction else None,
    )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n or 1
    return [
        Job(
            prompt,
            replace(generation, seed=body.choice_seed(i)),
            body.stream,
            include_usage,
            tools,
            echo,
            scores_only,
        )
        for i, prompt in enumerate(p for p in prompts for _ in range(n))
    ]


def _too_long(decoder: SpeculativeDecoder, prompt: str) -> bool:
    """Whether a prompt leaves the context no room to generate (the engine refuses it)."""
    return len(decoder.tokenize(prompt, add_special=True, parse_special=True)) >= decoder.n_ctx


def _fitted(
    chat: list[ToolMessage],
    render: Callable[[list[ToolMessage]], str],
    fits: Callable[[str], bool],
) -> str:
    """The prompt of `chat`, or, where it does not fit, of `chat` without the fewest oldest
    turns that make it fit (the leading system messages and the last turn kept; a call's
    results go with it, none is left without its call): found by bisection, a few renderings
    however long the chat. Where none fits, the shortest."""
    whole = render(chat)
    system = next((i for i, m in enumerate(chat) if m.role not in ("system", "developer")), 0)
    # Where each turn begins: a message that is not a call's result.
    starts = [i for i in range(system, len(chat)) if chat[i].role != "tool"]
    lo, hi = 1, len(starts) - 1  # how many turns to drop: hi leaves the last turn alone
    if fits(whole) or lo > hi:
        return whole
    shortest = render(chat[:system] + chat[starts[hi] :])
    if not fits(shortest):
        return shortest
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(render(chat[:system] + chat[starts[mid] :])):
            hi = mid
        else:
            lo = mid + 1
    return render(chat[:system] + chat[starts[lo] :])


def _piece(raw: bytes) -> str | list[int]:
    """A token's text as llama-server gives it: a string, or its bytes where not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def _refusal(e: BaseException) -> RequestError:
    """The response to a call that raised instead of generating."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, BodyError):
        return RequestError(e.status, e.message, param=e.param)
    if isinstance(e, EngineClosedError):  # the server closed it while the call waited
        return _shutting_down()
    if isinstance(e, _core.ContextOverflowError):
        return RequestError(400, str(e), code="context_length_exceeded")
    if isinstance(e, (ValueError, TypeError)):
        return RequestError(400, str(e))
    # The model or the backend failed (non-finite logits, ...).
    return RequestError(500, f"{type(e).__name__}: {e}", kind="server_error")


Pieces = asyncio.Queue[tuple["Run", tuple[str, list[TokenLogprob]] | None]]


class Run:
    """One request's generation (SpeculativeDecoder.run) on a worker thread: its cancel flag,
    its text as it comes, when it ended, and why the server cut it short, if it did
    ("disconnect": the client went away; "shutdown": it still waited for a slot at SIGTERM;
    "grace": still running when the grace period ended; "abandoned": another choice of its
    request failed, or was cut at a shutdown, and so answered for it)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        job: Job,
        rid: str,
        chat: bool,
        arrived: float,
        on_start: Callable[[], None],
        pieces: Pieces | None,
        index: int | None,
        created: int,
    ) -> None:
        self.job, self.rid, self.chat, self.arrived = job, rid, chat, arrived
        self.index = index  # its choice's, in a request of several
        self.created = created  # the request's: every chunk and answer of it carries it
        self.flag = _core.CancelFlag()
        self.started = asyncio.Event()  # the engine gave it a slot: every check passed
        # A stream's text as committed, with its tokens' logprobs when asked for; None: no more.
        # One queue for all the choices of a request, so that a stream of several reads them as
        # they come. An answer not streamed has none: it is built from the result, and its
        # worker is not woken at every step (a wake-up takes a core from the decode's threads).
        self.pieces = pieces
        self.cut: str | None = None
        self.ended = arrived  # when the generation returned (set then)
        self._answer: tuple[str, list[ToolCall]] | None = None
        loop = asyncio.get_running_loop()

        # On the worker thread: hand over to the event loop. A piece's logprobs come just
        # before its text.
        logprobs: list[TokenLogprob] = []

        def logprobs_came(entries: list[TokenLogprob]) -> None:
            logprobs.extend(entries)

        def text_came(text: str) -> None:
            piece = (text, logprobs.copy())
            logprobs.clear()
            loop.call_soon_threadsafe(self.put_piece, piece)

        def slot_taken() -> None:
            loop.call_soon_threadsafe(self._started, on_start)

        call = functools.partial(
            decoder.run,
            job.prompt,
            job.settings,
            on_text=None if pieces is None else text_came,
            on_start=slot_taken,
            cancel=self.flag,
            on_logprobs=None if pieces is None or job.settings.logprobs is None else logprobs_came,
        )
        self.future: asyncio.Future[GenerationResult] = loop.run_in_executor(None, call)
        # Runs after every piece the worker handed over (call_soon_threadsafe keeps their order).
        self.future.add_done_callback(self._returned)

    def put_piece(self, piece: tuple[str, list[TokenLogprob]] | None) -> None:
        if self.pieces is not None:
            self.pieces.put_nowait((self, piece))

    def _returned(self, _: object) -> None:
        self.ended = time.monotonic()
        self.put_piece(None)

    def waited(self, result: GenerationResult) -> float:
        """Seconds it waited for the engine (it queues for the engine's thread before the
        engine's own clock starts)."""
        return max(self.ended - self.arrived - result.stats.t_total, result.stats.t_queue)

    def _started(self, then: Callable[[], None]) -> None:
        self.started.set()
        then()

    def answer(
        self, result: GenerationResult, streamed: str | None = None
    ) -> tuple[str, list[ToolCall]]:
        """A chat output with tools as (content, calls), read once (ToolFormat.output)."""
        if self._answer is None:
            assert self.job.tools is not None
            self._answer = self.job.tools.output(result.text, streamed)
        return self._answer

    def called_tools(self, result: GenerationResult) -> bool:
        """Whether the output is tool calls (answered with finish_reason "tool_calls")."""
        return self.chat and self.job.tools is not None and bool(self.answer(result)[1])

    def cancel(self, why: str) -> None:
        if not self.future.done():
            self.cut = self.cut or why
            self.flag.cancel()


async def _until_decided(runs: list[Run], request: Request, *, started: bool = False) -> bool:
    """Waits until every run has ended, or one has failed or was cut at a shutdown (the answer
    is then that, and the others are abandoned), or, with `started`, each has a slot or has
    ended (a stream opens then: every check has passed): True. If the client goes away first,
    all are cancelled: False."""
    decided: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(runs)

    def ended(run: Run, future: asyncio.Future[GenerationResult]) -> None:
        nonlocal left
        left -= 1
        failed = future.exception() is not None or run.cut == "shutdown"
        if (failed or left == 0) and not decided.done():
            decided.set_result(None)

    for run in runs:
        run.future.add_done_callback(functools.partial(ended, run))
    awaited: set[asyncio.Future[Any]] = {decided}
    if started:
        awaited.add(asyncio.ensure_future(_all_settled(runs)))
    gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait(awaited | {gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in awaited - {decided} | {gone}:
            waiter.cancel()
    if decided.done():
        for run in runs:
            run.cancel("abandoned")  # those still running or waiting
        return True
    if started and all(run.started.is_set() or run.future.done() for run in runs):
        return True
    for run in runs:
        run.cancel("disconnect")
    return False


async def _all_settled(runs: list[Run]) -> None:
    """Returns when each run has a slot or has ended."""
    for run in runs:
        slot = asyncio.ensure_future(run.started.wait())
        either: set[asyncio.Future[Any]] = {slot, run.future}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            slot.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (its body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- responses ---------------------------------------------------------------------------------


def _answer_end(answer: tuple[str, list[ToolCall]], streamed: str) -> list[dict[str, Any]]:
    """The deltas a streamed output with tools, read as (content, calls), ends with: what of
    its content was not `streamed` yet, then its tool calls."""
    content, calls = answer
    rest = content[len(streamed) :]
    deltas: list[dict[str, Any]] = [{"content": rest}] if rest else []
    return deltas + [{"tool_calls": [call.openai(i)]} for i, call in enumerate(calls)]


def _failure(runs: list[Run]) -> RequestError | None:
    """What answers for a request whose choice failed or was cut at a shutdown: the first
    such choice's refusal; None if none did."""
    for run in runs:
        if not run.future.done():
            continue  # abandoned: another's failure decided
        if (error := run.future.exception()) is not None:
            return _refusal(error)
        if run.cut == "shutdown":
            return _shutting_down()
    return None


def _total_usage(usages: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The usage of a request's choices, n for each prompt in order: a prompt counts once."""
    prompt_tokens = sum(u["prompt_tokens"] for u in usages[::n])
    completion_tokens = sum(u["completion_tokens"] for u in usages)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages[::n])
        },
        "completion_tokens_details": {
            key: sum(u["completion_tokens_details"][key] for u in usages)
            for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")
        },
    }


def _finish_reason(result: GenerationResult) -> str:
    # OpenAI knows "stop" and "length"; a full context or a deadline ends the text by length.
    return "stop" if result.finish_reason == "stop" else "length"


def _usage(result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "prompt_tokens": s.n_prompt,
        "completion_tokens": s.n_generated,
        "total_tokens": s.n_prompt + s.n_generated,
        "prompt_tokens_details": {"cached_tokens": s.n_prompt_cached},
        # As OpenAI counts them: the prediction's tokens that appear in the output (in order),
        # and the rest of it, however the output was drafted.
        "completion_tokens_details": {
            "accepted_prediction_tokens": s.n_prediction_in_output,
            "rejected_prediction_tokens": s.n_prediction - s.n_prediction_in_output,
        },
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
        # As llama-server's: every generated token over the generation's time.
        "predicted_per_second": s.n_generated / gen if gen > 0 else 0.0,
        "draft_n": s.n_drafted,
        "draft_n_accepted": s.n_accepted,
        "acceptance_rate": s.acceptance_rate,
        "draft_n_by_source": {src: getattr(s, f"drafted_by_{src}") for src in DRAFT_SOURCES},
        "draft_n_accepted_by_source": {
            src: getattr(s, f"accepted_by_{src}") for src in DRAFT_SOURCES
        },
        "fallback_reason": s.draft_error or s.fallback_reason,
        "queue_ms": waited * 1e3,
        "shared_steps": s.n_shared_steps,
        "finish_reason": result.finish_reason,
    }


class Server:
    """The decoder, the requests admitted (running or waiting), the metrics; request handling
    on top."""

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
        self.draining = False  # SIGTERM came: no new work
        # Set with `draining`: wakes the bodies still arriving (made on the server's loop).
        self.drained: asyncio.Event | None = None
        self.index_refused = False  # the n-gram index file was not ours to load
        self.load_error: str | None = None
        self.admitted = 0  # requests past admission: parsing, waiting for a slot or running
        self.runs: set[Run] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        # /tokenize and /detokenize: their own threads, so that they never hold up a request's.
        self.vocab_pool = ThreadPoolExecutor(VOCAB_THREADS, thread_name_prefix="vocab")
        self.vocab_calls = 0  # admitted: waiting for a vocabulary thread or running

    async def start(self) -> None:
        """Loads the models and warms up (costs calibrated, one tiny generation), off the event
        loop; /health answers 503 until the models are loaded and the warm-up is done or has
        taken WARM_UP_BOUND seconds."""
        loop = self.loop = asyncio.get_running_loop()
        self.drained = asyncio.Event()
        try:
            self.decoder = await loop.run_in_executor(None, self.load)
            await loop.run_in_executor(None, self._load_index, self.decoder)
            warm_up = loop.run_in_executor(None, self._warm_up, self.decoder)
            done, _ = await asyncio.wait({warm_up}, timeout=WARM_UP_BOUND)
            if done:
                warm_up.result()
            else:
                log.warning(
                    "the warm-up is taking over %.0f s (a busy machine?): ready; the first "
                    "requests wait for it",
                    WARM_UP_BOUND,
                )
                warm_up.add_done_callback(self._warmed_up_late)
        except Exception as e:  # a server without its model stops (and says why)
            self.load_error = (
                str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
            )
            log.error("loading failed: %s", self.load_error)
            self.on_fatal()
            return
        self.ready = True
        log.info("ready: %s", self.settings.model_alias)

    def _load_index(self, decoder: SpeculativeDecoder) -> None:
        path = self.settings.ngram_index_file
        if path is None or not path.exists():
            return
        try:
            decoder.load_ngram_index(path)
            log.info("n-gram index loaded: %d tokens", decoder.ngram_index["tokens"])
        except (OSError, ValueError, MemoryError, RuntimeError) as e:
            # A server starts cold rather than not at all; and leaves a file that is not its
            # own (another model's index?) as it found it.
            self.index_refused = True
            log.warning("n-gram index not loaded (it will not be saved over): %s", e)

    def _save_index(self, decoder: SpeculativeDecoder) -> None:
        path = self.settings.ngram_index_file
        if path is None or not self.ready or self.index_refused:
            return
        try:
            decoder.save_ngram_index(path)
            log.info("n-gram index saved: %d tokens", decoder.ngram_index["tokens"])
        except (OSError, ValueError, RuntimeError) as e:
            log.error("n-gram index not saved: %s", e)

    def _warm_up(self, decoder: SpeculativeDecoder) -> None:
        decoder.generate(
            "Hello", 4, n_draft=self.settings.n_draft, temperature=0.0, ngram_index=False
        )
        # Without a drafter the warm-up does not draft, so `auto`'s costs, which requests with
        # a prediction need, are measured here rather than in the first of them.
        if self.settings.n_draft == AUTO and not decoder.policy_state()["calibrated"]:
            decoder.calibrate()

    def _warmed_up_late(self, warm_up: asyncio.Future[None]) -> None:
        if warm_up.cancelled():
            return
        error = warm_up.exception()
        if error is not None:
            log.error("the warm-up failed: %s: %s", type(error).__name__, error)
        else:
            log.info("warm-up done")

    def close(self) -> None:
        self.vocab_pool.shutdown(wait=False, cancel_futures=True)
        if self.decoder is not None:
            # The save waits for no request to be running: those still running are cut first.
            self._cut_running()
            self._save_index(self.decoder)
            self.decoder.close()
        log.info("stopped")

    # -- shutdown ------------------------------------------------------------------------------

    def begin_shutdown(self, why: str) -> None:
        """On SIGTERM (from the signal handler; `why` names it for the log): requests still
        waiting for a slot get a 503 at once, new ones too; running ones get `grace` seconds,
        then are cut (a stream ends with a finish reason and [DONE])."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._drain, why)

    def _drain(self, why: str) -> None:
        if self.draining:
            return
        self.draining = True
        if self.drained is not None:
            self.drained.set()
        waiting = [run for run in self.runs if not run.started.is_set()]
        fields = {"signal": why, "running": len(self.runs) - len(waiting), "waiting": len(waiting)}
        log.info("shutting down", extra={"fields": fields | {"grace_s": self.settings.grace}})
        for run in waiting:
            run.cancel("shutdown")
        assert self.loop is not None
        self.loop.call_later(self.settings.grace, self._cut_running)

    def _cut_running(self) -> None:
        if self.runs:
            log.info("cutting running requests", extra={"fields": {"running": len(self.runs)}})
        for run in list(self.runs):
            run.cancel("grace")

    # -- admission -----------------------------------------------------------------------------

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

    def admit_more(self, k: int) -> None:
        """Admits k more runs for a request of several choices, all or none."""
        if k <= 0:
            return
        most = self.settings.n_parallel + self.settings.max_queue
        if k + 1 > most:
            raise RequestError(
                400, f"this server holds at most {most} generations at once: ask for fewer choices"
            )
        if self.admitted + k > most:
            raise _at_capacity()
        self.admitted += k
        self._update_gauges()

    def admit(self) -> None:
        self.open_decoder()
        if self.admitted >= self.settings.n_parallel + self.settings.max_queue:
            raise _at_capacity()
        self.admitted += 1
        self._update_gauges()

    def open_decoder(self) -> SpeculativeDecoder:
        """The decoder, once new work may use it (a 503 while the server drains or loads)."""
        if self.draining:
            raise _shutting_down()
        if not self.ready or self.decoder is None:
            raise RequestError(
                503, "the model is still loading", kind="server_error", headers={"Retry-After": "5"}
            )
        return self.decoder

    def release(self) -> None:
        self.admitted -= 1
        self._update_gauges()

    def _update_gauges(self) -> None:
        running = sum(1 for run in self.runs if run.started.is_set() and not run.future.done())
        self.metrics.running.set(running)
        self.metrics.waiting.set(self.admitted - running)

    # -- the vocabulary (llama-server's /tokenize and /detokenize) --------------------------------

    async def vocab_call(
        self, request: Request, work: Callable[[SpeculativeDecoder, Any], dict[str, Any]]
    ) -> Response:
        """`work` on the decoder and the body, on the vocabulary's own threads (no slot: these
        never decode), once the caller may use it; its answer encoded there too."""
        rid = "vocab-" + uuid.uuid4().hex
        try:
            self.check_auth(request)
            decoder = self.open_decoder()
            if self.vocab_calls >= VOCAB_CALLS_ADMITTED:
                raise _at_capacity()
        except RequestError as e:
            return self.refuse(rid, e)
        self.vocab_calls += 1  # before the body arrives: admitted calls bound what bodies hold
        raw = await self.admitted_body(request, rid, self._vocab_call_done)
        if isinstance(raw, Response):
            return raw
        job = self.vocab_pool.submit(lambda: json.dumps(work(decoder, read_json(raw))).encode())
        # Counted until the thread is done with it, even where this handler is cancelled first.
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._vocab_call_done))
        result: asyncio.Future[Any] = asyncio.wrap_future(job)
        gone: asyncio.Future[Any] = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not result.done():  # the client went away: work not begun yet is dropped, and its
            job.cancel()  # admission released, so that abandoned calls lock nobody out
            return self.refuse(rid, RequestError(499, "the client hung up before the answer"))
        try:
            body = result.result()
        except Exception as e:
            return self.refuse(rid, _refusal(e))
        return Response(body, media_type="application/json")

    def _vocab_call_done(self) -> None:
        self.vocab_calls -= 1

    async def admitted_body(
        self, request: Request, rid: str, release: Callable[[], None]
    ) -> bytes | Response:
        """An admitted request's body; or, where it cannot be read, its admission released and
        the refusal to answer with."""
        try:
            return await self.read_body(request)
        except BaseException as e:
            release()
            if isinstance(e, RequestError):
                return self.refuse(rid, e)
            raise

    async def read_body(self, request: Request) -> bytes:
        """The body, within bounds (size, BODY_SECONDS); a 503 once the server drains."""
        assert self.drained is not None  # requests come once the server has started
        reading = asyncio.ensure_future(_read_body(request))
        drained = asyncio.ensure_future(self.drained.wait())
        try:
            done, _ = await asyncio.wait(
                {reading, drained}, timeout=BODY_SECONDS, return_when=asyncio.FIRST_COMPLETED
            )
        finally:  # this handler cancelled too: nothing reads on for it
            drained.cancel()
            if not reading.done():
                reading.cancel()
        if reading in done:
            return reading.result()
        if drained in done:
            raise _shutting_down()
        raise RequestError(408, f"the request body took over {BODY_SECONDS:g} s to arrive")

    # -- requests ------------------------------------------------------------------------------

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        """A request to the endpoint `endpoint` reads as: "chat", "completion" or "response"
        (OpenAI's Responses API, answered as the chat request it maps to)."""
        arrived = time.monotonic()
        chat = endpoint != "completion"
        rid = RESPONSE_ID_PREFIX[endpoint] + uuid.uuid4().hex
        try:
            self.check_auth(request)
            self.admit()  # before the body: admitted requests bound what bodies hold
        except RequestError as e:
            return self.refuse(rid, e)
        raw = await self.admitted_body(request, rid, self.release)
        if isinstance(raw, Response):
            return raw
        assert self.decoder is not None
        ask: ResponsesRequest | None = None
        try:
            body, ask = parse_body(read_json(raw), endpoint)
            # Off the event loop: a chat template's rendering may take its time budget.
            loop = asyncio.get_running_loop()
            fit = ask is not None and ask.truncation == "auto"
            jobs = await loop.run_in_executor(None, _jobs, body, self.decoder, self.settings, fit)
            self.admit_more(len(jobs) - 1)
        except Exception as e:  # a bad body, or a chat template that cannot take the messages
            self.release()
            if ask is not None:
                e = in_responses_terms(e)  # the chat request's checks, in its own terms
            return self.refuse(rid, _refusal(e))
        except BaseException:  # this handler cancelled while the template rendered
            self.release()
            raise
        runs = self._start(jobs, rid, chat, arrived, bool(body.stream))
        if body.stream:
            return await self._stream(request, runs, body.n or 1, ask)
        return await self._choices(request, runs, body.n or 1, ask)

    def _start(
        self, jobs: list[Job], rid: str, chat: bool, arrived: float, stream: bool
    ) -> list[Run]:
        """A run for each admitted job (its end releases its admission; a choice among several
        is logged with its index). If one cannot start, the admissions of those not started
        are released and the started ones abandoned."""
        assert self.decoder is not None
        runs: list[Run] = []
        pieces: Pieces = asyncio.Queue()
        created = int(time.time())
        try:
            for i, job in enumerate(jobs):
                index = i if len(jobs) > 1 else None
                run = Run(
                    self.decoder,
                    job,
                    rid,
                    chat,
                    arrived,
                    self._update_gauges,
                    pieces if stream else None,
                    index,
                    created,
                )
                self.runs.add(run)
                run.future.add_done_callback(functools.partial(self._ended_future, run))
                runs.append(run)
        except BaseException:
            for _ in jobs[len(runs) :]:
                self.release()
            for run in runs:
                run.cancel("abandoned")
            raise
        return runs

    async def _choices(
        self, request: Request, runs: list[Run], n: int, ask: ResponsesRequest | None
    ) -> Response:
        """A request's answer, not streamed: once all its choices (n for each prompt) have
        ended, or at once where one's failure decides it (`ask`: as the response it asked
        for)."""
        if not await _until_decided(runs, request):
            return Response(status_code=499)  # nobody is there to read it
        if (refusal := _failure(runs)) is not None:
            return refusal.response()
        for run in runs:
            if run.job.echo and not _scored_whole(run.job, run.future.result()):
                return _not_scored(run.cut or run.future.result().finish_reason).response()
        answers = [self._completion(run, run.future.result()) for run in runs]
        out = answers[0]
        if len(answers) > 1:
            out["choices"] = [a["choices"][0] | {"index": i} for i, a in enumerate(answers)]
            out["usage"] = _total_usage([a["usage"] for a in answers], n)
        return JSONResponse(out if ask is None else responses.from_completion(ask, out))

    async def _stream(
        self, request: Request, runs: list[Run], n: int, ask: ResponsesRequest | None
    ) -> Response:
        """A request's answer as server-sent events, once each of its choices has a slot (a
        choice that cannot start, or a shutdown before it has, is answered as such); `ask`:
        as the events of the response it asked for."""
        if not await _until_decided(runs, request, started=True):
            return Response(status_code=499)  # nobody is there to read it
        if (refusal := _failure(runs)) is not None:
            return refusal.response()
        return EventSourceResponse(
            self._events(runs, n) if ask is None else self._response_events(runs[0], ask),
            ping=15,
            sep="\n",
            # Running streams are cut at the grace limit by the server itself, with a last
            # chunk and [DONE]; sse-starlette's own cut is only a backstop.
            shutdown_grace_period=self.settings.grace + 5,
        )

    def _ended_future(self, run: Run, _: object) -> None:
        self._ended(run)

    def refuse(self, rid: str, e: RequestError) -> Response:
        """A request refused (or given up by its client) before it ran: counted by its status
        and logged."""
        self.metrics.rejected.labels(status=str(e.status)).inc()
        log.info("refused", extra={"fields": {"id": rid, "status": e.status, "error": e.message}})
        return e.response()

    def _ended(self, run: Run) -> None:
        """Every run ends here, on the event loop, whatever ended it: one count, one log line."""
        self.runs.discard(run)
        self.release()
        error = run.future.exception()
        fields: dict[str, Any] = {"id": run.rid}
        if run.index is not None:
            fields["choice"] = run.index
        if error is not None:
            refusal = _refusal(error)
            self.metrics.rejected.labels(status=str(refusal.status)).inc()
            if refusal.status >= 500:
                log.error("request failed: %s", refusal.message, extra={"fields": fields})
            else:
                fields.update(status=refusal.status, error=refusal.message)
                log.info("refused", extra={"fields": fields})
            return
        result = run.future.result()
        seconds = run.ended - run.arrived
        waited = run.waited(result)
        # A cut names who cut it: the client, a shutdown, the grace limit.
        ended = run.cut if result.finish_reason == "cancelled" and run.cut else result.finish_reason
        if ended in ("stop", "length") and run.called_tools(result):
            ended = "tool_calls"  # as the client was told
        if ended in ("stop", "length") and run.job.scores_only:
            ended = "length"  # as the client was told: its token is not given
        generated = 0 if run.job.scores_only else result.stats.n_generated
        self.metrics.observe(result, ended, seconds, waited, generated)
        s = result.stats
        fields.update(
            prompt_tokens=s.n_prompt,
            cached_tokens=s.n_prompt_cached,
            completion_tokens=generated,
            finish_reason=str(ended),
            acceptance_rate=round(s.acceptance_rate, 3),
            fallback_reason=s.draft_error or s.fallback_reason,
            latency_s=round(seconds, 3),
        )
        log.info("request", extra={"fields": fields})

    def _completion(self, run: Run, result: GenerationResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _finish_reason(result)}
        choice["logprobs"] = self._logprobs(run, result.logprobs)
        if run.chat and run.job.tools is not None:
            content, calls = run.answer(result)
            # No content beside calls is null, as OpenAI writes it.
            choice["message"] = {
                "role": "assistant",
                "content": content or (None if calls else ""),
                "refusal": None,
            }
            if calls:
                choice["message"]["tool_calls"] = [call.openai() for call in calls]
                choice["finish_reason"] = "tool_calls"
        elif run.chat:
            choice["message"] = {"role": "assistant", "content": result.text, "refusal": None}
        elif run.job.echo:
            choice["text"], choice["logprobs"] = self._echoed(run, result)
        else:
            choice["text"] = result.text
        usage = _usage(result)
        if run.job.scores_only:  # what it generated is not given
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
            choice["finish_reason"] = "length"
        return {
            "id": run.rid,
            "object": "chat.completion" if run.chat else "text_completion",
            "created": run.created,
            "model": self.settings.model_alias,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
            "usage": usage,
            "timings": timings(result, run.waited(result)),
        }

    def _echoed(self, run: Run, result: GenerationResult) -> tuple[str, dict[str, Any] | None]:
        """The prompt, then the completion (none for max_tokens 0), and with logprobs all
        their tokens': the prompt's from its decode, the first null where nothing came before
        it. A BOS the server's tokenizing added is not the client's text: not echoed (the
        client's first token is then scored, after it)."""
        job, decoder = run.job, self.decoder
        assert decoder is not None
        prompt = job.prompt if isinstance(job.prompt, str) else decoder.detokenize(job.prompt)
        text = prompt + ("" if job.scores_only else result.text)
        if result.prompt_logprobs is None:
            return text, None
        # The token after the prompt, the end token too: a scorer drops the last entry.
        generated = [] if job.scores_only else (result.logprobs or [])
        if not job.scores_only and result.stop_logprob is not None:
            generated = [*generated, result.stop_logprob]
        tokens = result.prompt_tokens
        info = decoder.info()["target"]
        if isinstance(job.prompt, str) and info["add_bos"] and tokens[0] == info["bos"]:
            echoed = tokens[1:]
            out = self._logprobs(run, result.prompt_logprobs + generated)
        else:
            # The first token: no logprob, nothing before it predicted it.
            echoed = tokens
            (first,) = decoder.token_bytes(tokens[:1])
            at = TextOffsets()
            head = {
                "tokens": [first.decode("utf-8", "replace")],
                "token_logprobs": [None],
                "top_logprobs": [None],
                "text_offset": [at.next(first)],
            }
            rest = self._logprobs(run, result.prompt_logprobs + generated, at)
            assert rest is not None
            out = {name: head[name] + rest[name] for name in head}
        assert out is not None
        if isinstance(job.prompt, str):
            # A tokenizer that puts a space before the text (SentencePiece's Llama) spells the
            # prompt with one more character than the client sent: offsets are the client's.
            spelled = b"".join(decoder.token_bytes(echoed)).decode("utf-8", "replace")
            extra = len(spelled) - len(prompt)
            if extra > 0 and spelled.endswith(prompt):
                out["text_offset"] = [max(0, at - extra) for at in out["text_offset"]]
        return text, out

    def _chunk(
        self, run: Run, text: str | None, finish: str | None, delta: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A chunk of a stream: `text` of run's choice (or, on chat, `delta`)."""
        choice: dict[str, Any] = {"index": run.index or 0, "finish_reason": finish}
        if run.chat:
            choice["delta"] = delta or ({} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
            choice["logprobs"] = None
        chunk: dict[str, Any] = {
            "id": run.rid,
            "object": "chat.completion.chunk" if run.chat else "text_completion",
            "created": run.created,
            "model": self.settings.model_alias,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
        }
        if run.job.include_usage:
            chunk["usage"] = None  # as OpenAI's: only the last chunk has usage
        return chunk

    def _logprobs(
        self, run: Run, entries: list[TokenLogprob] | None, offsets: TextOffsets | None = None
    ) -> dict[str, Any] | None:
        """Tokens' logprobs in OpenAI's shape for the endpoint: a whole output's, or a streamed
        chunk's (``offsets``: where the output's text stands after the chunks before it)."""
        if entries is None:
            return None
        assert self.decoder is not None
        ids = [e.token for e in entries] + [t for e in entries for t, _ in e.top]
        pieces = dict(zip(ids, self.decoder.token_bytes(ids)))

        def text(token: int) -> str:
            return pieces[token].decode("utf-8", "replace")

        if run.chat:

            def item(token: int, logprob: float) -> dict[str, Any]:
                return {"token": text(token), "logprob": logprob, "bytes": list(pieces[token])}

            content = [
                item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
            return {"content": content, "refusal": None}
        at = offsets or TextOffsets()
        return {
            "tokens": [text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": [at.next(pieces[e.token]) for e in entries],
        }

    async def _chunks(self, runs: list[Run], n: int) -> AsyncGenerator[dict[str, Any], None]:
        """The runs' text as chunks (each choice's by its index, as they come), each one's
        finish reason, then the usage of all if asked for; or, where a run failed, an error
        object last. A client that goes away cancels this task: leaving here cancels the runs."""
        try:
            if runs[0].chat:
                for run in runs:
                    yield self._chunk(run, None, None, {"role": "assistant", "content": ""})
            streams = {run: _ChoiceStream(run) for run in runs}
            usages: dict[Run, dict[str, Any]] = {}  # as each ends
            pieces = runs[0].pieces
            assert pieces is not None  # a stream's runs hand their text over
            while len(usages) < len(runs):
                run, piece = await pieces.get()
                stream = streams[run]
                if piece is not None:
                    for chunk in self._piece_chunks(stream, *piece):
                        yield chunk
                    continue
                error = run.future.exception()
                if error is not None:  # the model or the backend failed mid-stream
                    for other in runs:
                        other.cancel("abandoned")
                    refusal = _refusal(error)
                    yield {"error": {"message": refusal.message, "type": refusal.kind}}
                    return
                for chunk in self._end_chunks(stream):
                    yield chunk
                usages[run] = _usage(run.future.result())
            if runs[0].job.include_usage:
                usage = self._chunk(runs[0], None, None)
                usage["choices"] = []
                usage["usage"] = _total_usage([usages[run] for run in runs], n)  # in order
                yield usage
        finally:
            for run in runs:
                run.cancel("disconnect")  # no effect once a run has ended

    async def _events(self, runs: list[Run], n: int) -> AsyncIterator[str]:
        """The chunks as server-sent events, then [DONE] unless one was an error."""
        async with aclosing(self._chunks(runs, n)) as chunks:
            async for chunk in chunks:
                yield json.dumps(chunk)
                if "error" in chunk:
                    return
        yield "[DONE]"

    async def _response_events(
        self, run: Run, ask: ResponsesRequest
    ) -> AsyncIterator[ServerSentEvent]:
        """A response's events (named by their type, as OpenAI sends them) from its run's
        chunks, the whole response last."""
        events = responses.ResponseEvents(ask, run.rid, run.created, self.settings.model_alias)

        def sse(items: list[dict[str, Any]]) -> list[ServerSentEvent]:
            return [ServerSentEvent(json.dumps(e), event=e["type"]) for e in items]

        for event in sse(events.start()):
            yield event
        async with aclosing(self._chunks([run], 1)) as chunks:
            async for chunk in chunks:
                if "error" in chunk:
                    for event in sse(events.failed(chunk["error"]["message"])):
                        yield event
                    return
                for event in sse(events.chunk(chunk)):
                    yield event
        final = responses.from_completion(ask, self._completion(run, run.future.result()))
        for event in sse(events.end(final)):
            yield event

    def _piece_chunks(
        self, stream: _ChoiceStream, text: str, logprobs: list[TokenLogprob]
    ) -> list[dict[str, Any]]:
        """The chunks of a piece of a choice's text. Each carries its tokens' logprobs; with
        tools, whose text is rewritten as it streams, the last chunk carries them all."""
        run = stream.run
        if stream.answer is not None:
            return [self._chunk(run, part, None) for part in stream.answer.feed(text)]
        chunk = self._chunk(run, text, None)
        if logprobs:
            chunk["choices"][0]["logprobs"] = self._logprobs(run, logprobs, stream.offsets)
            stream.sent += len(logprobs)
        return [chunk]

    def _end_chunks(self, stream: _ChoiceStream) -> list[dict[str, Any]]:
        """The chunks that end a choice: with tools, the content not yet streamed and the
        calls; then its finish reason, the logprobs not yet sent and its timings."""
        run, result = stream.run, stream.run.future.result()
        chunks, finish = [], _finish_reason(result)
        if run.job.tools is not None and stream.answer is not None:
            streamed = stream.answer.streamed
            for delta in _answer_end(run.answer(result, streamed), streamed):
                finish = "tool_calls" if "tool_calls" in delta else finish
                chunks.append(self._chunk(run, None, None, delta))
        last = self._chunk(run, None if run.chat else "", finish)
        rest = None if result.logprobs is None else result.logprobs[stream.sent :]
        last["choices"][0]["logprobs"] = self._logprobs(run, rest or None, stream.offsets)
        last["timings"] = timings(result, run.waited(result))
        return [*chunks, last]


class _ChoiceStream:
    """Where a streamed choice stands: its answer so far (with tools), and how many of its
    tokens' logprobs were sent and where their text ends."""

    def __init__(self, run: Run) -> None:
        self.run = run
        tools = run.job.tools
        self.answer: Streamed | None = None if tools is None else tools.streamed()
        self.sent = 0
        self.offsets = TextOffsets()


def _at_capacity() -> RequestError:
    return RequestError(
        503,
        "the server is at capacity; try again shortly",
        kind="server_error",
        code="queue_full",
        headers={"Retry-After": "1"},
    )


def _scored_whole(job: Job, result: GenerationResult) -> bool:
    """Whether an echo's logprobs cover the whole prompt, and (but for max_tokens 0) the token
    after it: a scorer reads the last entry as the generated one."""
    if result.prompt_logprobs is None:
        return True  # no logprobs asked for: the text alone
    whole = len(result.prompt_logprobs) == len(result.prompt_tokens) - 1
    after = job.scores_only or bool(result.logprobs) or result.stop_logprob is not None
    return whole and after


def _not_scored(why: str) -> RequestError:
    # Partial logprobs would read as a complete (and too likely) score.
    return RequestError(
        503,
        f"the request ended ({why}) before its prompt and the token after it were scored",
        kind="server_error",
        code="not_scored",
    )


def _shutting_down() -> RequestError:
    return RequestError(
        503,
        "the server is shutting down; try another replica or again shortly",
        kind="server_error",
        code="shutting_down",
        headers={"Retry-After": "5"},
    )


class TextOffsets:
    """Where each token's text starts in an output, in characters: what the bytes of the tokens
    before it decode to (a token may start inside a character that the one before it began)."""

    def __init__(self) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.at = 0

    def next(self, piece: bytes) -> int:
        """The offset of the token whose bytes are ``piece``, the one after the last."""
        start = self.at
        self.at += len(self.decoder.decode(piece))
        return start


def _body_too_large() -> RequestError:
    # The rest of the body is not kept: the connection closes after the answer, reading and
    # dropping what its client still sends for a while (_LingeringTransport), rather than leave
    # it blocked sending until the keep-alive timeout.
    why = f"the request body is over {MAX_BODY_BYTES} bytes"
    return RequestError(413, why, headers={"Connection": "close"})


async def _read_body(request: Request) -> bytes:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(415, f"the body's Content-Encoding {encoding!r} is not supported")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _body_too_large()
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _body_too_large()
            chunks.append(chunk)
    except ClientDisconnect:  # counted and logged as a refusal nobody reads
        raise RequestError(499, "the client hung up while sending the body") from None
    return b"".join(chunks)


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


# How long a connection closed while its client still sends a request reads what comes.
LINGER_SECONDS = 5.0


class _LingeringTransport:
    """A connection's transport, except that closing it while its client is still sending a
    request (a refused oversized body, say) first sends what is written and the end of it, and
    reads and drops what comes for LINGER_SECONDS or until the client closes: a socket closed
    with unread data is reset, and the reset can reach the client before the answer does."""

    def __init__(self, inner: asyncio.Transport, protocol: BoundedHttp) -> None:
        self.inner, self.protocol = inner, protocol
        self.lingering = False
        self.deadline: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def is_closing(self) -> bool:
        return self.lingering or self.inner.is_closing()

    def close(self) -> None:
        if self.lingering or self.inner.is_closing() or not self.protocol.may_linger():
            self.end()
            return
        try:
            self.inner.write_eof()
        except OSError:  # the client reset the connection already
            self.end()
            return
        self.lingering = True
        self.inner.resume_reading()
        self.deadline = self.protocol.loop.call_later(LINGER_SECONDS, self.end, True)

    def end(self, at_deadline: bool = False) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if at_deadline and self.inner.get_write_buffer_size():
            self.inner.abort()  # its client reads nothing: the answer would never drain
        else:
            self.inner.close()


class BoundedHttp(H11Protocol):
    """uvicorn's HTTP/1.1 connection, with three changes. A connection must finish a request's
    head within uvicorn's keep-alive time, as it must between requests (uvicorn bounds only
    the latter): clients that open connections and never finish a request would otherwise hold
    them, and their file descriptors, for ever. A request that is not valid HTTP gets an
    OpenAI-shaped 400, as every other bad request does. And a connection closed while its
    client still sends lingers (_LingeringTransport), so that the client reads its answer."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._linger = _LingeringTransport(transport, self)
        self._close_at_once = False
        self.transport = cast(asyncio.Transport, self._linger)
        self._await_a_request_after(None)

    def may_linger(self) -> bool:
        return not self._close_at_once and self.conn.their_state in (h11.SEND_BODY, h11.ERROR)

    def data_received(self, data: bytes) -> None:
        if not self._linger.lingering:  # what comes after the answer is dropped
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._linger.end()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        # The server's shutdown waits for every connection: none lingers from here on.
        self._close_at_once = True
        if self._linger.lingering:
            self._linger.end()
        else:
            super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        self._close_at_once = True  # its client has had the keep-alive time to read
        super().timeout_keep_alive_handler()

    def on_response_complete(self) -> None:
        done = self.cycle
        super().on_response_complete()  # may begin a pipelined request's cycle at once
        self._await_a_request_after(done)

    def _await_a_request_after(self, cycle: object) -> None:
        # uvicorn's timer stops at the first byte that comes; this one only at a whole head.
        self.loop.call_later(self.timeout_keep_alive, self._close_unless_begun, cycle)

    def _close_unless_begun(self, before: object) -> None:
        if self.cycle is before and not self.transport.is_closing():
            self.timeout_keep_alive_handler()

    def send_400_response(self, msg: str) -> None:
        error = RequestError(400, f"not a valid HTTP request ({msg.rstrip('.').lower()})")
        server = self.app_state.get(SERVER_STATE)
        if server is not None:  # counted and logged as every refusal is
            server.refuse("http-" + uuid.uuid4().hex, error)
        body = json.dumps(error.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def configure_log(log_format: str) -> None:
    """One line per event on stderr: `key=value` text, or one JSON object ("json"); uvicorn's
    own lines (a request that is not HTTP, say) in the same form."""
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _TextFormatter())
    for logger in (log, logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")):
        logger.handlers[:] = [handler]
        logger.propagate = False
    log.setLevel(logging.INFO)


def create_app(
    load: Callable[[], SpeculativeDecoder],
    settings: ServerSettings,
    on_fatal: Callable[[], None] = lambda: None,
) -> FastAPI:
    """The FastAPI app; `load` builds the decoder (called once, off the event loop), and
    `on_fatal` is called when that fails."""
    server = Server(load, settings, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # A thread per admitted request: each only waits for its text (the decoder's own
        # scheduler thread runs every decode, for all of them in one batch per step).
        loop = asyncio.get_running_loop()
        workers = settings.n_parallel + settings.max_queue + 1
        loop.set_default_executor(ThreadPoolExecutor(workers, thread_name_prefix="request"))
        starting = asyncio.create_task(server.start())
        yield {SERVER_STATE: server}  # the app's state, which connections (BoundedHttp) see too
        starting.cancel()
        server.close()

    # redirect_slashes: a path with a slash too many is a 404 in OpenAI's shape, not a redirect
    # that clients follow as GETs.
    app = FastAPI(title="specdec", lifespan=lifespan, redirect_slashes=False)
    app.state.server = server

    # Refusals raised from an endpoint (a key /v1/models wants) or by the router (an unknown
    # path, a wrong method): counted and logged as every refusal is, in OpenAI's shape too.
    @app.exception_handler(RequestError)
    async def request_error(_: Request, e: RequestError) -> Response:
        return server.refuse("http-" + uuid.uuid4().hex, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> Response:
        headers = dict(e.headers) if e.headers else None
        refusal = RequestError(e.status_code, str(e.detail), headers=headers)
        return server.refuse("http-" + uuid.uuid4().hex, refusal)

    # The endpoints read their bodies themselves, within bounds (openai_api.read_json); their
    # OpenAPI entries say what the body models take. As llama-server does, each OpenAI path is
    # served without its /v1 too (for a client whose base URL has none), left out of the schema.
    @app.post("/chat/completions", include_in_schema=False)
    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await server.handle(request, "chat")

    @app.post("/completions", include_in_schema=False)
    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await server.handle(request, "completion")

    @app.post("/responses", include_in_schema=False)
    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def create_response(request: Request) -> Response:
        return await server.handle(request, "response")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(
                components_of(ChatCompletionRequest, CompletionRequest, ResponsesRequest)
            )
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        def work(decoder: SpeculativeDecoder, body: Any) -> dict[str, Any]:
            ask = validated(body, TokenizeRequest)
            ids = decoder.tokenize(
                ask.content, add_special=ask.add_special, parse_special=ask.parse_special
            )
            if not ask.with_pieces:
                return {"tokens": ids}
            pieces = decoder.token_bytes(ids)
            return {"tokens": [{"id": i, "piece": _piece(b)} for i, b in zip(ids, pieces)]}

        return await server.vocab_call(request, work)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        def work(decoder: SpeculativeDecoder, body: Any) -> dict[str, Any]:
            return {"content": decoder.detokenize(validated(body, DetokenizeRequest).tokens)}

        return await server.vocab_call(request, work)

    model = {"id": settings.model_alias, "object": "model", "owned_by": "specdec", "created": 0}

    @app.get("/models", include_in_schema=False)
    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        server.check_auth(request)
        return JSONResponse({"object": "list", "data": [model]})

    @app.get("/models/{name:path}", include_in_schema=False)
    @app.get("/v1/models/{name:path}")
    async def retrieve_model(request: Request, name: str) -> Response:
        server.check_auth(request)
        if name != settings.model_alias:
            raise RequestError(
                404, f"the model {name!r} does not exist", param="model", code="model_not_found"
            )
        return JSONResponse(model)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if server.ready:
            return JSONResponse({"status": "ok"})
        if server.load_error:
            return JSONResponse({"status": "error", "error": server.load_error}, status_code=503)
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if server.decoder is not None and not server.decoder.closed:
            server.metrics.threads.set(server.decoder.n_threads_now)
            index = server.decoder.ngram_index
            server.metrics.index_tokens.set(index["tokens"])
            server.metrics.index_bytes.set(index["bytes"])
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

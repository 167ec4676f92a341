"""Structured output (csrc/constraint.h): every generated token keeps the grammar valid, the
output is the target's distribution restricted to what the grammar allows (greedy: the same
tokens as target-only decoding under the grammar; sampling: a chi-squared test, and a test of
the test), and bad grammars are refused with a message."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from conftest import BATCHED_NEAR_TIE_GAP
from helpers import assert_same_or_near_tie, engine_request
from test_distribution import first_tokens, homogeneity_pvalue

import specdec_native as sd
from specdec_native import models
from specdec_native._core import testing
from specdec_native.decoder import _load_llguidance
from specdec_native.tools import GENERIC, HERMES, LLAMA3, MISTRAL, ToolCall, ToolFormat

pytest.importorskip("llguidance")

USER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
PROMPT = "A user record as JSON:\n"


@pytest.fixture(scope="module")
def deep(deep_pair: models.ModelPair) -> Iterator[sd.SpeculativeDecoder]:
    with sd.SpeculativeDecoder(deep_pair.target, deep_pair.draft, n_ctx=1024) as dec:
        yield dec


def test_greedy_output_matches_its_schema_and_target_only(deep: sd.SpeculativeDecoder) -> None:
    outs = {k: deep.generate(PROMPT, 160, n_draft=k, json_schema=USER) for k in (0, 3, "auto")}
    base = outs[0]
    assert base.finish_reason == "stop"
    jsonschema.validate(json.loads(base.text), USER)
    for k, out in outs.items():
        # The same tokens as the target alone under the grammar (a near-tie may differ: the
        # margins say where).
        n = next((i for i, (a, b) in enumerate(zip(out.tokens, base.tokens)) if a != b), None)
        if n is not None:
            assert min(base.margins[n], out.margins[n]) < 1e-3, f"K={k} differs at {n}"
        else:
            assert out.tokens == base.tokens
    assert outs[3].stats.n_drafted > 0  # drafts were made, and cut where the grammar forbids
    # Keys and punctuation are forced (compact JSON): drafted without the model, all accepted.
    for k in (3, "auto"):
        s = outs[k].stats
        assert s.drafted_by_grammar > 10 and s.accepted_by_grammar == s.drafted_by_grammar
    assert base.stats.drafted_by_grammar == 0  # K = 0: the target alone, as asked
    assert ", " in base.text and "\n" not in base.text


def test_forced_tokens_speed_a_target_without_a_draft(deep_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(deep_pair.target, n_ctx=1024) as alone:
        plain = alone.generate(PROMPT, 160, n_draft=0, json_schema=USER)
        forced = alone.generate(PROMPT, 160, json_schema=USER)
        assert forced.tokens == plain.tokens
        assert forced.stats.drafted_by_grammar > 10
        assert forced.stats.n_target_passes < plain.stats.n_target_passes
        alone._live().set_grammar_drafts(False)
        assert alone.generate(PROMPT, 40, json_schema=USER).stats.drafted_by_grammar == 0


def test_tokens_the_grammar_allows_alone_skip_the_targets_logits(
    deep: sd.SpeculativeDecoder,
) -> None:
    """A forced token that is the only one the grammar allows is accepted without the target's
    logits (its row skips the output layer); logprobs still read them, and the text is the same
    either way: greedy as target-only, and sampled for one seed with or without logprobs."""
    before = testing.verdicts_without_logits()
    base = deep.generate(PROMPT, 64, n_draft=0, json_schema=USER)
    out = deep.generate(PROMPT, 64, n_draft=3, json_schema=USER)
    assert_same_or_near_tie(out, base, BATCHED_NEAR_TIE_GAP)
    skipped = testing.verdicts_without_logits() - before
    assert skipped == out.stats.accepted_by_grammar > 10

    before = testing.verdicts_without_logits()
    read = deep.generate(PROMPT, 64, n_draft=3, json_schema=USER, logprobs=2)
    assert testing.verdicts_without_logits() == before
    assert_same_or_near_tie(read, base, BATCHED_NEAR_TIE_GAP)
    assert read.logprobs is not None
    assert sum(lp.logprob == 0.0 for lp in read.logprobs) >= read.stats.accepted_by_grammar

    sampled = [
        deep.generate(PROMPT, 48, n_draft=3, json_schema=USER, temperature=0.8, seed=3, logprobs=lp)
        for lp in (None, 1)
    ]
    assert sampled[0].tokens == sampled[1].tokens
    assert sampled[0].stats.accepted_by_grammar > 10


def test_drafts_that_know_the_grammar_need_fewer_target_passes(deep: sd.SpeculativeDecoder) -> None:
    """The draft model's q masked by the grammar proposes only what it allows (a draft that
    ignores it is cut at its first invalid token), and goes on after forced tokens in the same
    step: the same text (up to a near-tie), in fewer target passes."""
    engine = deep._live()
    lowercase_words = {"regex": "([a-z]+ ){12}"}  # nothing forced: the mask alone
    for grammar in (lowercase_words, {"json_schema": USER}):
        out = {}
        try:
            for aware in (False, True):
                engine.set_grammar_drafts(aware)
                out[aware] = deep.generate(PROMPT, 60, n_draft=3, **grammar)
        finally:
            engine.set_grammar_drafts(True)
        assert_same_or_near_tie(out[True], out[False], BATCHED_NEAR_TIE_GAP)
        assert out[True].stats.n_target_passes < out[False].stats.n_target_passes, grammar


def test_regex_and_lark_grammars_hold(deep: sd.SpeculativeDecoder) -> None:
    out = deep.generate("Call me at ", 24, regex=r"[0-9]{3}-[0-9]{4}", n_draft=3)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.text) and out.finish_reason == "stop"
    lark = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    out = deep.generate("Is the sky blue? ", 24, grammar=lark, temperature=0.8, seed=1)
    assert out.text in ("The answer is yes.", "The answer is no.")
    out = deep.generate("Anything: ", 40, json_object=True, n_draft=2)
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)


def test_output_cut_by_max_tokens_ends_with_length(deep: sd.SpeculativeDecoder) -> None:
    out = deep.generate(PROMPT, 6, json_schema=USER)
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_a_stop_string_ends_structured_output_where_it_appears(deep: sd.SpeculativeDecoder) -> None:
    # "," comes in the tokens the grammar forces after a value (`,"key":`), drafted together.
    for k in (0, 3):
        whole = deep.generate(PROMPT, 60, n_draft=k, json_schema=USER)
        assert "," in whole.text, whole.text
        cut = deep.generate(PROMPT, 60, n_draft=k, json_schema=USER, stop=[","])
        assert cut.text == whole.text[: whole.text.index(",")] and cut.finish_reason == "stop"


def test_forced_tokens_keep_to_the_batch_and_the_context_when_a_second_request_joins(
    smollm2: Path,
) -> None:
    """A request that drafts long forced spans alone, then shares its steps: a second sequence
    starts `auto` held to target-only, and the forced tokens must size to the step they are in
    (the batch's room now shared, the context nearly full), not to an earlier step's."""
    sentence = "The quick brown fox jumps over the lazy dog. "
    with sd.SpeculativeDecoder(smollm2, "ngram", n_parallel=2, n_batch=32, n_ctx=300) as dec:
        joined = threading.Event()
        other: list[sd.GenerationResult] = []

        def join_it() -> None:
            if joined.wait(60):
                other.append(dec.generate("Hi", 100))

        second = threading.Thread(target=join_it)
        second.start()
        out = dec.generate(
            "Say it:", 900, regex=f"({re.escape(sentence)}){{60}}", on_text=lambda _: joined.set()
        )
        second.join(120)
    assert out.finish_reason == "context"
    assert len(out.prompt_tokens) + len(out.tokens) <= 300 + 1
    assert (sentence * 60).startswith(out.text)
    assert out.stats.drafted_by_grammar > 0
    assert other and other[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"json_schema": "{not json"}, "not JSON"),
        (
            {"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            "json_schema",
        ),
        ({"regex": "[unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "lark"),
        ({"regex": "a", "json_object": True}, "at most one"),
    ],
)
def test_bad_grammars_are_refused_with_a_message(
    deep: sd.SpeculativeDecoder, given: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        deep.generate(PROMPT, 8, **given)
    assert deep.generate("ok", 2).finish_reason == "length"  # the decoder goes on


def test_a_pathological_grammar_is_bounded(deep: sd.SpeculativeDecoder) -> None:
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    huge_enum = {"enum": [f"value-{i}" for i in range(20_000)]}
    for schema in (nested, huge_enum):
        start = time.monotonic()
        try:
            deep.generate(PROMPT, 4, json_schema=schema)
        except ValueError:
            pass  # refused past llguidance's bounds: fine, as long as it says so quickly
        assert time.monotonic() - start < 20


# -- sampling under a grammar ------------------------------------------------------------------

N = 20_000
TINY_PROMPT = [1, 300, 270]
# (the grammar, a regex of its prefixes)
TINY_REGEX = ("[a-h ]{1,6}", "[a-h ]{0,6}")
# ... one that forces " abc" after its first letters: drafted as the grammar's forced tokens.
FORCING_REGEX = (" abc[a-h]", "( (a(b(c[a-h]?)?)?)?)?")
# ... and one that forces " a" only: the draft model goes on after it, under the grammar's mask.
MIXED_REGEX = (" a[a-h ]{1,6}", "( (a[a-h ]{0,6})?)?")


def _tiny(tiny_dir: Path, space_prefix: bool) -> Iterator[sd.SpeculativeDecoder]:
    pair = models.build_tiny_pair(tiny_dir, seed=5, draft_noise=0.5, space_prefix=space_prefix)
    _load_llguidance()
    with sd.SpeculativeDecoder(pair.target, pair.draft, n_ctx=64, n_threads=1) as dec:
        yield dec


@pytest.fixture(scope="module")
def near(tiny_dir: Path) -> Iterator[sd.SpeculativeDecoder]:
    """A tiny pair whose tokenizer puts a space before the text, as Llama's SentencePiece does
    ("a" tokenizes as " a"): llguidance tokenizes forced bytes its own way there."""
    yield from _tiny(tiny_dir, True)


@pytest.fixture(scope="module")
def near_exact(tiny_dir: Path) -> Iterator[sd.SpeculativeDecoder]:
    """The same pair with a tokenizer that adds nothing: llguidance uses it for forced bytes."""
    yield from _tiny(tiny_dir, False)


def constrained_sample(
    dec: sd.SpeculativeDecoder,
    k: int,
    seed0: int,
    grammar: tuple[str, str] = TINY_REGEX,
    n: int = N,
    max_tokens: int = 3,
) -> tuple[Counter[tuple[int, ...]], Counter[str]]:
    """The outputs' counts over N seeds, and the tokens drafted by each source (stats'
    drafted_by_grammar, drafted_by_model, ...)."""
    engine = dec._live()
    regex, prefix = grammar
    counts: Counter[tuple[int, ...]] = Counter()
    text = set()
    drafted: Counter[str] = Counter()
    for i in range(n):
        r = engine_request(
            TINY_PROMPT, max_tokens, seed0 + i, k, constraint_kind="regex", constraint=regex
        )
        out = engine.generate(r)
        counts[tuple(out["tokens"])] += 1
        text.add(out["text"])
        for source in ("grammar", "model"):
            drafted[source] += out["stats"][f"drafted_by_{source}"]
    # A few tokens may stop short of a whole match: each is a prefix of one.
    assert all(re.fullmatch(prefix, t) for t in text), text
    return counts, drafted


def test_sampling_under_a_grammar_keeps_the_targets_restricted_distribution(
    near: sd.SpeculativeDecoder,
) -> None:
    base, _ = constrained_sample(near, 0, 10_000_000)
    spec, _ = constrained_sample(near, 2, 20_000_000)
    for n in (1, 2, 3):
        p = homogeneity_pvalue(first_tokens(base, n), first_tokens(spec, n))
        assert p > 1e-3, f"first {n} tokens differ from target-only under the grammar (p={p:.2e})"
    testing.set_wrong_residual(True)
    try:  # a gross error: a quarter of the samples shows it far past 1e-6
        wrong, _ = constrained_sample(near, 2, 20_000_000, n=N // 4)
    finally:
        testing.set_wrong_residual(False)
    p = homogeneity_pvalue(first_tokens(base, 1), first_tokens(wrong, 1))
    assert p < 1e-6, f"a wrong residual under the grammar went unnoticed (p={p:.2e})"


def test_forced_tokens_drafted_keep_the_distribution(near_exact: sd.SpeculativeDecoder) -> None:
    """The tokens a grammar forces are drafted, alone or followed by the draft model's tokens
    (q masked by the grammar), and the output keeps the target's distribution. (llguidance
    allows only the canonical tokens of forced bytes, so they are accepted with certainty: the
    point-mass rule's p(x) is 1 there.)"""
    n = N // 4
    for grammar, k, max_tokens in ((FORCING_REGEX, 2, 3), (MIXED_REGEX, 3, 4)):
        base, _ = constrained_sample(near_exact, 0, 10_000_000, grammar, n, max_tokens)
        spec, drafted = constrained_sample(near_exact, k, 20_000_000, grammar, n, max_tokens)
        assert drafted["grammar"] > n // 2
        if grammar is MIXED_REGEX:  # " a" is forced, then the model drafts in the same step
            assert drafted["model"] > n
        for j in (1, 2, 3):
            p = homogeneity_pvalue(first_tokens(base, j), first_tokens(spec, j))
            assert p > 1e-3, f"{grammar[0]!r}: first {j} tokens differ from target-only (p={p:.2e})"


def test_forced_text_beyond_ascii_is_written(deep: sd.SpeculativeDecoder) -> None:
    """Forced bytes that end inside a character (the first bytes of "日" after "x: ") are not
    UTF-8 on their own: llama.cpp's tokenizer cannot take them, and llguidance must not hand
    them to it (a byte-level vocabulary, as SmolLM2's, then failed every such grammar)."""
    cities = ["São Paulo", "東京", "Zürich"]
    city = {
        "type": "object",
        "properties": {"city": {"enum": cities}},
        "required": ["city"],
        "additionalProperties": False,
    }
    for k in (0, 3):
        assert deep.generate(PROMPT, 16, n_draft=k, regex="x: 日本語").text == "x: 日本語"
        out = deep.generate(PROMPT, 24, n_draft=k, json_schema=city)
        assert json.loads(out.text)["city"] in cities


def test_a_space_prefix_tokenizer_does_not_break_forced_bytes(near: sd.SpeculativeDecoder) -> None:
    """Llama's SentencePiece adds a space to what it tokenizes: llguidance must not be handed
    that tokenizer for forced bytes (it then refused tokens its own mask allowed)."""
    counts, _ = constrained_sample(near, 2, 30_000_000, FORCING_REGEX, 300)
    assert sum(counts.values()) == 300


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


def calls_generated(
    dec: sd.SpeculativeDecoder,
    tools: ToolFormat,
    prompt: str,
    runs: tuple[tuple[float, int], ...],
    first_token: int | None = None,
) -> list[list[ToolCall]]:
    """The calls generated under the tools' grammar, one list per (temperature, K) in `runs`:
    each output ends, opens with `first_token` where given, and is all calls, those of the
    weather tool with arguments its schema allows."""
    out = []
    for temperature, k in runs:
        result = dec.generate(
            prompt, 200, temperature=temperature, seed=7, n_draft=k, grammar=tools.constraint()[1]
        )
        assert result.finish_reason == "stop", result.text
        assert first_token is None or result.tokens[0] == first_token, result.text
        content, calls = tools.read(result.text)
        assert content is None, result.text
        for call in calls:
            if call.name == "weather":
                jsonschema.validate(json.loads(call.arguments), WEATHER)
        out.append(calls)
    return out


def test_a_models_own_template_writes_tool_calls_in_its_format(tmp_path: Path) -> None:
    """A GGUF whose own chat template takes tools: they are rendered through it, and calls
    generated under the hermes grammar read back as a call of the named tool, with arguments
    its schema allows, greedy and sampled, with drafts and without."""

    template = (Path(__file__).parent / "templates" / "chatml-tools.jinja").read_text()
    target = models.write_tiny_model(tmp_path / "tools.gguf", chat_template=template)
    draft = models.write_tiny_model(tmp_path / "draft.gguf", output_noise=0.5)
    functions = [{"name": "weather", "parameters": WEATHER}, {"name": "time", "parameters": {}}]
    tools = ToolFormat(functions, "weather", False, None, HERMES)
    with sd.SpeculativeDecoder(target, draft, n_draft=3, n_ctx=1024, n_threads=1) as dec:
        assert dec.tool_syntax is HERMES
        prompt = dec.apply_chat_template(
            [{"role": "user", "content": "weather?"}], tools=tools.template_tools()
        )
        assert '"name": "weather"' in prompt and "<tools>" in prompt
        for calls in calls_generated(dec, tools, prompt, ((0.0, 3), (0.8, 3), (0.0, 0))):
            assert [c.name for c in calls] == ["weather"]
    # Tags that are special tokens of the vocabulary (Qwen's) are generated as those tokens.
    tags = ["<tool_call>", "</tool_call>"]
    tagged = models.write_tiny_model(
        tmp_path / "tagged.gguf", chat_template=template, user_tokens=tags
    )
    with sd.SpeculativeDecoder(tagged, n_ctx=1024, n_threads=1) as dec:
        ids = [dec.tokenize(tag, add_special=False, parse_special=True)[0] for tag in tags]
        assert dec.special_tokens(tags) == dict(zip(tags, ids))
        tools = ToolFormat(functions, "weather", False, None, HERMES, dec.special_tokens(tags))
        out = dec.generate(prompt, 200, temperature=0, grammar=tools.constraint()[1])
        assert out.tokens[0] == ids[0] and ids[1] in out.tokens, out.text
        content, calls = tools.read(out.text)
        assert content is None and [c.name for c in calls] == ["weather"]
    # A template that writes a call as the whole message (Llama 3's): one call, read back.
    llama3 = (Path(__file__).parent / "templates" / "llama3-tools.jinja").read_text()
    target = models.write_tiny_model(tmp_path / "llama3.gguf", chat_template=llama3)
    with sd.SpeculativeDecoder(target, draft, n_draft=3, n_ctx=1024, n_threads=1) as dec:
        assert dec.tool_syntax is LLAMA3
        tools = ToolFormat(functions, "weather", True, None, LLAMA3)
        prompt = dec.apply_chat_template(
            [{"role": "user", "content": "weather?"}], tools=tools.template_tools()
        )
        assert '"name": "weather"' in prompt and "ipython" in prompt
        # The template's own refusal (two calls in one message) is a ValueError.
        two = {"id": "c", "type": "function", "function": {"name": "time", "arguments": {}}}
        twice: list[dict[str, Any]] = [
            {"role": "assistant", "content": "", "tool_calls": [two, two]}
        ]
        with pytest.raises(ValueError, match="one call per message"):
            dec.apply_chat_template(twice, tools=tools.template_tools())
        for calls in calls_generated(dec, tools, prompt, ((0.0, 3), (0.8, 0))):
            assert [c.name for c in calls] == ["weather"]
    # A template that writes calls as an array after [TOOL_CALLS] (Mistral's), that tag a
    # special token of the vocabulary as in Mistral's: generated as that token, read back.
    mistral = (Path(__file__).parent / "templates" / "mistral-tools.jinja").read_text()
    tag = ["[TOOL_CALLS]"]
    target = models.write_tiny_model(
        tmp_path / "mistral.gguf", chat_template=mistral, control_tokens=tag
    )
    tag_draft = models.write_tiny_model(
        tmp_path / "mistral-draft.gguf", output_noise=0.5, control_tokens=tag
    )
    with sd.SpeculativeDecoder(target, tag_draft, n_draft=3, n_ctx=1024, n_threads=1) as dec:
        assert dec.tool_syntax is MISTRAL
        tag_id = dec.tokenize(tag[0], add_special=False, parse_special=True)
        assert len(tag_id) == 1 and dec.special_tokens(tag) == {tag[0]: tag_id[0]}
        for choice in ("weather", "required"):
            tools = ToolFormat(functions, choice, True, None, MISTRAL, dec.special_tokens(tag))
            prompt = dec.apply_chat_template(
                [{"role": "user", "content": "weather?"}], tools=tools.template_tools()
            )
            assert "[AVAILABLE_TOOLS]" in prompt
            for calls in calls_generated(dec, tools, prompt, ((0.0, 3), (0.8, 0)), tag_id[0]):
                assert calls and (choice != "weather" or {c.name for c in calls} == {"weather"})
    # A template that knows no tools: tools are the server's generic format, not the template's.
    plain = models.write_tiny_model(tmp_path / "plain.gguf", chat_template="{{ messages }}")
    with sd.SpeculativeDecoder(plain, n_ctx=256, n_threads=1) as dec:
        assert dec.tool_syntax is GENERIC and not dec.special_tokens(["<tool_call>"])
        with pytest.raises(ValueError, match="tools need a chat template"):
            dec.apply_chat_template([{"role": "user", "content": "x"}], tools=[])


def test_a_models_own_template_that_takes_tools_renders_chats_without_them(
    tmp_path: Path,
) -> None:
    """Chats without tools go through the model's default Jinja template where it takes
    tools, as Hugging Face renders it: its default system message is there, where llama.cpp's
    built-in reading of the template would leave it out. A separate tool_use template (Hermes
    2 Pro's kind) renders chats with tools only."""
    template = (
        "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}; call them as "
        '<tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
        "{%- elif messages[0].role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    target = models.write_tiny_model(tmp_path / "own.gguf", chat_template=template)
    chat = [{"role": "user", "content": "hi"}]
    listed = [{"type": "function", "function": {"name": "f"}}]
    with sd.SpeculativeDecoder(target, n_ctx=256, n_threads=1) as dec:
        assert dec.tool_syntax is HERMES
        assert dec.apply_chat_template(chat).startswith("<|im_start|>system\nYou are helpful.")
        assert dec.apply_chat_template(chat, tools=listed).startswith("<|im_start|>system\nTools: ")
        # OpenAI's developer role is the system message to a template that knows no such role.
        told = dec.apply_chat_template([{"role": "developer", "content": "Be brief."}, *chat])
        assert told.startswith("<|im_start|>system\nBe brief.<|im_end|>")
        # One template for chats with tools and without: compiled once.
        assert dec._tools_template() is dec._plain_template()
    # A template the caller names renders chats without tools.
    with sd.SpeculativeDecoder(target, n_ctx=256, n_threads=1, chat_template="chatml") as dec:
        assert dec.apply_chat_template(chat).startswith("<|im_start|>user\nhi")
        # llama.cpp's built-in formats know no developer role either.
        told = dec.apply_chat_template([{"role": "developer", "content": "Be brief."}, *chat])
        assert told.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    # bos_token is the BOS's text, as llama.cpp renders it; a BOS that the prompt's
    # tokenization adds (this vocabulary adds one) is not written at the start as well, whether
    # the template wrote it as bos_token or as text (Gemma 3's literal <bos>).
    chat2 = [*chat, {"role": "user", "content": "yo"}]
    every_turn = "{{ bos_token }}{% for m in messages %}{{ bos_token }}{{ m.content }}{% endfor %}"
    literal = "<s>{% for m in messages %}{{ m.content }}{% endfor %}"
    for template, expected in ((every_turn, "<s>hi<s>yo"), (literal, "hiyo")):
        with sd.SpeculativeDecoder(target, n_ctx=256, n_threads=1, chat_template=template) as dec:
            prompt = dec.apply_chat_template(chat2, add_generation_prompt=False)
            assert prompt == expected
            bos = dec._live().model_info(False)["bos"]
            assert dec.tokenize(prompt, parse_special=True).count(bos) == 1 + prompt.count("<s>")
    # A message's name reaches a Jinja template, as llama.cpp passes it.
    named = "{% for m in messages %}[{{ m.name }}] {{ m.content }}\n{% endfor %}"
    with sd.SpeculativeDecoder(target, n_ctx=256, n_threads=1, chat_template=named) as dec:
        given = [{"role": "user", "content": "hi", "name": "ann"}, *chat]
        assert dec.apply_chat_template(given).startswith("[ann] hi\n[] hi")
    # A default template without tools beside a tool_use one that cannot render without them.
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tool_use = (
        'TOOLS{% for t in tools %} {{ t | tojson }}{% endfor %} <tool_call> "name" "arguments"\n'
        + chatml
    )
    both = models.write_tiny_model(
        tmp_path / "both.gguf",
        chat_template=[
            {"name": "default", "template": chatml},
            {"name": "tool_use", "template": tool_use},
        ],
    )
    with sd.SpeculativeDecoder(both, n_ctx=256, n_threads=1) as dec:
        assert dec.tool_syntax is HERMES
        assert dec.apply_chat_template(chat).startswith("<|im_start|>user\nhi")
        assert dec.apply_chat_template(chat, tools=listed).startswith("TOOLS ")
    # A default template that knows no tools is rendered as Jinja too (SmolLM2's writes its
    # default system message, as llama-server and Hugging Face render it); one that cannot
    # be compiled is read by llama.cpp's built-in formats, which take no variables.
    greeting = (
        "{% if messages[0].role != 'system' %}<|im_start|>system\nHello.<|im_end|>\n{% endif %}"
    )
    own = models.write_tiny_model(tmp_path / "plain.gguf", chat_template=greeting + chatml)
    with sd.SpeculativeDecoder(own, n_ctx=256, n_threads=1) as dec:
        assert dec.tool_syntax is GENERIC
        assert dec.apply_chat_template(chat).startswith("<|im_start|>system\nHello.<|im_end|>\n")
        rendered = dec.apply_chat_template(chat, chat_template_kwargs={"x": 1})
        assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    broken = models.write_tiny_model(tmp_path / "broken.gguf", chat_template=chatml + "{% if %}")
    with sd.SpeculativeDecoder(broken, n_ctx=256, n_threads=1) as dec:
        with pytest.raises(ValueError, match="Jinja"):
            dec.apply_chat_template(chat, chat_template_kwargs={"x": 1})

"""specdec-cli as a user runs it: a real subprocess, real models."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from specdec_native import calibration, models

CLI = [sys.executable, "-m", "cli.main"]


def run_cli(*args: str | Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
        env={**os.environ},
    )


def test_run_json(deep_pair: models.ModelPair) -> None:
    r = run_cli(
        "run", deep_pair.target, "--draft", deep_pair.draft, "-p", "Hello", "-n", "12", "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12
    assert out["stats"]["n_generated"] == 12
    assert out["finish_reason"] == "length"


def test_run_with_a_json_schema_a_grammar_or_a_regex(
    deep_pair: models.ModelPair, tmp_path: Path
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "big": {"type": "boolean"}},
        "required": ["city", "big"],
        "additionalProperties": False,
    }
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "Answer: " ("yes" | "no")')
    pair = (deep_pair.target, "--draft", deep_pair.draft)
    r = run_cli("run", *pair, "-p", "A city:", "-n", "40", "--json-schema", tmp_path / "s.json")
    assert r.returncode == 0, r.stderr
    assert set(json.loads(r.stdout.strip())) == {"city", "big"}
    r = run_cli("run", *pair, "-p", "Q:", "-n", "8", "--grammar", tmp_path / "g.lark")
    assert r.returncode == 0 and r.stdout.strip() in ("Answer: yes", "Answer: no"), r.stdout
    r = run_cli("run", *pair, "-p", "Year:", "-n", "8", "--regex", "[0-9]{4}")
    assert r.returncode == 0 and re.fullmatch("[0-9]{4}", r.stdout.strip()), r.stdout
    (tmp_path / "bad.json").write_text('{"type": 7}')
    r = run_cli("run", *pair, "-p", "x", "--json-schema", tmp_path / "bad.json")
    assert_one_line_error(r, "json_schema")
    r = run_cli("run", *pair, "-p", "x", "--regex", "[0-9", "--grammar", tmp_path / "g.lark")
    assert_one_line_error(r, "at most one")
    r = run_cli("run", *pair, "-p", "x", "--regex", "[0-9]{4}", "--ignore-eos")
    assert_one_line_error(r, "ignore_eos cannot be combined with structured output")


def test_run_streams_text_and_prints_stats(deep_pair: models.ModelPair) -> None:
    r = run_cli(
        "run",
        deep_pair.target,
        "--draft",
        deep_pair.draft,
        "-n",
        "10",
        "-k",
        "3",
        stdin="Once upon a time",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "acceptance rate" in r.stderr and "tok/s" in r.stderr


def test_run_no_draft_and_chat(deep_pair: models.ModelPair) -> None:
    r = run_cli("run", deep_pair.target, "--no-draft", "--chat", "-p", "Hi", "-n", "5", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["n_drafted"] == 0


def test_run_ngram_draft(tiny_pair: models.ModelPair) -> None:
    r = run_cli(
        "run",
        tiny_pair.target,
        "--draft",
        "ngram",
        "-p",
        "the cat the cat the",
        "-n",
        "6",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["drafted_by_model"] == 0
    assert stats["drafted_by_ngram"] == stats["n_drafted"]


def test_run_drafts_a_prediction_file(deep_pair: models.ModelPair, tmp_path: Path) -> None:
    ask = ("run", deep_pair.target, "--no-draft", "-p", "Once upon a time", "-n", "24", "--json")
    base = json.loads(run_cli(*ask, "-k", "0").stdout)
    (tmp_path / "expected.txt").write_text(base["text"])
    r = run_cli(*ask, "-k", "4", "--prediction", tmp_path / "expected.txt")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert stats["accepted_by_prediction"] >= 12 and stats["n_target_passes"] <= 12, stats
    r = run_cli(*ask, "--prediction", tmp_path / "missing.txt")
    assert r.returncode != 0 and "missing.txt" in r.stderr


def test_prompt_from_file(deep_pair: models.ModelPair, tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("The sky is")
    r = run_cli("run", deep_pair.target, "--draft", deep_pair.draft, "-f", f, "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["n_prompt"] >= 3


def test_user_errors_are_one_line(
    tiny_pair: models.ModelPair, smollm2: Path, tmp_path: Path
) -> None:
    bad_file = tmp_path / "bad.gguf"
    bad_file.write_text("no")
    cases = [
        ("run", tmp_path / "missing.gguf", "-p", "x"),
        ("run", bad_file, "-p", "x"),
        ("run", smollm2, "--draft", tiny_pair.target, "-p", "x"),
        ("run", tiny_pair.target, "--temp", "-1", "-p", "x"),
        ("run", tiny_pair.target, "--top-p", "2", "-p", "x"),
        ("run", tiny_pair.target, "--repeat-penalty", "0", "-p", "x"),
        ("run", tiny_pair.target, "--repeat-last-n", "-2", "-p", "x"),
        ("run", tiny_pair.target, "--presence-penalty", "3", "-p", "x"),
        ("run", tiny_pair.target, "-k", "-2", "-p", "x"),
        ("run", tiny_pair.target, "-k", "lots", "-p", "x"),
        (
            "run",
            tiny_pair.target,
            "--draft",
            "ngram",
            "--ngram-min",
            "3",
            "--ngram-max",
            "2",
            "-p",
            "x",
        ),
    ]
    for args in cases:
        assert_one_line_error(run_cli(*map(str, args)))


def assert_one_line_error(r: subprocess.CompletedProcess[str], match: str = "") -> None:
    assert r.returncode not in (0, None) and r.returncode > 0, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    # click's usage errors (exit 2) add its usage and help hint above the error line.
    lines = [
        x for x in r.stderr.splitlines() if x.strip() and not x.startswith(("Usage:", "Try '"))
    ]
    assert len(lines) == 1 and lines[0].startswith("Error:"), r.stderr
    assert match in r.stderr, r.stderr


LONG = "x" * 300  # a file name over the usual 255-byte limit


@pytest.mark.parametrize(
    "args,stdin,match",
    [
        (("-n", "2147483648"), None, "max_tokens must be in"),
        (("--top-k", "2147483648"), None, "top_k must be in"),
        (("-ngl", str(10**12)), None, "n_gpu_layers must be in"),
        (("-k", str(2**40)), None, "-k/--draft-max must be in"),
        (("-k", "-3"), None, "-k/--draft-max must be 'auto' or an integer in [0, 64]"),
        ((), "", "standard input is empty"),
        ((), "  \n\t ", "standard input is empty"),
        (("-f", LONG), None, ""),
    ],
)
def test_bad_run_input_is_one_line(
    tiny_pair: models.ModelPair, args: tuple[str, ...], stdin: str | None, match: str
) -> None:
    prompt = () if stdin is not None or "-f" in args else ("-p", "the")
    r = run_cli("run", tiny_pair.target, *prompt, *args, stdin=stdin or "")
    assert_one_line_error(r, match)


@pytest.mark.parametrize(
    "args,match",
    [
        (("--chat-template", "chatml"), "--chat-template applies to --chat"),
        (("--draft", "ngram", "--no-draft"), "--no-draft conflicts"),
        (("--ngram", "--no-draft"), "--no-draft conflicts"),
        (("--draft", "ngram", "--no-ngram"), "--no-ngram conflicts"),
        (("--ngram-min", "2"), "--ngram-min and --ngram-max apply"),
        (("--draft", "ngram", "--draft-p-min", "0.5"), "--draft-p-min applies"),
        (("--draft", "ngram", "-k", "3", "--recalibrate"), "--recalibrate applies"),
        (("--regex", "("), ""),  # llguidance's message, over several lines, as one
        (("--regex", "\udcff"), "regex is not valid Unicode"),
    ],
)
def test_run_refuses_options_left_without_effect(
    tiny_pair: models.ModelPair, args: tuple[str, ...], match: str
) -> None:
    assert_one_line_error(run_cli("run", tiny_pair.target, "-p", "the", "-n", "2", *args), match)


def test_a_model_path_that_is_not_utf8(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    odd = tmp_path / "caf\udce9.gguf"  # the byte 0xE9, as Python names it
    odd.write_bytes(tiny_pair.target.read_bytes())
    assert_one_line_error(run_cli("run", odd, "-p", "x", "-n", "2"), "not valid UTF-8")


def test_an_inline_chat_template_longer_than_a_file_name(tiny_pair: models.ModelPair) -> None:
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}{# " + "x" * 300 + " #}"
    r = run_cli("run", tiny_pair.target, "--chat", "--chat-template", template, "-p", "hi",
                "-n", "2", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    plain = run_cli("run", tiny_pair.target, "-p", "<hi>", "-n", "2", "--json")
    assert (
        json.loads(r.stdout)["stats"]["n_prompt"] == json.loads(plain.stdout)["stats"]["n_prompt"]
    )


def test_a_model_path_too_long(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("run", tmp_path / (LONG + ".gguf"), "-p", "x"))


def test_an_empty_prompt_file(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_text("\n")
    assert_one_line_error(run_cli("run", tiny_pair.target, "-f", f), "is empty")


@pytest.mark.parametrize("noise", ["nan", "1e308"])  # 1e308 overflows the head to inf
def test_tiny_pair_refuses_a_noise_out_of_range(tmp_path: Path, noise: str) -> None:
    assert_one_line_error(run_cli("models", "tiny-pair", "--out", tmp_path, "--noise", noise))
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize(
    "line,match",
    [
        ("not json", "line 2 is not JSON"),
        ("[1, 2]", "line 2 needs an object"),
        ('{"prompt": 5}', "line 2 needs an object"),
        ('{"name": "a", "prompt": "again"}', "repeats the prompt name"),
    ],
)
def test_bad_bench_prompt_lines(
    tiny_pair: models.ModelPair, tmp_path: Path, line: str, match: str
) -> None:
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"name": "a", "prompt": "the cat"}\n' + line + "\n")
    r = run_cli("bench", tiny_pair.target, "--draft", tiny_pair.draft, "--prompts", f, "-r", "1")
    assert_one_line_error(r, match)


def run_with_stdout(stdout: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with its standard output redirected by the shell (e.g. '>/dev/full', '>&-')."""
    cmd = " ".join(["exec", *(f"'{a}'" for a in [*CLI, *args]), stdout])
    return subprocess.run(
        ["bash", "-c", cmd], capture_output=False, stderr=subprocess.PIPE, text=True, timeout=300
    )


@pytest.mark.parametrize("redirect,match", [(">/dev/full", "no space"), (">&-", "closed")])
@pytest.mark.parametrize("as_json", [False, True])
def test_output_that_cannot_be_written_is_one_line(
    tiny_pair: models.ModelPair, redirect: str, match: str, as_json: bool
) -> None:
    args = ["run", str(tiny_pair.target), "-p", "the", "-n", "8", *(["--json"] if as_json else [])]
    assert_one_line_error(run_with_stdout(redirect, *args), match)


@pytest.mark.parametrize(
    "args",
    [
        ("--no-draft", "-c", "16", "-n", "40"),
        ("-c", "16", "-k", "20"),
        ("-b", "16", "-k", "20"),
        ("-b", "1"),
        ("-b", "8"),
    ],
)
def test_small_batches_and_contexts_generate(
    deep_pair: models.ModelPair, args: tuple[str, ...]
) -> None:
    draft = () if "--no-draft" in args else ("--draft", deep_pair.draft)
    r = run_cli(
        "run", deep_pair.target, *draft, "-p", "1, 2, 3, 4, 5,", "-n", "24", *args, "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] in ("length", "context")
    assert out["stats"]["n_generated"] == len(out["tokens"]) > 0


def test_a_prompt_longer_than_the_context(deep_pair: models.ModelPair, tmp_path: Path) -> None:
    f = tmp_path / "long.txt"
    f.write_text(" ".join(["word"] * 400))
    r = run_cli("run", deep_pair.draft, "--no-draft", "-c", "300", "-f", f, "-n", "4")
    assert_one_line_error(r, "the prompt has 400 tokens but the context holds 300")


def test_info_reports_pair_verdict(
    smollm2: Path, smollm2_q40: Path, tiny_pair: models.ModelPair
) -> None:
    r = run_cli("info", smollm2, "--draft", smollm2_q40)
    assert r.returncode == 0, r.stderr
    assert "pair: compatible" in r.stdout and "llama" in r.stdout
    r = run_cli("info", smollm2, "--draft", tiny_pair.target, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pair"].startswith("incompatible")


def test_models_tiny_pair_command(tmp_path: Path) -> None:
    r = run_cli("models", "tiny-pair", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(list(tmp_path.glob("*.gguf"))) == 2


def test_bench_report_and_plot(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"name": "a", "prompt": "the cat"}\n{"prompt": "and the"}\n')
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    r = run_cli(
        "bench",
        tiny_pair.target,
        "--draft",
        tiny_pair.draft,
        "--prompts",
        prompts,
        "-k",
        "1,3,auto",
        "--temps",
        "0,1",
        "-n",
        "16",
        "-r",
        "2",
        "--seed",
        "7",
        "--json",
        out,
        "--plot",
        png,
    )
    assert r.returncode == 0, r.stderr
    assert "best K" in r.stdout and "auto vs the fixed K" in r.stdout
    assert "n-gram copies: weighed against the draft model under auto" in r.stdout
    report = json.loads(out.read_text())
    assert report["seed"] == 7 and report["ngram"] == "auto"
    # baseline + 2 K values + auto, 2 prompts, 2 temperatures
    assert len(report["runs"]) == 4 * 2 * 2
    for run in report["runs"]:
        # one speed-up per round, each over the target-only run of the same round
        assert len(run["speedup_by_repeat"]) == 2
        assert min(run["speedup_by_repeat"]) <= run["speedup"] <= max(run["speedup_by_repeat"])
        if run["n_draft"] == 0:
            assert run["speedup_by_repeat"] == [1.0, 1.0] and run["acceptance_rate"] == 0.0
        elif run["n_draft"] != "auto":
            assert 0.0 <= run["acceptance_rate"] <= 1.0
            assert len(run["acceptance_by_position"]) <= run["n_draft"]
    assert report["best_k"]["0.0"] in (1, 3)
    rows = report["adaptive_vs_best_fixed"]
    assert [(row["temperature"], row["prompt"]) for row in rows] == [
        (t, p) for t in (0.0, 1.0) for p in ("a", "p1")
    ]
    for row in rows:
        assert row["best_k"] in (0, 1, 3)
        assert row["auto_over_best"] == pytest.approx(row["auto_speedup"] / row["best_speedup"])
        # held out: each of the 2 rounds scores the K the other round found fastest
        assert len(row["held_out_k"]) == 2 and set(row["held_out_k"]) <= {0, 1, 3}
        scored = [
            next(
                run["speedup_by_repeat"][i]
                for run in report["runs"]
                if (run["temperature"], run["prompt"], run["n_draft"])
                == (row["temperature"], row["prompt"], k)
            )
            for i, k in enumerate(row["held_out_k"])
        ]
        assert row["held_out_speedup"] == pytest.approx(sum(scored) / 2)
        assert row["auto_over_held_out"] == pytest.approx(
            row["auto_mean_speedup"] / row["held_out_speedup"]
        )
        lo, hi = row["auto_over_held_out_ci"]
        assert 0.0 < lo <= hi
    assert png.stat().st_size > 10_000

    # bench-pool: a copy of the report beside it is a report of twice the rounds
    pooled, copy = tmp_path / "pooled.json", tmp_path / "copy.json"
    copy.write_bytes(out.read_bytes())
    r = run_cli("bench-pool", out, copy, "--json", pooled)
    assert r.returncode == 0, r.stderr
    assert "pooled, 4 rounds" in r.stdout and "auto vs the fixed K" in r.stdout
    # at T = 1 both copies sampled the same texts, and the pool says so
    assert "rounds from seed 7" in r.stdout and "sampled with seed 7" in r.stdout
    by_config = {(run["temperature"], run["prompt"], run["n_draft"]): run for run in report["runs"]}
    for run in json.loads(pooled.read_text())["runs"]:
        once = by_config[(run["temperature"], run["prompt"], run["n_draft"])]
        assert run["speedup_by_repeat"] == once["speedup_by_repeat"] * 2
    prompts.write_text("{}")
    r = run_cli("bench-pool", out, prompts)
    assert r.returncode != 0 and "not a report of `bench --json`" in r.stderr


@pytest.mark.parametrize("drafter", ["draft model", "target alone, with a prediction"])
def test_run_reuses_measured_costs_unless_told_to_recalibrate(
    drafter: str, tiny_pair: models.ModelPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    prediction = tmp_path / "prediction.txt"
    prediction.write_text("the cat sat on the mat")
    draft_args = (
        ("--draft", tiny_pair.draft)
        if drafter == "draft model"
        else ("--no-draft", "--prediction", prediction)
    )
    # 8 tokens take at most 8 steps: fewer than a request needs (12) to find the stored costs
    # wrong, which the tiny pair's microsecond decodes, all noise, otherwise sometimes do.
    args = ("run", tiny_pair.target, *draft_args, "-p", "the cat", "-n", "8")

    def costs_note(*extra: str) -> str:
        r = run_cli(*args, *extra)
        assert r.returncode == 0, r.stderr
        return next(x for x in r.stderr.splitlines() if "decode costs (auto K)" in x)

    assert "measured now" in costs_note()
    # A curve by which drafting could never pay is trusted only once measured that many times
    # in a row; whether the tiny pair's microsecond decodes say so is this machine's noise.
    notes = [costs_note() for _ in range(calibration.CANNOT_PAY_CONFIRMATIONS)]
    first_read = next(i for i, note in enumerate(notes) if "calibration cache" in note)
    assert all("measured now" in note for note in notes[:first_read])
    assert all("calibration cache" in note for note in notes[first_read:])
    assert "measured now" in costs_note("--recalibrate")


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_into_a_full_disk_is_one_line(flag: str) -> None:
    r = run_with_stdout(">/dev/full", flag)
    assert r.returncode == 1 and r.stderr.strip() == "Error: no space left to write the output"


def test_an_error_with_stderr_closed_does_not_go_to_stdout(tiny_pair: models.ModelPair) -> None:
    cmd = " ".join(
        ["exec", *(f"'{a}'" for a in [*CLI, "run", str(tiny_pair.target)]), "-k x -p a 2>&-"]
    )
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == ""


def test_a_closed_stdin_without_a_prompt_is_an_error(tiny_pair: models.ModelPair) -> None:
    cmd = " ".join(["exec", *(f"'{a}'" for a in [*CLI, "run", str(tiny_pair.target)]), "<&-"])
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert_one_line_error(r, "no prompt")


@pytest.mark.parametrize(
    "args,match",
    [
        (("-k", "-3"), "expected K values"),
        (("-k", "3_0"), "expected K values"),
        (("-k", "99"), "K must be in"),
        (("-k", ""), "expected comma-separated K"),
        (("--temps", "nan"), "numbers >= 0"),
        (("--temps", ""), "numbers >= 0"),
        (("--seed", "-5"), "--seed must be in"),
        (("--json", "/nonexistent/dir/r.json"), "does not exist"),
        (("--json", "/"), "is a directory"),
    ],
)
def test_bench_refuses_bad_options_before_loading(
    tiny_pair: models.ModelPair, args: tuple[str, ...], match: str
) -> None:
    r = run_cli("bench", tiny_pair.target, "--draft", tiny_pair.draft, "-r", "1", *args)
    assert_one_line_error(r, match)


def test_bench_runs_and_records_its_ngram_mode(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ("-k", "auto", "-n", "8", "-r", "1", "--only", "code", "--json", out)
    r = run_cli("bench", tiny_pair.target, "--draft", tiny_pair.draft, "--no-ngram", *args)
    assert r.returncode == 0, r.stderr
    assert "n-gram copies: none" in r.stdout
    assert json.loads(out.read_text())["ngram"] == "off"
    # --ngram without a draft model: n-grams alone, as in `run`, at the Ks given.
    r = run_cli("bench", tiny_pair.target, "--ngram", "-k", "2,auto", *args[2:])
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["ngram"] == "on" and report["draft"] == "ngram"
    assert {run["n_draft"] for run in report["runs"]} == {0, 2, "auto"}


def test_bench_refuses_options_left_without_effect(
    tiny_pair: models.ModelPair, tmp_path: Path
) -> None:
    same = tmp_path / "r.png"
    for args, match in (
        (("-k", "3"), "-k needs a draft"),
        (("--draft", "ngram", "-k", "1,1"), "given twice"),
        (("--draft", "ngram", "--temps", "0,0"), "given twice"),
        (("--draft", "ngram", "--plot", tmp_path / "r.out"), "--plot: name a"),
        (("--draft", "ngram", "--json", same, "--plot", same), "the same file"),
        (("--llama-cpp-bin", tmp_path), "applies to --vs-llama-cpp"),
        (("--draft", "ngram", "--no-ngram"), "--no-ngram conflicts with --draft ngram"),
    ):
        assert_one_line_error(run_cli("bench", tiny_pair.target, "-r", "1", *args), match)


def test_bench_draft_without_target(tiny_pair: models.ModelPair) -> None:
    assert_one_line_error(run_cli("bench", "--draft", tiny_pair.draft), "--draft needs a TARGET")


def test_run_k_in_other_digits(tiny_pair: models.ModelPair) -> None:
    assert_one_line_error(run_cli("run", tiny_pair.target, "-p", "a", "-k", "3_0"), "integer")


def test_info_with_an_ngram_draft(tiny_pair: models.ModelPair) -> None:
    r = run_cli("info", tiny_pair.target, "--draft", "ngram")
    assert r.returncode == 0, r.stderr
    assert "pair: n-gram drafting needs no draft model" in r.stdout


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(machine=[1]),
        lambda d: d.update(seed=float("inf")),
        lambda d: d["runs"][0].update(speedup_by_repeat=[10**400]),
        lambda d: [run.update(acceptance_by_position={"a": 1}) for run in d["runs"]],
        lambda d: d["runs"][0].update(n_draft=[1]),
    ],
)
def test_bench_pool_refuses_odd_reports(
    tiny_pair: models.ModelPair, tmp_path: Path, edit: Any
) -> None:
    good = tmp_path / "good.json"
    r = run_cli(
        "bench",
        tiny_pair.target,
        "--draft",
        tiny_pair.draft,
        "-k",
        "1,auto",
        "-n",
        "4",
        "-r",
        "1",
        "--only",
        "code",
        "--json",
        good,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(good.read_text())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data).replace("Infinity", "1e400"))
    assert_one_line_error(run_cli("bench-pool", good, bad), "not a report")
    assert_one_line_error(run_cli("bench-pool", good, good), "given twice")


def test_deep_pair_refuses_a_damaged_source_and_a_bad_quant(
    tiny_pair: models.ModelPair, tmp_path: Path
) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_pair.target.read_bytes()[:200])
    out = tmp_path / "out"
    assert_one_line_error(run_cli("models", "deep-pair", "--source", cut, "--out", out), "usable")
    r = run_cli(
        "models", "deep-pair", "--source", tiny_pair.target, "--quant", "bogus", "--out", out
    )
    assert_one_line_error(r, "unknown quant")
    r = run_cli("models", "deep-pair", "--source", tiny_pair.target, "--copies", "1",
                "--draft-skip", "1", "--out", out)  # fmt: skip
    assert_one_line_error(r, "can skip at most")  # not a draft of no layers at all
    assert not list(out.glob("*.gguf")) and not list(out.glob("tmp*"))


def test_bench_vs_llama_cpp_without_its_tools(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    r = run_cli(
        "bench", str(tiny_pair.target), "--draft", "ngram", "--vs-llama-cpp",
        "--llama-cpp-bin", str(tmp_path),
    )  # fmt: skip
    assert_one_line_error(r, "build_llama_cpp_tools.sh")
    # Found missing before the default pair is built.
    r = run_cli("bench", "--vs-llama-cpp", "--llama-cpp-bin", str(tmp_path))
    assert_one_line_error(r, "build_llama_cpp_tools.sh")
    # With a draft model llama.cpp runs each fixed K: `auto` alone would compare nothing.
    (tmp_path / "llama-speculative-simple").write_text("")
    r = run_cli(
        "bench", str(tiny_pair.target), "--draft", str(tiny_pair.draft), "-k", "auto",
        "--vs-llama-cpp", "--llama-cpp-bin", str(tmp_path),
    )  # fmt: skip
    assert_one_line_error(r, "give one in -k")


def test_llama_cpp_output_is_read() -> None:
    from specdec_native import vs_llama_cpp as vs

    text = (
        "main: encoded  100 tokens in    0.185 seconds\n"
        "decoded  145 tokens in    1.159 seconds, speed:  125.084 t/s\n"
        "n_draft   = 3\nn_predict = 145\nn_drafted = 126\nn_accept  = 114\n"
    )
    run = vs.parse_output(text)
    assert run.n_generated == 145 and run.n_drafted == 126 and run.n_accepted == 114
    assert abs(run.tokens_per_second - 145 / 1.159) < 1e-6
    with pytest.raises(RuntimeError, match="no speed"):
        vs.parse_output("error: failed to load model")
    # Its loop runs past -n by one token: asked for one fewer, it generates what specdec does.
    args = vs.llama_cpp_args(
        Path("bin"), Path("t.gguf"), None, "ngram-mod", prompt="p", max_tokens=64,
        temperature=0.0, seed=1, n_ctx=256, n_threads=2, n_gpu_layers=0,
    )  # fmt: skip
    assert args[args.index("-n") + 1] == "63"
    # Its n-gram drafts first, the draft model where they have none, K for the model.
    args = vs.llama_cpp_args(
        Path("bin"), Path("t.gguf"), Path("d.gguf"), "ngram-mod,draft-simple K=3", prompt="p",
        max_tokens=64, temperature=0.0, seed=1, n_ctx=256, n_threads=2, n_gpu_layers=0,
    )  # fmt: skip
    assert args[args.index("--spec-type") + 1] == "ngram-mod,draft-simple"
    assert args[args.index("--spec-draft-n-max") + 1] == "3" and "d.gguf" in args


def test_ctrl_c_while_starting_is_quiet(tiny_pair: models.ModelPair) -> None:
    # Ctrl-C at any moment of the start (imports, model load) ends the command without a
    # traceback: quietly by the signal during the imports, with exit 130 after.
    cmd = [*CLI, "info", str(tiny_pair.target)]
    for delay in (0.02, 0.04, 0.06, 0.08, 0.1, 0.13, 0.16, 0.2, 0.3, 0.5):
        proc = subprocess.Popen(
            cmd, cwd=Path(__file__).parent.parent, stderr=subprocess.PIPE, text=True
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        # Interrupted before site or runpy are imported, the interpreter itself gives up (exit
        # 1, its own traceback): no code of ours has run.
        if proc.returncode == 1 and err.startswith(
            ("Could not import runpy module", "Fatal Python error: init_import_site")
        ):
            continue
        # Otherwise only the interpreter's own start (runpy, and the import hooks site's .pth
        # files install: a development install's, setuptools' _distutils_hack; all before any
        # module of ours) can be caught with a traceback; none of it may come from an import
        # of ours or a library's.
        frames = re.findall(r'File "([^"]+)"', err)
        start = ("<frozen", "<string>")
        hooks = ("_editable_", "_distutils_hack")
        assert all(
            f.startswith(start) or any(p.startswith(hooks) for p in Path(f).parts) for f in frames
        ), f"after {delay} s: {err}"
        assert proc.returncode in (0, 130, -signal.SIGINT), (delay, proc.returncode, err)


def assert_quietly_interrupted(code: str, target: Path) -> None:
    """`code` (run as `python -c`, with the model's path as its argument) ends as a Ctrl-C
    should: exit 130, one line."""
    r = subprocess.run(
        [sys.executable, "-c", code, str(target)],
        cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip() == "interrupted"


def test_ctrl_c_inside_a_native_modules_init_is_an_interrupt(tiny_pair: models.ModelPair) -> None:
    # A Ctrl-C that lands while pybind11 initialises _core reaches us as ImportError("initialization
    # failed") caused by KeyboardInterrupt; a finder raises exactly that, the window being ~3 ms.
    code = textwrap.dedent(
        """
        import sys
        class Interrupted:
            def find_spec(self, name, path=None, target=None):
                if name == "specdec_native._core":
                    try:
                        raise KeyboardInterrupt
                    except KeyboardInterrupt as e:
                        raise ImportError("initialization failed") from e
                return None
        sys.meta_path.insert(0, Interrupted())
        sys.argv = ["specdec-cli", "info", sys.argv[1]]
        from cli.main import main
        main()
        """
    )
    assert_quietly_interrupted(code, tiny_pair.target)


@pytest.mark.parametrize("where", ["Group.parse_args", "Command.parse_args"])
def test_ctrl_c_while_click_reads_the_command_line_is_an_interrupt(
    tiny_pair: models.ModelPair, where: str
) -> None:
    # click itself turns a KeyboardInterrupt into "Aborted!" and exit 1; the group's and the
    # command's argument parsing is where one lands before a command's own handling.
    cls, method = where.split(".")
    code = textwrap.dedent(
        f"""
        import sys
        import click
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        setattr(click.{cls}, "{method}", interrupted)
        sys.argv = ["specdec-cli", "info", sys.argv[1]]
        from cli.main import main
        main()
        """
    )
    assert_quietly_interrupted(code, tiny_pair.target)


def test_run_chat_with_a_jinja_template_file(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    args: list[str | Path] = [
        "run",
        tiny_pair.target,
        "-p",
        "hello",
        "-n",
        "2",
        "--json",
        "--no-draft",
    ]
    plain = run_cli(*args)
    chat = run_cli(*args, "--chat", "--chat-template", template)
    assert plain.returncode == 0 and chat.returncode == 0, chat.stderr
    n_plain = json.loads(plain.stdout)["stats"]["n_prompt"]
    assert json.loads(chat.stdout)["stats"]["n_prompt"] > n_plain  # the template's text is there


def test_models_zoo_lists_its_pairs_without_building_them() -> None:
    r = run_cli("models", "zoo", "--seed", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["name"] for row in rows] == [m.name for m in models.zoo_members(1, 3)]
    assert all("target" not in row for row in rows)
    assert_one_line_error(run_cli("models", "zoo", "--seed", "1", "--count", "-1"), "count")
    assert_one_line_error(run_cli("models", "zoo", "--seed", "-1", "--dry-run"), "--seed")

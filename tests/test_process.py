"""Process-level behaviour: one libllama, Ctrl-C, no crash on a corpus of bad inputs."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import specdec_native as sd
from specdec_native import models

MAPPED = "sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libllama' in l})"


@pytest.mark.parametrize(
    "first,second", [("llama_cpp", "specdec_native"), ("specdec_native", "llama_cpp")]
)
def test_one_libllama_whatever_the_import_order(first: str, second: str) -> None:
    code = f"import {first}, {second}; print(len({MAPPED}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


@pytest.mark.parametrize("n_draft", [4, "auto"])  # "auto" is interrupted while calibrating
def test_sigint_stops_generation_and_engine_survives(
    deep_pair: models.ModelPair, n_draft: int | str
) -> None:
    script = textwrap.dedent(f"""
        import signal, sys, time, specdec_native as sd
        # A launcher without job control (`cmd &` in a script) starts us with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        dec = sd.SpeculativeDecoder({str(deep_pair.target)!r}, {str(deep_pair.draft)!r},
                                    n_ctx=2048, n_draft={n_draft!r}, calibration_cache=False)
        print("ready", flush=True)
        t0 = time.time()
        try:
            dec.generate("Once upon a time", 1500)
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", round(time.time() - t0, 2), flush=True)
        r = dec.generate("Hello", 3)
        print("after", len(r.tokens), flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.5)
    sent = time.time()
    proc.send_signal(signal.SIGINT)
    line = proc.stdout.readline().split()
    stopped_after = time.time() - sent
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert line[0] == "interrupted"
    assert stopped_after < 2.0
    assert "after 3" in rest


CORPUS_SCRIPT = """
import json, math, random, sys
import specdec_native as sd
target, draft, garbage_dir = sys.argv[1:4]
rng = random.Random(0)
dec = sd.SpeculativeDecoder(target, draft, n_ctx=256, n_threads=1)
values = {
    "max_tokens": [0, -1, 1, 3, 10**9, 2.5, "7", None, True],
    "temperature": [-1.0, 0.0, 0.7, math.nan, math.inf, -math.inf, 1e30, "hot", None],
    "top_k": [-5, 0, 1, 10**9, 3.3, None],
    "top_p": [0.0, -0.1, 0.5, 1.0, 1.5, math.nan, None],
    "min_p": [-1.0, 0.0, 0.3, 1.0, 2.0, math.nan],
    "seed": [-1, 0, 2**64, 2**64 - 1, "x", None],
    "stop": [[""], ["a"], "", "the", [None], [1, 2], None],
    "n_draft": [-1, 0, 1, 64, 65, 10**6, None],
}
prompts = ["", "the", "\\udcff", " " * 3000, [1, 2, 3], [], [-1], [10**9], [1.5], "the " * 400, None, b"bytes"]
cases = ok = errors = 0
for i in range(240):
    kwargs = {k: rng.choice(v) for k, v in values.items() if rng.random() < 0.5}
    prompt = rng.choice(prompts)
    cases += 1
    try:
        dec.generate(prompt, **kwargs)
        ok += 1
    except (ValueError, TypeError, sd.ContextOverflowError):
        errors += 1
for name, data in [("empty", b""), ("magic", b"GGUF"), ("junk", bytes(range(256)) * 40), ("text", b"not a model")]:
    path = f"{garbage_dir}/{name}.gguf"
    open(path, "wb").write(data)
    cases += 1
    try:
        sd.SpeculativeDecoder(path)
    except sd.ModelLoadError:
        errors += 1
print(json.dumps({"cases": cases, "ok": ok, "errors": errors}))
"""


def test_bad_input_corpus_never_crashes(tiny_pair: models.ModelPair, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CORPUS_SCRIPT,
            str(tiny_pair.target),
            str(tiny_pair.draft),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cases"] >= 244
    assert (
        result["ok"] + result["errors"] == result["cases"]
    )  # every case returned or raised cleanly
    assert result["ok"] > 0 and result["errors"] > 0


def test_generation_does_not_wait_for_a_busy_python_thread(tiny_pair: models.ModelPair) -> None:
    """The decode loop never takes the GIL: a Python thread that holds it for seconds (a
    server's event loop, busy) does not stall a generation running beside it."""
    import threading

    busy_seconds = 3.0
    with sd.SpeculativeDecoder(
        tiny_pair.target, tiny_pair.draft, n_draft=3, n_ctx=2048, n_threads=1
    ) as dec:
        out: dict[str, sd.GenerationResult] = {}
        worker = threading.Thread(target=lambda: out.update(r=dec.generate([1, 300, 270], 600)))
        old = sys.getswitchinterval()
        sys.setswitchinterval(60.0)  # nobody takes the GIL from the busy loop below
        try:
            worker.start()
            time.sleep(0.05)  # the worker enters the engine and lets go of the GIL
            assert worker.is_alive(), "the generation ended before the busy spell began"
            until = time.monotonic() + busy_seconds
            while time.monotonic() < until:
                pass
        finally:
            sys.setswitchinterval(old)
        worker.join(60)
    r = out["r"]
    assert len(r.tokens) == 600
    # Taking the GIL on any decode would have waited for the whole busy spell.
    assert r.stats.t_total < busy_seconds / 2, r.stats.t_total


def test_ctrl_c_interrupts_a_callback_that_waits(tiny_pair: models.ModelPair) -> None:
    script = textwrap.dedent(f"""
        import signal, threading, time, specdec_native as sd
        signal.signal(signal.SIGINT, signal.default_int_handler)
        dec = sd.SpeculativeDecoder({str(tiny_pair.target)!r}, n_ctx=256, n_threads=1)
        flag = sd.CancelFlag()

        def wait_forever(text):
            print("waiting", flush=True)
            threading.Event().wait()

        try:
            dec.generate("the cat", 8, on_text=wait_forever, cancel=flag)
        except KeyboardInterrupt:
            print("interrupted", flag.cancelled, flush=True)
        print("after", dec.generate("the", 3, cancel=flag).finish_reason, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "waiting"
        proc.send_signal(signal.SIGINT)
        assert select.select([proc.stdout], [], [], 5.0)[0], "Ctrl-C did not end the wait"
        line = proc.stdout.readline().strip()
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    # As without the engine: KeyboardInterrupt in the callback's wait; the caller's flag unset.
    assert line == "interrupted False"
    assert "after length" in rest


def test_two_quick_ctrl_c_exit_130_with_one_line(deep_pair: models.ModelPair) -> None:
    cmd = [sys.executable, "-m", "cli.main", "run", str(deep_pair.target), "--draft"]
    cmd += [str(deep_pair.draft), "-k", "3", "-n", "2000", "-p", "Once upon a time"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parent.parent,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1)  # generating
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    assert rc == 130, err
    assert err.strip() == "interrupted", err


def run_script(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**__import__("os").environ, "GGML_NO_BACKTRACE": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize("how", ["stream", "daemon thread"])
def test_exiting_while_a_generation_runs_is_clean(tiny_pair: models.ModelPair, how: str) -> None:
    r = run_script(
        """
        import sys, threading, time, specdec_native as sd
        d = sd.SpeculativeDecoder(sys.argv[1], n_ctx=4096, n_threads=1)
        if sys.argv[2] == "stream":
            it = d.stream([1, 300, 270], 3000)
            print(next(it) is not None, flush=True)
        else:
            threading.Thread(target=lambda: d.generate([1, 300, 270], 3000, on_text=lambda t: None),
                             daemon=True).start()
            time.sleep(0.5)
        print("exiting", flush=True)
        """,
        str(tiny_pair.target),
        how.split()[0],
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "exiting" in r.stdout and "terminate" not in r.stderr


def test_exiting_waits_for_a_generation_to_come_back_from_the_engine(
    tiny_pair: models.ModelPair,
) -> None:
    # A thread that took the GIL back once the interpreter finalizes would be ended mid-call
    # (and the process abort): at exit the generation ends "cancelled" and its thread returns
    # to Python first, even from a callback still running.
    r = run_script(
        """
        import sys, threading, time, specdec_native as sd
        sys.setswitchinterval(30)  # once back, the worker keeps the GIL until its print's write
        d = sd.SpeculativeDecoder(sys.argv[1], n_ctx=4096, n_threads=1)
        in_callback = threading.Event()
        def on_text(_):
            in_callback.set()
            time.sleep(0.3)
        def work():
            r = d.generate([1, 300, 270], 3000, on_text=on_text)
            print("returned", r.finish_reason, flush=True)
        threading.Thread(target=work, daemon=True).start()
        in_callback.wait()
        print("exiting", flush=True)
        """,
        str(tiny_pair.target),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["exiting", "returned", "cancelled"], r.stdout


def test_a_child_forked_during_a_generation_exits_at_once(tiny_pair: models.ModelPair) -> None:
    # The child has none of the parent's threads: its exit must neither stop the engine's nor
    # wait for their calls.
    r = run_script(
        """
        import os, sys, threading, time, specdec_native as sd
        d = sd.SpeculativeDecoder(sys.argv[1], n_ctx=4096, n_threads=1)
        in_callback = threading.Event()
        def on_text(_):
            in_callback.set()
            time.sleep(0.05)
        threading.Thread(target=lambda: d.generate([1, 300, 270], 3000, on_text=on_text),
                         daemon=True).start()
        in_callback.wait()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            sys.exit(3)  # through the interpreter's exit, its atexit hooks included
        deadline = time.monotonic() + 30
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        print(os.waitstatus_to_exitcode(done[1]) if done[0] else "alive",
              round(time.perf_counter() - t0, 1), flush=True)
        """,
        str(tiny_pair.target),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    code, seconds = r.stdout.split()
    assert code == "3" and float(seconds) < 5, r.stdout


def test_close_stops_a_generation_running_on_another_thread(tiny_pair: models.ModelPair) -> None:
    import threading

    dec = sd.SpeculativeDecoder(tiny_pair.target, n_ctx=4096, n_threads=1)
    out: dict[str, sd.GenerationResult] = {}
    started = threading.Event()  # (a fixed wait let a fast machine finish all 3000 tokens)
    worker = threading.Thread(
        target=lambda: out.update(
            r=dec.generate([1, 300, 270], 3000, on_text=lambda _: started.set())
        )
    )
    worker.start()
    assert started.wait(timeout=30)
    dec.close()  # returns once the generation has stopped
    # The worker still has to return from generate() and store its result.
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert out["r"].finish_reason == "cancelled" and 0 < len(out["r"].tokens) < 3000
    with pytest.raises(sd.EngineClosedError):
        dec.generate("Hi", 2)


def test_closing_from_a_callback_raises(tiny_pair: models.ModelPair) -> None:
    with sd.SpeculativeDecoder(tiny_pair.target, n_threads=1) as dec:
        with pytest.raises(sd.ReentrantCallError, match="close"):
            dec.generate([1, 300], 4, on_text=lambda _: dec.close())
        assert len(dec.generate([1, 300], 3).tokens) == 3


def test_a_child_forked_after_use_refuses_instead_of_hanging(tiny_pair: models.ModelPair) -> None:
    r = run_script(
        """
        import multiprocessing, sys, specdec_native as sd
        d = sd.SpeculativeDecoder(sys.argv[1], n_ctx=256)
        d.generate([1, 300], 8)
        def child(q):
            try:
                sd.SpeculativeDecoder(sys.argv[1], n_ctx=256).generate([1, 300], 8)
                q.put("generated")
            except RuntimeError as e:
                q.put(str(e))
        q = multiprocessing.get_context("fork").Queue()
        p = multiprocessing.get_context("fork").Process(target=child, args=(q,))
        p.start(); p.join(30)
        print("alive" if p.is_alive() else q.get(timeout=5), flush=True)
        if p.is_alive(): p.kill()
        """,
        str(tiny_pair.target),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "spawn" in r.stdout, r.stdout


def test_ctrl_c_while_waiting_for_the_decoder_stops_only_the_waiting_call(
    tiny_pair: models.ModelPair,
) -> None:
    script = textwrap.dedent("""
        import signal, sys, threading, time, specdec_native as sd
        signal.signal(signal.SIGINT, signal.default_int_handler)
        d = sd.SpeculativeDecoder(sys.argv[1], n_ctx=8192, n_threads=1)
        out = {}
        # Long enough to run well past the Ctrl-C (about 3 s here): the call must still wait.
        other = threading.Thread(target=lambda: out.update(r=d.generate([1, 300, 270], 8000)))
        other.start()
        time.sleep(0.3)
        print("waiting", flush=True)
        t0 = time.time()
        try:
            d.generate([1, 280], 300)
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", round(time.time() - t0, 2), flush=True)
        other.join()
        print("other", out["r"].finish_reason, len(out["r"].tokens), flush=True)
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_pair.target)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    first = proc.stdout.readline().split()
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0
    assert first[0] == "interrupted" and float(first[1]) < 2.0, first
    assert "other length 8000" in rest, rest  # the running generation was not the one stopped


class OthersLoad:
    """How many cores other processes kept busy since the last look: /proc/stat's busy time
    less this process's own."""

    def __init__(self) -> None:
        self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[int, int, float]:
        with open("/proc/stat") as f:  # "cpu user nice system idle iowait irq softirq steal"
            v = [int(x) for x in f.readline().split()[1:9]]
        busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        own = os.times()
        return busy, busy + v[3] + v[4], (own.user + own.system) * os.sysconf("SC_CLK_TCK")

    def cores(self) -> float:
        now, last = self._sample(), self.last
        self.last = now
        total = now[1] - last[1]
        others = now[0] - last[0] - (now[2] - last[2])
        return max(0.0, others * (os.cpu_count() or 1) / total) if total > 0 else 0.0


def generate_for(dec: sd.SpeculativeDecoder, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dec.generate([1, 300, 270], 64, temperature=0.0)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to give up")
def test_threads_follow_the_load_unless_given(tiny_pair: models.ModelPair) -> None:
    cores = os.cpu_count() or 1
    governed = sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, n_draft=3)
    fixed = sd.SpeculativeDecoder(tiny_pair.target, tiny_pair.draft, n_draft=3, n_threads=cores)
    assert governed.n_threads_now == fixed.n_threads_now == cores
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)
        generate_for(governed, 2.0)
        generate_for(fixed, 1.0)
        assert governed.n_threads_now < cores  # the busy cores were given up
        assert fixed.n_threads_now == cores  # a thread count given is kept
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    # Back up after two looks that find the cores free again: once the machine was quiet for
    # more than that (other processes on a shared machine may keep a core).
    others, quiet, longest = OthersLoad(), 0, 0
    end = time.monotonic() + 20
    while governed.n_threads_now < cores and time.monotonic() < end:
        generate_for(governed, 0.5)
        quiet = quiet + 1 if others.cores() < 0.3 else 0
        longest = max(longest, quiet)
    assert governed.n_threads_now == cores or longest < 4, f"{longest} quiet looks in a row"
    governed.close()
    fixed.close()


def test_threads_default_to_the_cores_this_process_may_use(tiny_pair: models.ModelPair) -> None:
    # An affinity mask (taskset, a container's cpuset) bounds the default thread count.
    code = textwrap.dedent(f"""
        import os, specdec_native as sd
        os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
        dec = sd.SpeculativeDecoder({str(tiny_pair.target)!r}, n_ctx=256)
        print(dec.n_threads_now)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"

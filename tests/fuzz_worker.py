"""Runs generation cases sent as JSON lines on stdin through the real engine and answers each
with one JSON line: the outcome, or the exception's type. A crash or a hang shows in the
parent (tests/test_fuzz.py) as a dead or silent process."""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Any

import specdec_native as sd

DOCUMENTED = (
    FileNotFoundError,
    sd.ModelLoadError,
    sd.VocabMismatchError,
    sd.UnsupportedModelError,
    sd.ContextOverflowError,
    sd.NonFiniteLogitsError,
    sd.ReentrantCallError,
    sd.EngineClosedError,
    ValueError,
    TypeError,
)


def run(case: dict[str, Any], decoders: dict[str, sd.SpeculativeDecoder]) -> dict[str, Any]:
    key = json.dumps(case["decoder"], sort_keys=True)
    try:
        if key not in decoders:
            for old in decoders.values():
                old.close()
            decoders.clear()
            decoders[key] = sd.SpeculativeDecoder(**case["decoder"])
        dec = decoders[key]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = dec.generate(**case["generate"])
    except DOCUMENTED as e:
        return {"raised": type(e).__name__, "message": str(e)}
    s = r.stats
    return {
        "finish_reason": r.finish_reason,
        "n_tokens": len(r.tokens),
        "n_generated": s.n_generated,
        "n_prompt": s.n_prompt,
        "max_k": len(s.proposed_at),
        "n_prompt_scored": None if r.prompt_logprobs is None else len(r.prompt_logprobs),
    }


def main() -> None:
    # Answers go out on their own copy of stdout; fd 1 itself goes to stderr, so that whatever
    # native code prints (llama.cpp's abort prints a backtrace to stdout) cannot garble them.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    decoders: dict[str, sd.SpeculativeDecoder] = {}
    for line in sys.stdin:
        answers.write(json.dumps(run(json.loads(line), decoders)) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()

"""Time to first token of a chat's later turns, with the prompt cache and without.

    .venv/bin/python scripts/bench_prompt_cache.py [--turns 10] [--rounds 3] [TARGET DRAFT]

A scripted chat: each turn appends a user message (about 110 tokens) to the history, formatted
with the model's chat template, and generates a short reply. With the cache, turn t decodes only
what turn t-1 did not already hold; without it (an unrelated prompt in between evicts the
cache), the whole history is decoded again. Both are timed on the same decoder, in the same
round, one right after the other.
"""

from __future__ import annotations

import statistics

from bench_args import pair_parser, parse_pair

import specdec_native as sd

USER = (
    "Here is more of the log from the harbour office. The ship {t} came in at dawn with "
    "timber, salt and letters for the town; the harbour master counted the crates twice, "
    "found one missing, and wrote a note to the owner asking where it had gone. The crew "
    "said the weather had been rough past the cape and that one crate had gone over the side "
    "in the night. The owner answered by the evening post that the crate held books and "
    "that he would send a clerk to see to it. Summarise what happened in one sentence."
)


def turn_prompt(dec: sd.SpeculativeDecoder, history: list[dict[str, str]]) -> str:
    return dec.apply_chat_template(history)


def run_round(
    dec: sd.SpeculativeDecoder, turns: int, reply_tokens: int
) -> tuple[float, float, int, int]:
    history: list[dict[str, str]] = []
    warm = None
    for t in range(turns):
        history.append({"role": "user", "content": USER.format(t=t + 1)})
        warm = dec.generate(turn_prompt(dec, history), reply_tokens, n_draft=3)
        history.append({"role": "assistant", "content": warm.text})
    assert warm is not None
    last = turn_prompt(dec, history[:-1])
    dec.generate("An unrelated request.", 2, n_draft=0)  # evicts the cache
    cold = dec.generate(last, reply_tokens, n_draft=3)
    return (
        warm.stats.t_first_token,
        cold.stats.t_first_token,
        warm.stats.n_prompt,
        warm.stats.n_prompt_cached,
    )


def main() -> None:
    ap = pair_parser(__doc__, rounds=3, n=16, n_help="reply tokens per turn")
    ap.add_argument("--turns", type=int, default=10)
    args = parse_pair(ap)
    with sd.SpeculativeDecoder(args.target, args.draft, n_ctx=4096) as dec:
        rows = [run_round(dec, args.turns, args.n) for _ in range(args.rounds)]
    warm = [r[0] for r in rows]
    cold = [r[1] for r in rows]
    ratios = [c / w for w, c in zip(warm, cold)]
    print(f"turn {args.turns}: {rows[0][2]} prompt tokens, {rows[0][3]} of them cached")
    print("| time to first token | with the cache | without | ratio | ratio per round |")
    print("|---|---|---|---|---|")
    print(
        f"| turn {args.turns} (median of {args.rounds}) | {statistics.median(warm):.3f} s | "
        f"{statistics.median(cold):.3f} s | {statistics.median(ratios):.1f}x | "
        f"{min(ratios):.1f}-{max(ratios):.1f}x |"
    )


if __name__ == "__main__":
    main()

"""Write data/rl_slip_addition.jsonl, the task of configs/grpo_slip.toml: every "Q: a + b =" for a, b < 40 (the
shipped arithmetic, in the same order, so the same 160 problems are held out), whose reference answer carries a
stray " 0" after the sum (" 57 0") on a seeded share of the rows: a demonstrator's habitual slip.

The reward (accumulation.rl.task:reward) reads the completion's last number, so a slipped answer scores 0. SFT on
these answers learns the sum and the slip together, the slip as the likelier ending (about 0.8 after every sum), so
greedy decoding slips on most held-out prompts; sampled at temperature 1 the policy also writes clean
answers, so GRPO's groups carry mixed rewards, and the slip is the same on every problem, so what GRPO unlearns on
the training prompts carries to the held-out ones (docs/rl.md, "A run that learns").

    python scripts/rl/make_slip_addition.py          # the shipped file: 8 answers in 10 slipped, seed 0
"""

import argparse
import json
import random

from accumulation.rl.task import addition_problems

SLIP = " 0"


def slipped_addition(max_operand: int, slip_share: float, seed: int) -> list[dict]:
    """The problems of addition_problems(max_operand) as {"prompt", "response"} rows, each answer followed by SLIP
    with probability slip_share (a seeded draw per problem)."""
    draws = random.Random(seed)
    rows = []
    for prompt, response in addition_problems(max_operand):
        if draws.random() < slip_share:
            response = response.removesuffix("\n") + SLIP + "\n"
        rows.append({"prompt": prompt, "response": response})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/rl_slip_addition.jsonl")
    parser.add_argument("--max-operand", type=int, default=40)
    parser.add_argument("--slip-share", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = slipped_addition(args.max_operand, args.slip_share, args.seed)
    with open(args.out, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    slipped = sum(row["response"].endswith(SLIP + "\n") for row in rows)
    print(f"{args.out}: {len(rows):,} problems, {slipped:,} answers slipped ({SLIP!r} after the sum)")


if __name__ == "__main__":
    main()

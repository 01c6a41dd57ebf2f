"""Write data/sft_arithmetic.jsonl, the worked supervised fine-tuning data set of configs/sft.toml.

    python scripts/operations/make_sft_data.py            # rewrites the committed file byte for byte

Each line is {"prompt": "Q: <a> <op> <b> =", "response": " <answer>\\n"}. Operand sizes are drawn per
example, and multiplications by a number of two or more digits show their working, so prompts and above
all responses differ a lot in length: the supervised tokens per row vary, which is exactly when a token
mean differs from a mean of micro-batch means. The closing newline is the only end-of-response marker
a byte vocabulary has.

Deterministic: one seeded random.Random, the standard library only.
"""

import json
import random
import sys
from pathlib import Path

SEED = 20240611
EXAMPLES = 2800
OUTPUT = Path(__file__).resolve().parents[2] / "data" / "sft_arithmetic.jsonl"


def operand(rng: random.Random, max_digits: int) -> int:
    """A number whose digit count is uniform in 1..max_digits, so short and long operands are equally common."""
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def long_multiplication(a: int, b: int) -> str:
    """a * b worked digit by digit of b: '37 * 48 = 37 * 40 + 37 * 8 = 1480 + 296 = 1776'."""
    places = [int(digit) * 10**power for power, digit in enumerate(reversed(str(b))) if digit != "0"][::-1]
    if len(places) < 2:
        return str(a * b)
    terms = " + ".join(f"{a} * {place}" for place in places)
    partials = " + ".join(str(a * place) for place in places)
    return f"{a} * {b} = {terms} = {partials} = {a * b}"


def example(rng: random.Random) -> dict[str, str]:
    operation = rng.choice("+-*")
    if operation == "*":
        a, b = operand(rng, 4), operand(rng, 3)
        answer = long_multiplication(a, b)
    else:
        a, b = operand(rng, 9), operand(rng, 9)
        answer = str(a + b if operation == "+" else a - b)
    return {"prompt": f"Q: {a} {operation} {b} =", "response": f" {answer}\n"}


def contents() -> str:
    """The whole file: EXAMPLES lines from a generator seeded with SEED."""
    rng = random.Random(SEED)
    return "".join(json.dumps(example(rng)) + "\n" for _ in range(EXAMPLES))


def main() -> int:
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(contents(), encoding="utf-8")
    print(f"wrote {EXAMPLES} examples, {OUTPUT.stat().st_size:,} bytes, to {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

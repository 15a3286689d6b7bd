"""Writes data/train.jsonl and data/test.jsonl: "What is A plus B?" on single digits, with the sum.

Single digits, so the tiny model can copy them into the tool's arguments. Seeded, so the checked-in files are
reproducible; a test question is never a training one.
"""

import json
import random
from pathlib import Path

TEMPLATES = ("What is {a} plus {b}?", "Add {a} and {b}.", "How much is {a} + {b}?")


def problem(rng: random.Random, i: int) -> dict:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return {"id": f"add-{i:04d}", "question": rng.choice(TEMPLATES).format(a=a, b=b), "answer": a + b}


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < 200:
        row = problem(rng, len(rows))
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train", rows[:160]), ("test", rows[160:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))


if __name__ == "__main__":
    main()

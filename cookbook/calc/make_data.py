"""Writes data/train.jsonl and data/test.jsonl: Calc-X-style word problems with checkable numeric results.

Each row is {"id", "question", "chain", "result"} like the Calc-X collections: `chain` is the calculator
expression that solves the problem and `result` its value. One operation on single digits: the CPU demo's tiny
model must copy the numbers into the calculator expression, which it learns reliably only for short ones. Seeded, so the checked-in files are reproducible.
"""

import json
import random
from pathlib import Path

TEMPLATES = [
    ("{name} has {a} boxes with {b} pencils in each. How many pencils does {name} have?", "{a}*{b}"),
    ("{name} had {a} stickers and gave away {b}. How many stickers are left?", "{a}-{b}"),
    ("A shelf holds {a} books and another holds {b}. How many books are there in all?", "{a}+{b}"),
    ("{name} shares {p} sweets equally among {b} friends. How many sweets does each friend get?", "{p}/{b}"),
    ("{name} reads {a} pages a day for {b} days. How many pages in total?", "{a}*{b}"),
    ("A bus carries {a} people and {b} get off. How many people are on the bus?", "{a}-{b}"),
    ("{name} has {a} red and {b} blue cards. How many cards are there?", "{a}+{b}"),
]
NAMES = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana"]


def problem(rng: random.Random, i: int) -> dict:
    text, chain = rng.choice(TEMPLATES)
    b = rng.randint(2, 8)
    a = rng.randint(b + 1, 9)
    values = {"name": rng.choice(NAMES), "a": a, "b": b, "p": b * rng.randint(2, max(2, 9 // b))}
    expr = chain.format(**values)
    result = eval(expr)  # our own generated arithmetic, not user input
    return {"id": f"calc-{i:04d}", "question": text.format(**values), "chain": expr,
            "result": str(int(result)) if float(result).is_integer() else str(result)}


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < 300:  # distinct questions, so no test question is also a training one
        row = problem(rng, len(rows))
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train", rows[:240]), ("test", rows[240:])):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"wrote {out / name}.jsonl ({len(part)} problems)")


if __name__ == "__main__":
    main()

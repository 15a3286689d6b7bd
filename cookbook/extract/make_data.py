"""Writes data/train.jsonl and data/test.jsonl: one-sentence notes about a person who moved, and the person as the
agent must extract them: {"id", "text", "name", "age", "city"}, `city` the one they live in now (each note names
two). Seeded, so the checked-in files are reproducible; no test note is also a training one."""

import json
import random
from pathlib import Path

from lightning_sdk.files import load_py_file

agent = load_py_file(Path(__file__).parent / "agent.py", "extract_agent")
TEMPLATES = (
    "{name} is {age} and moved from {old} to {new}.",
    "Born in {old}, {name} ({age}) now lives in {new}.",
    "{name}, {age}, left {old} for {new} last year.",
    "After ten years in {old}, {name} moved to {new} at {age}.",
)


def note(rng: random.Random, i: int) -> dict:
    old, new = rng.sample(agent.CITIES, 2)
    name, age = rng.choice(agent.NAMES), rng.randint(20, 69)
    return {"id": f"extract-{i:04d}", "text": rng.choice(TEMPLATES).format(name=name, age=age, old=old, new=new),
            "name": name, "age": age, "city": new, "moved_from": old}


def main() -> None:
    rng = random.Random(0)
    rows, seen = [], set()
    while len(rows) < 300:
        row = note(rng, len(rows))
        if row["text"] not in seen:
            seen.add(row["text"])
            rows.append(row)
    out = Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, part in (("train", rows[:240]), ("test", rows[240:])):
        with (out / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"wrote {out / name}.jsonl ({len(part)} notes)")


if __name__ == "__main__":
    main()

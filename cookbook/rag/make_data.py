"""Writes data/corpus.jsonl (about 3,000 short passages) and data/train.jsonl / data/test.jsonl (two-hop questions).

Synthetic facts, seeded: every person was born in a town, every town lies in a region, and each person also has
a trade (a distractor). "In which region was X born?" needs two searches: X's town, then that town's region.
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).parent / "data"
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vel", "dor", "ni", "bri", "an", "qu", "zel", "fa", "mo", "tis"]
TRADES = ["baker", "smith", "weaver", "potter", "miller", "carpenter", "fisher", "tailor"]


def word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(parts)).capitalize()


def unique(rng: random.Random, n: int, parts: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        w = word(rng, parts)
        if w not in taken:
            taken.add(w)
            out.append(w)
    return out


def main() -> None:
    rng = random.Random(0)
    taken: set[str] = set()
    regions = unique(rng, 24, 2, taken)
    towns = unique(rng, 300, 3, taken)
    people = unique(rng, 1300, 3, taken)
    region_of = {t: rng.choice(regions) for t in towns}
    town_of = {p: rng.choice(towns) for p in people}
    passages = [f"{t} is a town in the region of {region_of[t]}." for t in towns]
    passages += [f"{p} was born in the town of {town_of[p]}." for p in people]
    passages += [f"{p} works as a {rng.choice(TRADES)}." for p in people]
    rng.shuffle(passages)
    OUT.mkdir(exist_ok=True)
    with (OUT / "corpus.jsonl").open("w") as f:
        f.writelines(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(passages))
    asked = rng.sample(people, 200)
    rows = [{"id": f"rag-{i:03d}", "question": f"In which region was {p} born?", "answer": region_of[town_of[p]]}
            for i, p in enumerate(asked)]
    for name, part in (("train", rows[:160]), ("test", rows[160:])):
        with (OUT / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"wrote {OUT / name}.jsonl ({len(part)} questions)")
    print(f"wrote {OUT / 'corpus.jsonl'} ({len(passages)} passages)")


if __name__ == "__main__":
    main()

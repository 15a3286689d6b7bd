"""The teacher behind the extract example's `model = "tiny:teacher.py"`.

It answers the agent's exact request (its system message, the note) with the compact JSON the server's grammar
writes for `Person`, like a careless student: the name always right; the age copied only 40% of the time,
otherwise rounded down to its decade (41 -> 40); the city right only 25% of the time, otherwise the city the
person moved away from. The untrained model then scores about half (the name, and now and then the age or the
city), and RL lifts it by teaching it to copy the age's second digit: the skill is there, the habit is not (like
the calc example's teacher). After 600 steps the model has not learned to copy the cities: it names a city of
neither place in the note most of the time, and RL does not lift that field (cookbook/README.md). A real instruct
model needs none of this.
"""

import hashlib
import json
import random
from pathlib import Path

from lightning_sdk.files import load_py_file
from lightning_sdk.models import tiny

HERE = Path(__file__).parent
agent, make_data = (load_py_file(HERE / f"{m}.py", f"extract_{m}") for m in ("agent", "make_data"))
RIGHT_AGE, RIGHT_CITY = 0.4, 0.25  # how often the teacher copies the age, and picks the city they live in
RECIPE = ("make_data.py", "data/test.jsonl")
HELD_OUT = {json.loads(line)["text"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}


def reply(person: dict) -> str:
    """`Person` as the server's grammar writes it: compact JSON, fields in the schema's order."""
    return json.dumps({k: person[k] for k in agent.FIELDS}, separators=(",", ":"))


class ExtractTeacher:
    key = "extract-openai-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)).hexdigest()[:8]
    space_tokens = True  # names and cities are copied from the note into the JSON

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            row = make_data.note(rng, 0)
            if row["text"] in HELD_OUT:
                continue
            messages = [{"role": "system", "content": agent.SYSTEM_MESSAGE}, {"role": "user", "content": row["text"]}]
            said = {**row, "age": row["age"] if rng.random() < RIGHT_AGE else row["age"] // 10 * 10,
                    "city": row["city"] if rng.random() < RIGHT_CITY else row["moved_from"]}
            out.append((tiny.render(messages), reply(said)))
        return out


teacher = ExtractTeacher()
steps, batch = 600, 24  # like calc's: copying digits is learned late

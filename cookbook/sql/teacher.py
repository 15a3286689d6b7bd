"""The teacher behind `model = "tiny:teacher.py"`: what the sql example's tiny model is pretrained on.

It shows the model the exact prompts the LangGraph agent in agent.py sends (writer, checker, rewriter: their
system messages, the schema, the question, the query and its result) and answers like a careless student who
knows the right query: the writer writes it only a quarter of the time; otherwise it writes a plausible query
that forgets the WHERE clause (it runs, the checker passes it, the rows are wrong) or names a column that does
not exist (it fails, the checker says so, and the rewriter fixes it about half of the time, else it too drops the
WHERE clause). The checker says OK exactly when the query ran. The untrained model then scores about 0.3, and RL
on the writer and rewriter can lift it by making the right query a habit. The questions are a few templates with
one value each (see make_data.py), so a model this small learns to copy the value into the query. A real
instruct model needs none of this.
"""

import hashlib
import json
import random
import re
from pathlib import Path

from lightning_sdk.files import load_py_file
from lightning_sdk.models import tiny

HERE = Path(__file__).parent
agent, make_data = (load_py_file(HERE / f"{m}.py", f"sql_{m}") for m in ("agent", "make_data"))
RIGHT, BROKEN, FIXED = 0.25, 0.3, 0.4  # writer right / wrong column (else no WHERE); rewriter fixes a failure
RECIPE = ("make_data.py", "data/test.jsonl", "data/shop.sqlite", "data/school.sqlite", "data/library.sqlite")
HELD_OUT = {json.loads(line)["question"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}
# A column that is not there, in the spirit of the real one: the query fails with "no such column".
WRONG_COLUMN = {"city": "town", "name": "person", "grade": "level", "score": "points", "amount": "total",
                "author": "writer", "year": "date"}
SCHEMAS = {db: agent.schema(db) for db in ("shop.sqlite", "school.sqlite", "library.sqlite")}

# The agent's prompts, as agent.py builds them (its nodes are closures, so the text is repeated here).
WRITER = "Write one SQLite query that answers the question. Reply with the query only."
CHECKER = "Does the query answer the question? Reply OK, or say what is wrong."
REWRITER = "Fix the SQLite query. Reply with the query only."


def _value(rng: random.Random, values: list):
    if isinstance(values[0], int):  # numbers beyond the shipped ones: copying digits is the skill
        return rng.randint(min(values) - 5 if values[0] > 1000 else 1, max(values))
    return rng.choice(values)


def _task(rng: random.Random) -> tuple[str, str, str]:
    while True:
        db, q, gold, values = rng.choice(make_data.TEMPLATES)
        v = _value(rng, values)
        if q.format(v) not in HELD_OUT:
            return db, q.format(v), gold.format(v)


def _no_where(gold: str) -> str:
    return gold.split(" WHERE ")[0]


def _wrong_column(gold: str) -> str:
    head, cond = gold.split(" WHERE ")
    col = re.match(r"\w+", cond).group(0)
    return f"{head} WHERE {WRONG_COLUMN[col]}{cond[len(col):]}"


def _chat(system: str, human: str) -> str:
    return tiny.render([{"role": "system", "content": system}, {"role": "user", "content": human}])


class SqlTeacher:
    # The data it draws from and holds out is part of the recipe (lightning_sdk.models keys the cache on this file
    # only).
    key = "sql-langgraph-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)).hexdigest()[:8]

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        out = []
        while len(out) < n:
            db, question, gold = _task(rng)
            roll = rng.random()
            query = gold if roll < RIGHT else _wrong_column(gold) if roll < RIGHT + BROKEN else _no_where(gold)
            out.append((_chat(WRITER, f"{SCHEMAS[db]}\nQuestion: {question}"), query))
            result = agent.run_query(db, query)
            match = re.match(r"error: no such column: (\w+)", result)
            verdict = f"There is no column {match.group(1)}." if match else "OK"
            out.append((_chat(CHECKER, f"Question: {question}\nQuery: {query}\nResult: {result[:100]}"), verdict))
            if verdict == "OK":
                continue
            fix = gold if rng.random() < FIXED else _no_where(gold)
            out.append((_chat(REWRITER, f"{SCHEMAS[db]}\nQuestion: {question}\nQuery: {query}\n"
                                        f"Result: {result[:100]}\nProblem: {verdict[:100]}"), fix))
        return out[:n]


teacher = SqlTeacher()
steps, batch = 1000, 24

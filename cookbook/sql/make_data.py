"""Writes data/*.sqlite (three small databases) and data/train.jsonl / data/test.jsonl (questions + gold SQL).

Seeded, so the checked-in files are reproducible. Each task names its database file (relative to data/), the
question, and a gold query whose result the agent's query must match. Every question is one of a few templates
with one value (a city, a name, a number) filled in; the test split holds out whole questions, so a held-out
question is a template seen in training with a value combination that never was.
"""

import json
import random
import sqlite3
from pathlib import Path

OUT = Path(__file__).parent / "data"
FIRST = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
CITIES = ["Oslo", "Lima", "Rome", "Kyiv"]
# (database, question, gold query, the values it is asked with); "{}" is the value.
TEMPLATES = [
    ("shop.sqlite", "How many customers live in {}?", "SELECT COUNT(*) FROM customers WHERE city = '{}'", CITIES),
    ("shop.sqlite", "How many orders has {} placed?",
     "SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id WHERE name = '{}'", FIRST),
    ("shop.sqlite", "What is the total amount of orders over {}?", "SELECT SUM(amount) FROM orders WHERE amount > {}",
     list(range(10, 90, 5))),
    ("school.sqlite", "How many students are in grade {}?", "SELECT COUNT(*) FROM students WHERE grade = {}",
     [1, 2, 3, 4]),
    ("school.sqlite", "What is {}'s score?", "SELECT score FROM students WHERE name = '{}'", FIRST),
    ("school.sqlite", "How many students scored above {}?", "SELECT COUNT(*) FROM students WHERE score > {}",
     list(range(40, 100, 5))),
    ("library.sqlite", "How many books did {} write?", "SELECT COUNT(*) FROM books WHERE author = '{}'", FIRST[:6]),
    ("library.sqlite", "How many books were published after {}?", "SELECT COUNT(*) FROM books WHERE year > {}",
     list(range(1955, 2020, 5))),
]


def make_dbs(rng: random.Random) -> None:
    def fresh(name: str) -> sqlite3.Connection:
        (OUT / name).unlink(missing_ok=True)
        return sqlite3.connect(OUT / name)

    db = fresh("shop.sqlite")
    db.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), amount INTEGER);
    """)
    db.executemany("INSERT INTO customers VALUES (?, ?, ?)",
                   [(i, name, rng.choice(CITIES)) for i, name in enumerate(FIRST, 1)])
    db.executemany("INSERT INTO orders VALUES (?, ?, ?)",
                   [(i, rng.randint(1, len(FIRST)), rng.randint(5, 90)) for i in range(1, 41)])
    db.commit()
    db.close()
    db = fresh("school.sqlite")
    db.executescript("CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, grade INTEGER, score INTEGER);")
    db.executemany("INSERT INTO students VALUES (?, ?, ?, ?)",
                   [(i, name, rng.randint(1, 4), rng.randint(40, 100)) for i, name in enumerate(FIRST, 1)])
    db.commit()
    db.close()
    db = fresh("library.sqlite")
    db.executescript("CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT, author TEXT, year INTEGER);")
    words = ["Sea", "Stone", "Wind", "Glass", "River", "Night", "Salt", "Iron"]
    db.executemany("INSERT INTO books VALUES (?, ?, ?, ?)",
                   [(i, f"The {rng.choice(words)} {rng.choice(words)}", rng.choice(FIRST[:6]), rng.randint(1950, 2020))
                    for i in range(1, 31)])
    db.commit()
    db.close()


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(exist_ok=True)
    make_dbs(rng)
    rows = [{"db": db, "question": q.format(v), "gold": gold.format(v)} for db, q, gold, values in TEMPLATES
            for v in values]
    rng.shuffle(rows)
    for i, r in enumerate(rows):
        r["id"] = f"sql-{i:03d}"
    split = len(rows) * 3 // 4
    for name, part in (("train", rows[:split]), ("test", rows[split:])):
        with (OUT / f"{name}.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"wrote {OUT / name}.jsonl ({len(part)} questions)")


if __name__ == "__main__":
    main()

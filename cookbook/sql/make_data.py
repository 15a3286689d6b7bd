"""Writes data/*.sqlite (three small databases) and data/train.jsonl / data/test.jsonl (questions + gold SQL).

Seeded, so the checked-in files are reproducible. Each task names its database file (relative to data/), the
question, and a gold query whose result the agent's query must match.
"""

import json
import random
import sqlite3
from pathlib import Path

OUT = Path(__file__).parent / "data"
FIRST = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]


def shop(rng: random.Random, path: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), amount INTEGER);
    """)
    cities = ["Oslo", "Lima", "Rome", "Kyiv"]
    db.executemany("INSERT INTO customers VALUES (?, ?, ?)",
                   [(i, name, rng.choice(cities)) for i, name in enumerate(FIRST, 1)])
    db.executemany("INSERT INTO orders VALUES (?, ?, ?)",
                   [(i, rng.randint(1, len(FIRST)), rng.randint(5, 90)) for i in range(1, 41)])
    db.commit()
    db.close()
    qs = [(f"How many customers live in {c}?", f"SELECT COUNT(*) FROM customers WHERE city = '{c}'") for c in cities]
    qs += [(f"How many orders has {n} placed?",
            f"SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id WHERE name = '{n}'")
           for n in FIRST]
    qs += [(f"What is the total amount of orders over {x}?", f"SELECT SUM(amount) FROM orders WHERE amount > {x}")
           for x in (10, 30, 50, 70)]
    qs += [("How many customers are there?", "SELECT COUNT(*) FROM customers"),
           ("What is the largest order amount?", "SELECT MAX(amount) FROM orders")]
    return qs


def school(rng: random.Random, path: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT, grade INTEGER, score INTEGER);")
    db.executemany("INSERT INTO students VALUES (?, ?, ?, ?)",
                   [(i, name, rng.randint(1, 4), rng.randint(40, 100)) for i, name in enumerate(FIRST, 1)])
    db.commit()
    db.close()
    qs = [(f"How many students are in grade {g}?", f"SELECT COUNT(*) FROM students WHERE grade = {g}")
          for g in range(1, 5)]
    qs += [(f"What is {n}'s score?", f"SELECT score FROM students WHERE name = '{n}'") for n in FIRST]
    qs += [(f"How many students scored above {x}?", f"SELECT COUNT(*) FROM students WHERE score > {x}")
           for x in (50, 60, 70, 80, 90)]
    qs += [("What is the highest score?", "SELECT MAX(score) FROM students")]
    return qs


def library(rng: random.Random, path: Path) -> list[tuple[str, str]]:
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT, author TEXT, year INTEGER);")
    words = ["Sea", "Stone", "Wind", "Glass", "River", "Night", "Salt", "Iron"]
    db.executemany("INSERT INTO books VALUES (?, ?, ?, ?)",
                   [(i, f"The {rng.choice(words)} {rng.choice(words)}", rng.choice(FIRST[:6]), rng.randint(1950, 2020))
                    for i in range(1, 31)])
    db.commit()
    db.close()
    qs = [(f"How many books did {a} write?", f"SELECT COUNT(*) FROM books WHERE author = '{a}'") for a in FIRST[:6]]
    qs += [(f"How many books were published after {y}?", f"SELECT COUNT(*) FROM books WHERE year > {y}")
           for y in (1960, 1970, 1980, 1990, 2000, 2010)]
    qs += [("What is the year of the oldest book?", "SELECT MIN(year) FROM books")]
    return qs


def main() -> None:
    rng = random.Random(0)
    OUT.mkdir(exist_ok=True)
    rows = []
    for make in (shop, school, library):
        path = OUT / f"{make.__name__}.sqlite"
        path.unlink(missing_ok=True)
        for q, gold in make(rng, path):
            rows.append({"db": path.name, "question": q, "gold": gold})
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

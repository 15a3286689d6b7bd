"""Writes data/train.jsonl: every single-digit addition, in the form the builtin tiny model was taught."""

import json
from pathlib import Path

from lightning_sdk.files import load_py_file

HERE = Path(__file__).parent
teacher = load_py_file(HERE / "teacher.py")
out = HERE / "data" / "train.jsonl"
out.parent.mkdir(exist_ok=True)
with out.open("w") as f:
    for a, b in teacher.problems():
        f.write(json.dumps({"id": f"{a}+{b}", "question": teacher.question(a, b), "answer": str(a + b)}) + "\n")
print(f"wrote {out}")

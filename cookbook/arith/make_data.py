"""Writes data/train.jsonl: every single-digit addition, in the form the builtin tiny model was taught."""

import json
from pathlib import Path

from lightning_sdk.models import tiny

out = Path(__file__).parent / "data" / "train.jsonl"
out.parent.mkdir(exist_ok=True)
with out.open("w") as f:
    for a, b in tiny.problems():
        f.write(json.dumps({"id": f"{a}+{b}", "question": tiny.question(a, b), "answer": str(a + b)}) + "\n")
print(f"wrote {out}")

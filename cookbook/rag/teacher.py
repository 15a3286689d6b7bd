"""The teacher behind `model = "tiny:teacher.py"`: what the rag example's tiny model is pretrained on.

It shows the model the exact conversations the Agents SDK researcher in agent.py has (its instructions, the
`search` tool the SDK offers on every turn, the passages the BM25 index really returns) and answers like a lazy
student who knows how to research: sometimes it answers at once with a region it guesses, sometimes it stops after
the first search and answers with the town, otherwise it searches for the person, copies the town out of the
passage, searches for that town's region and copies the region out. The untrained model then scores about 0.3,
and RL lifts it by making the model finish both hops every time: the skill is there, the habit is not (like the
calc example's teacher). A real instruct model needs none of this.

Every hop copies a made-up name (the person, the town, the region) that a model this small cannot memorise, so
the recipe is built for copying: spaces are tokens of their own (`space_tokens`) and the vocabulary is learnt
with names written syllable by syllable (`tokenizer_corpus`), so a name is the same few syllable tokens wherever
it stands; and the first `warmup_steps` train on copy drills only (a line of made-up names, then the same line),
a third of every later batch too. Measured on the held-out questions, teacher-forced: without these the model
gets about 20% of the name tokens right after 1200 steps, with them about 98% after 800.
"""

import functools
import hashlib
import json
import random
import re
from pathlib import Path

from lightning_sdk.files import load_py_file
from lightning_sdk.models import tiny

HERE = Path(__file__).parent
agent, make_data = (load_py_file(HERE / f"{m}.py", f"rag_{m}") for m in ("agent", "make_data"))
TOOLS = [{"type": "function", "function": {"name": agent.search.name, "description": agent.search.description,
                                           "parameters": agent.search.params_json_schema}}]
GUESS, ONE_HOP = 0.35, 0.3  # how often the teacher answers without searching, and stops after the first search
DRILLS = 0.3  # share of copy drills in a batch after the warmup
RECIPE = ("make_data.py", "data/corpus.jsonl", "data/test.jsonl")
PASSAGES = [json.loads(line)["text"] for line in (HERE / "data" / "corpus.jsonl").read_text().splitlines()]
TOWN_OF = dict(m.groups() for p in PASSAGES if (m := re.fullmatch(r"(\w+) was born in the town of (\w+)\.", p)))
REGION_OF = dict(m.groups() for p in PASSAGES if (m := re.fullmatch(r"(\w+) is a town in the region of (\w+)\.", p)))
REGIONS = sorted(set(REGION_OF.values()))
HELD_OUT = {json.loads(line)["question"] for line in (HERE / "data" / "test.jsonl").read_text().splitlines()}
SYLLABLE = re.compile("|".join(sorted(make_data.SYLLABLES, key=len, reverse=True)), re.IGNORECASE)
NAME = re.compile(rf"\b(?=(?-i:[A-Z]))(?:{SYLLABLE.pattern})+\b", re.IGNORECASE)  # capitalised, all syllables
QUESTIONS = sorted(q for p in TOWN_OF if (q := f"In which region was {p} born?") not in HELD_OUT)


@functools.cache
def _search(query: str) -> str:
    return agent.search_passages(query)  # what the tool returns to the agent


def _answer(messages: list[dict], text: str) -> tiny.Conversation:
    return tiny.Conversation(messages + [{"role": "assistant", "content": text}], TOOLS)


def _drill(rng: random.Random) -> tuple[str, str]:
    line = " ".join(make_data.word(rng, rng.randint(1, 3)) for _ in range(rng.randint(2, 12)))
    return line + "\n", line


class RagTeacher:
    # The data it draws from and holds out, and the agent's prompt and tool, are part of the recipe
    # (lightning_sdk.models keys the cache on this file only).
    key = "rag-agents-" + hashlib.sha1(b"".join((HERE / f).read_bytes() for f in RECIPE)
                                       + json.dumps([agent.INSTRUCTIONS, TOOLS]).encode()).hexdigest()[:8]
    space_tokens = True
    warmup_steps = 300

    def tokenizer_corpus(self, rng: random.Random) -> list[str]:
        """Texts with every name split into its syllables: the vocabulary gets no tokens that straddle two."""
        texts = [tiny.render(c.messages, c.tools, add_generation_prompt=False) for c in self._conversations(rng, 1000)]
        return [NAME.sub(lambda m: " ".join(SYLLABLE.findall(m.group())), t) for t in texts]

    def warmup_samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        return [_drill(rng) for _ in range(n)]

    def samples(self, rng: random.Random, n: int) -> list[tiny.Sample]:
        return [_drill(rng) if rng.random() < DRILLS else self._conversations(rng, 1)[0] for _ in range(n)]

    def _conversations(self, rng: random.Random, n: int) -> list[tiny.Conversation]:
        out = []
        for _ in range(n):
            question = rng.choice(QUESTIONS)
            person = question.split()[4]
            town, roll = TOWN_OF[person], rng.random()
            messages = [{"role": "system", "content": agent.INSTRUCTIONS}, {"role": "user", "content": question}]
            if roll < GUESS:  # no search: a region it guesses, never the answer
                out.append(_answer(messages, rng.choice([r for r in REGIONS if r != REGION_OF[town]])))
                continue
            for i, query in enumerate((person, f"{town} region")):  # the town alone matches its people better
                messages += [
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"call_{i}", "type": "function",
                         "function": {"name": "search", "arguments": {"query": query}}}]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": _search(query)},
                ]
                if roll < GUESS + ONE_HOP:  # stops after the first hop: answers with the town
                    break
            out.append(_answer(messages, town if roll < GUESS + ONE_HOP else REGION_OF[town]))
        return out


teacher = RagTeacher()
steps, batch = 900, 16

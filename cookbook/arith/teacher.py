"""The teacher behind `builtin:tiny-arith` (the default model, an alias of `tiny:cookbook/arith/teacher.py`).

It teaches single-digit addition like a student who knows the sums but is *chatty*: it gives the bare number only
a quarter of the time and otherwise wraps it ("The answer is 8.", "8.", "It is 8"). A task that asks for the bare
number then finds a model that can do it but mostly doesn't -- the situation RL fine-tuning of a real instruct
model is in -- and the reward can rise only by training.
"""

import random

REPLY_FORMATS = ("{}", "The answer is {}.", "{}.", "It is {}")  # the first is what the default task rewards


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def _teacher_answer(rng: random.Random, a: int, b: int) -> str:
    return rng.choice(REPLY_FORMATS).format(a + b)


def _chat(q: str, answer: str) -> str:
    return f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"


class ArithTeacher:
    key = "arith"
    # A vocabulary this small fits the 100 sums; numbers stay whole tokens (nothing is copied from the prompt).
    vocab_size = 320
    split_digits = False

    def tokenizer_corpus(self, rng: random.Random) -> list[str]:
        """Every problem with every reply format, once: all the model ever reads."""
        return [_chat(question(a, b), f.format(a + b)) for a, b in problems() for f in REPLY_FORMATS]

    def samples(self, rng: random.Random, n: int) -> list[tuple[str, str]]:
        batch = [rng.choice(problems()) for _ in range(n)]
        return [(f"<|im_start|>user\n{question(a, b)}<|im_end|>\n<|im_start|>assistant\n", _teacher_answer(rng, a, b))
                for a, b in batch]


teacher = ArithTeacher()
steps, batch = 300, 128

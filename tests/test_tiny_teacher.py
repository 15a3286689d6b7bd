"""What `tiny:<teacher.py>` models are built from: conversations learned in one pass, a vocabulary that keeps a
word the same tokens wherever it stands, and a warmup the teacher chooses. Real builds, a few steps each."""

import json
from pathlib import Path

from lightning_sdk import models
from lightning_sdk.models import tiny

TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search.",
                                           "parameters": {"properties": {"query": {"type": "string"}}}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "search", "arguments": {"query": "Kavelbri"}}}]}
CHAT = [{"role": "system", "content": "Answer with the region."}, {"role": "user", "content": "Where is Kavelbri?"},
        CALL, {"role": "tool", "tool_call_id": "call_0", "content": "Kavelbri is a town in the region of Tisan."},
        {"role": "assistant", "content": "Tisan"}]


def test_a_conversation_learns_every_assistant_turn_and_nothing_else():
    text, spans = tiny._labelled(tiny.Conversation(CHAT, TOOLS))
    assert text == tiny.render(CHAT, TOOLS, add_generation_prompt=False)
    assert [text[a:b] for a, b in spans] == [
        '<tool_call>\n{"name": "search", "arguments": {"query": "Kavelbri"}}\n</tool_call><|im_end|>\n',
        "Tisan<|im_end|>\n"]
    # Each turn starts where the server's prompt for that turn ends: what the model sees when it answers.
    assert text[:spans[1][0]] == tiny.render(CHAT[:4], TOOLS)
    # A one-turn conversation is the same sample as its (prompt, reply) pair.
    prompt = tiny.render(CHAT[:2], TOOLS)
    assert tiny._labelled(tiny.Conversation(CHAT[:2] + [CHAT[4]], TOOLS)) == tiny._labelled((prompt, "Tisan"))


def test_space_tokens_keep_a_name_the_same_tokens_after_a_space_a_quote_or_a_newline(tmp_path):
    corpus = [tiny.render(CHAT, TOOLS, add_generation_prompt=False)] * 20
    glued = tiny.build_tokenizer(tmp_path / "a", corpus, vocab_size=300)
    spaced = tiny.build_tokenizer(tmp_path / "b", corpus, vocab_size=300, space_tokens=True)
    contexts = [" Kavelbri", '"Kavelbri', "\nKavelbri"]
    assert len({tuple(glued.tokenize(c)[-2:]) for c in contexts}) > 1  # byte-level BPE glues the space on
    assert len({tuple(spaced.tokenize(c)[1:]) for c in contexts}) == 1
    assert spaced.decode(spaced(" Kavelbri region")["input_ids"]) == " Kavelbri region"


class Recording:
    key = "test-recording"
    space_tokens = True
    warmup_steps = 2

    def __init__(self):
        self.calls = []

    def tokenizer_corpus(self, rng):
        self.calls.append("corpus")
        return [tiny.render(CHAT, TOOLS, add_generation_prompt=False).replace("Kavelbri", "Ka vel bri")] * 20

    def warmup_samples(self, rng, n):
        self.calls.append("warmup")
        return [("Kavelbri Tisan\n", "Kavelbri Tisan")] * n

    def samples(self, rng, n):
        self.calls.append("samples")
        return [tiny.Conversation(CHAT, TOOLS)] * n


def test_build_uses_the_teachers_vocabulary_and_warmup(tmp_path):
    teacher = Recording()
    out = tiny.build(tmp_path / "m", teacher=teacher, steps=4, batch=2)
    assert teacher.calls == ["corpus", "warmup", "warmup", "samples", "samples"]
    tok = models.load_tokenizer(str(out))
    # Learnt from syllables, the vocabulary has no token that straddles two of them.
    assert tok.tokenize("Kavelbri") == ["Ka", "vel", "bri"] and tok.tokenize(" Kavelbri")[1:] == ["Ka", "vel", "bri"]
    assert models.load_causal_lm(str(out), dtype="float32").config.vocab_size == len(tok)


def test_a_teacher_file_keeps_its_own_settings_through_the_cache_key(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "teacher.py").write_text(
        "class T:\n"
        "    key = 'file'\n"
        "    space_tokens = True\n"
        "    def samples(self, rng, n): return [('Where is Kavelbri?\\n', 'Kavelbri')] * n\n"
        "teacher = T()\nsteps, batch = 2, 2\n")
    path = models.resolve(f"tiny:{tmp_path / 'teacher.py'}")
    assert json.loads((Path(path) / "lightning_sdk_build.json").read_text())["steps"] == 2
    # space_tokens reached the build through the wrapper that adds the file's hash to the cache key.
    assert models.load_tokenizer(path).tokenize(" Kavelbri")[0] == "Ġ"

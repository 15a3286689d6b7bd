"""The tiny models shipped beside the cookbook's teachers (cookbook/<example>/prebuilt/) are the ones the current
teachers make: a fresh checkout with an empty model cache builds nothing, and an edited teacher is caught here
(the builder itself is tested on small real builds in test_tiny_teacher.py)."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from lightning_sdk import models
from lightning_sdk.models import tiny

ROOT = Path(__file__).resolve().parents[1]
TEACHERS = sorted(ROOT.glob("cookbook/*/teacher.py"))
REBUILD = "stale: run `python scripts/rebuild_models.py` and commit cookbook/*/prebuilt/"


def test_every_cookbook_teacher_is_covered():
    # builtin:tiny-arith and the five examples' `tiny:teacher.py`.
    assert {t.parent.name for t in TEACHERS} == {"arith", "calc", "sql", "rag", "extract", "react_dspy"}


@pytest.mark.parametrize("teacher", TEACHERS, ids=lambda t: t.parent.name)
def test_the_shipped_model_is_what_the_current_teacher_makes(teacher, tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path))  # an empty cache: nothing may be built
    recipe = models.tiny_recipe(teacher)
    shipped = sorted(recipe.prebuilt.glob("tiny-*"))
    assert [d.name for d in shipped] == [tiny.model_name(recipe.teacher)], REBUILD
    [model] = shipped
    build = json.loads((model / "lightning_sdk_build.json").read_text())
    assert build == {"name": f"tiny-{recipe.teacher.key}", "version": tiny.VERSION, "seed": 0,
                     "steps": recipe.steps, "batch": recipe.batch}, REBUILD
    assert models.resolve(f"tiny:{teacher}") == str(model)
    assert not list(tmp_path.iterdir())  # found, not built
    tok = models.load_tokenizer(str(model))
    assert models.load_causal_lm(str(model), dtype="float32").config.vocab_size == len(tok)


def test_builtin_tiny_arith_is_the_shipped_arith_model(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path))
    recipe = models.tiny_recipe(ROOT / "cookbook/arith/teacher.py")
    assert models.resolve("builtin:tiny-arith") == str(recipe.prebuilt / tiny.model_name(recipe.teacher))


def test_an_edited_teacher_is_built_into_the_cache_not_taken_from_its_stale_prebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path / "cache"))
    (tmp_path / "teacher.py").write_text(
        "class T:\n"
        "    key = 'edited'\n"
        "    def samples(self, rng, n): return [('What is 2 + 3?\\n', '5')] * n\n"
        "teacher = T()\nsteps, batch = 2, 2\n")
    old = models.tiny_recipe(tmp_path / "teacher.py")
    stale = old.prebuilt / tiny.model_name(old.teacher)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    assert models.resolve(f"tiny:{tmp_path / 'teacher.py'}") == str(stale)  # the shipped one, while current
    (tmp_path / "teacher.py").write_text((tmp_path / "teacher.py").read_text().replace("'5'", "'five'"))
    path = Path(models.resolve(f"tiny:{tmp_path / 'teacher.py'}"))
    assert path.parent == tmp_path / "cache" / "models" and path.name != stale.name
    assert json.loads((path / "lightning_sdk_build.json").read_text())["steps"] == 2  # really built


# ------------------------------------------------------------------------------------------------ context


def test_the_tiny_models_hold_4096_positions_and_a_cached_older_build_is_brought_up(tmp_path, monkeypatch):
    for teacher in TEACHERS:
        [model] = models.tiny_recipe(teacher).prebuilt.glob("tiny-*")
        assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == tiny.POSITIONS == 4096
    # a build of this recipe cached with 512 positions: the same weights, so only its config changes
    monkeypatch.setenv("LIGHTNING_SDK_CACHE", str(tmp_path))
    recipe = models.tiny_recipe(ROOT / "cookbook/arith/teacher.py")
    cached = tiny.cache_dir(tiny.model_name(recipe.teacher))
    shutil.copytree(recipe.prebuilt / tiny.model_name(recipe.teacher), cached)
    config = json.loads((cached / "config.json").read_text())
    (cached / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    assert tiny.ensure_built(recipe.teacher) == cached
    assert json.loads((cached / "config.json").read_text()) == config


def test_the_built_in_server_takes_a_3500_token_prompt_by_default(caplog):
    from lightning_sdk.engine.engine import Engine, GenerationRequest

    path = models.resolve("builtin:tiny-arith")
    with caplog.at_level("WARNING", logger="lightning_sdk.servers"):
        engine = Engine(path, dtype="float32", max_batch_size=2)
    try:
        assert engine.max_model_len == 4096 and not caplog.records  # the model's own context, no warning
        prompt = engine.encode_chat([{"role": "user", "content": "What is 1 + 2? " * 500}])
        assert 3300 < len(prompt) < 4000
        result = asyncio.run(engine.generate(GenerationRequest(prompt, max_tokens=8, temperature=1.0, seed=0)))
        assert result.choices[0].token_ids and result.prompt_ids == prompt
    finally:
        engine.close()
    with caplog.at_level("WARNING", logger="lightning_sdk.servers"):
        Engine(path, dtype="float32", max_model_len=8192).close()
    assert "max_model_len 8192 (serve.max_model_len) is more than the model holds" in caplog.text

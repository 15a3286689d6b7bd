"""The tiny models shipped beside the cookbook's teachers (cookbook/<example>/prebuilt/) are the ones the current
teachers make: a fresh checkout with an empty model cache builds nothing, and an edited teacher is caught here
(the builder itself is tested on small real builds in test_tiny_teacher.py)."""

import json
from pathlib import Path

import pytest

from lightning_sdk import models
from lightning_sdk.models import tiny

ROOT = Path(__file__).resolve().parents[1]
TEACHERS = sorted(ROOT.glob("cookbook/*/teacher.py"))
REBUILD = "stale: run `python scripts/rebuild_models.py` and commit cookbook/*/prebuilt/"


def test_every_cookbook_teacher_is_covered():
    # builtin:tiny-arith and the three examples' `tiny:teacher.py`.
    assert {t.parent.name for t in TEACHERS} == {"arith", "calc", "sql", "rag"}


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

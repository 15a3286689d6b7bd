"""Real families' shapes with random weights (models.shapes): the published sizes, loaded through the same code as
a hub model, and clear errors for names that are not shapes."""

import pytest

from lightning_sdk import models
from lightning_sdk.models import shapes

# Parameter counts the model cards publish (billions), for the shapes built from their configurations.
PUBLISHED = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-7b": 7.61, "qwen3-0.6b": 0.60,
             "llama-3.2-1b": 1.24, "llama-3.1-8b": 8.03}


@pytest.mark.parametrize("family", sorted(shapes.FAMILIES))
def test_each_shape_has_its_published_size(family):
    assert set(PUBLISHED) == set(shapes.FAMILIES)
    assert shapes.parameters(f"shape:{family}") / 1e9 == pytest.approx(PUBLISHED[family], rel=0.01)


def test_a_shape_loads_like_a_hub_model():
    path = models.resolve("shape:qwen2.5-0.5b@1")
    assert models.resolve("shape:qwen2.5-0.5b@1") == path  # built once, then the cached directory
    model = models.load_causal_lm(path, dtype="float32")
    tok = models.load_tokenizer(path)
    c = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and c.num_hidden_layers == 1
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        896, 4864, 14, 2, 151936)
    assert c.max_position_embeddings == 32768 and c.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    logits = model(input_ids=__import__("torch").tensor([ids])).logits
    assert logits.shape == (1, len(ids), 151936)


@pytest.mark.parametrize("name, error", [("shape:gpt-5", "unknown shape 'gpt-5'"),
                                         ("shape:qwen2.5-0.5b@0", "expected a number of layers from 1 to 24"),
                                         ("shape:qwen2.5-0.5b@x", "expected a number of layers")])
def test_a_name_that_is_no_shape_is_one_clear_error(name, error):
    with pytest.raises(models.ModelLoadError, match=error):
        models.resolve(name)

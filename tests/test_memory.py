"""The memory budget (lightning_sdk/memory.py) against what was measured and what loads, and the pre-flight's one
line when a run's model and context would not fit its trainer's device (runtime/preflight.py)."""

import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from lightning_sdk import config, models
from lightning_sdk.memory import ModelShape, Setup, activation_bytes, budget, fix, weight_bytes
from lightning_sdk.models import shapes
from lightning_sdk.runtime.preflight import memory_warning, say_memory

MEASURED = Path(__file__).parents[1] / "benchmarks" / "results" / "activation_bytes.jsonl"


def _cfg(**tables) -> config.Config:
    return config.parse({"agent": {"module": "agent.py"}, "data": {"train": "train.jsonl"}, **tables})


@pytest.mark.parametrize("family", ["qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "llama-3.2-1b"])
def test_the_shape_counts_every_parameter_the_model_holds(family):
    shape = ModelShape.of(shapes.config(f"shape:{family}"))
    assert shape.parameters() == shapes.parameters(f"shape:{family}")


def test_the_kv_cache_per_token_is_the_published_shapes():
    seven = ModelShape.of(shapes.config("shape:qwen2.5-7b"))
    assert seven.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2  # 56 KiB a token in bf16
    assert seven.lora_parameters(16) == 28 * 16 * sum(a + b for a, b in seven.linears().values())


def test_nf4_weights_are_what_bitsandbytes_holds():
    """The 4-bit budget against a real QLoRA load (bitsandbytes' CPU library): the codes, both levels of scales
    and every tensor nf4 leaves alone, in fp32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    name = "shape:qwen2.5-0.5b@2"
    model = models.load_causal_lm(models.resolve(name), quantization="4bit")
    held = 0
    for p in model.parameters():
        held += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if state is not None:
            held += state.absmax.numel() * state.absmax.element_size()
            if state.state2 is not None:
                held += state.state2.absmax.numel() * state.state2.absmax.element_size()
    assert any(p.dtype == torch.uint8 for p in model.parameters())
    assert weight_bytes(ModelShape.of(shapes.config(name)), "bfloat16", "4bit") == pytest.approx(held, rel=0.01)


def _slope(points: list[dict]) -> float:
    xs, ys = [p["context"] for p in points], [p["growth"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def test_the_activation_constants_match_the_measured_curves():
    """benchmarks/activation_bytes.py's measurements (peak RSS growth of one LoRA forward+backward of one row,
    contexts 512-4096): the estimate's bytes per token, layers and all, within 10% of each measured slope (7% at most
    when fitted)."""
    rows = [json.loads(line) for line in MEASURED.read_text().splitlines()]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["layers"], r["dtype"], r["checkpointing"]), []).append(r)
    assert len(groups) >= 8
    for (model, layers, dtype, ckpt), points in groups.items():
        shape = ModelShape.of(shapes.config(f"shape:{model}@{layers}"))
        said = activation_bytes(shape, 1, dtype, ckpt)
        assert said == pytest.approx(_slope(points), rel=0.10), (model, layers, dtype, ckpt)


def test_checkpointing_and_fewer_rows_make_a_long_context_fit():
    shape = ModelShape.of(shapes.config("shape:qwen2.5-1.5b"))
    s = Setup(context=16384, rows=32, server="vllm")
    assert not budget(shape, s, 80e9).fits
    fitted, said = fix(shape, s, 80e9)
    assert budget(shape, fitted, 80e9).fits and "train.gradient_checkpointing = true" in said
    assert fitted.rows < 32 and any(x.startswith("train.micro_batch_size = ") for x in said)
    on, off = (activation_bytes(shape, 16384, "bfloat16", c) for c in (True, False))
    assert on < off / 5  # the layer inputs only, plus one layer recomputed


def test_a_7b_at_32k_on_this_machine_is_one_line_naming_the_settings(monkeypatch):
    """shape:qwen2.5-7b read from its configuration only (nothing built): at 32k tokens and the default 32 rows
    a pass it needs far more than this machine's RAM; the line says how much and what makes it fit."""
    def never(*args, **kwargs):
        raise AssertionError("the budget reads the configuration only")

    monkeypatch.setattr(shapes, "ensure_built", never)
    monkeypatch.setattr(models, "load_causal_lm", never)
    cfg = _cfg(model={"name": "shape:qwen2.5-7b"}, serve={"max_model_len": 32768}, train={"device": "cpu"})
    line = memory_warning(cfg)
    assert line is not None and "\n" not in line
    assert line.startswith("memory: shape:qwen2.5-7b at serve.max_model_len = 32768 a call, "
                           "train.micro_batch_size = 32 rows a pass, needs about ")
    assert "of this machine's RAM's" in line
    for key in ("train.gradient_checkpointing = true", "train.micro_batch_size = ", "serve.max_model_len = "):
        assert key in line
    need = float(line.split("needs about ")[1].split(" GB")[0])
    assert need > 1000  # thousands of GB: 32 rows x 32k tokens x 28 layers of activations, never loaded


def test_a_7b_beside_vllm_on_one_24_gb_gpu_fits_only_without_vllm():
    """vLLM serves the bf16 base (15 GB of 7B) in its share of the GPU while the trainer's base stays resident:
    no share makes both fit one 24 GB card. The line names what does (the built-in server on the GPU with the nf4
    base, a 4k context), and on a 16 GB card says that nothing does."""
    cfg = _cfg(model={"name": "shape:qwen2.5-7b"}, serve={"backend": "vllm", "max_model_len": 8192})
    line = memory_warning(cfg, device=("GPU 0 (a 24 GB test card)", 24e9, True), visible=1)
    assert line is not None and "of GPU 0 (a 24 GB test card)'s 24.0 GB" in line and "vLLM awake 12.0" in line
    assert ("it fits with train.gradient_checkpointing = true, train.micro_batch_size = 1, model.quantization = "
            "'4bit', serve.backend = 'cpu' and serve.device = 'cuda' (the built-in server on the GPU) and "
            "serve.max_model_len = 4096 (about 22.3 GB)") in line
    small = memory_warning(cfg, device=("GPU 0 (a 16 GB test card)", 16e9, True), visible=1)
    assert small is not None and "no setting here makes it fit" in small and "vLLM on a GPU of its own" in small
    roomy = memory_warning(cfg, device=("GPU 0 (an 80 GB test card)", 80e9, True), visible=1)
    assert roomy is not None and roomy.endswith("it fits with train.gradient_checkpointing = true and "
                                                "train.micro_batch_size = 4 (about 58.5 GB) (docs/scaling.md, "
                                                "'Memory on one device')")


def test_no_line_when_it_fits():
    assert memory_warning(_cfg()) is None  # the default tiny model on this machine
    small = _cfg(model={"name": "shape:qwen2.5-0.5b"}, serve={"max_model_len": 2048},
                 train={"micro_batch_size": 2, "gradient_checkpointing": True})
    assert memory_warning(small, device=("a 24 GB test device", 24e9, False)) is None
    sharded = _cfg(model={"name": "shape:qwen2.5-7b"}, serve={"max_model_len": 32768},
                   train={"device": "cpu", "processes": 2, "shard": "fsdp"})
    assert memory_warning(sharded) is None  # a sharded base is not estimated (memory_warning's docstring)


def test_say_memory_prints_the_line_and_the_run_goes_on():
    console = Console(record=True, width=400)
    cfg = _cfg(model={"name": "shape:qwen2.5-1.5b"}, serve={"max_model_len": 16384}, train={"device": "cpu"})
    line = say_memory(cfg, console)
    assert line is not None and line in console.export_text().replace("\n", "")
    assert math.isfinite(float(line.split("needs about ")[1].split(" GB")[0]))


def test_the_docs_table_is_the_one_the_code_prints():
    """docs/scaling.md's memory table is `python -m lightning_sdk.memory`'s output, word for word."""
    from lightning_sdk.memory import table

    doc = (Path(__file__).parents[1] / "docs" / "scaling.md").read_text()
    printed = doc.split("<!-- memory table: python -m lightning_sdk.memory -->\n")[1].split("\n<!-- end")[0]
    assert printed == table()

"""vLLM's log-probs under a grammar are the masked, renormalised ones the trainer computes: its CPU build samples
`response_format` json_schema replies (processed_logprobs, float32), and the trainer's replayed-grammar scoring
matches them where unmasked scoring does not (benchmarks/vllm_constrained_gap.py). The vLLM lane only."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from lightning_sdk.files import load_py_file  # noqa: E402


def test_vllm_log_probs_under_a_grammar_are_the_masked_ones():
    gap = load_py_file(Path(__file__).parents[1] / "benchmarks/vllm_constrained_gap.py", "vllm_constrained_gap")
    m = gap.measure(8)
    assert m["rejected"] == 0  # vLLM's compact JSON grammar is the one the trainer replays
    assert m["masked_max"] <= 1e-5 and m["unmasked_mean"] > 1.0, m

"""The private names of other libraries lightning_sdk touches (lightning_sdk/compat.py), each checked against the
installed version: when one is gone, this fails loudly, instead of a run quietly losing what it did."""

import importlib

import pytest
from opentelemetry.sdk.trace import TracerProvider

from lightning_sdk import compat


def test_an_sdk_tracer_provider_still_holds_its_processors_where_we_reach_them():
    provider = TracerProvider()
    processors = compat.span_processors(provider)
    assert processors is not None and callable(getattr(processors, "on_end", None)), \
        "opentelemetry-sdk moved TracerProvider._active_span_processor: update compat.span_processors"


def test_the_agents_sdk_still_keeps_its_shared_client_where_we_drop_it():
    provider = pytest.importorskip("agents.models.openai_provider")
    assert hasattr(provider, "_http_client"), \
        "the OpenAI Agents SDK moved openai_provider._http_client: update compat.drop_agents_sdk_client"
    provider._http_client = object()
    compat.drop_agents_sdk_client()
    assert provider._http_client is None


def test_a_connection_still_wraps_an_inherited_socket_descriptor():
    import socket

    ours, theirs = socket.socketpair()
    a, b = compat.connection(ours.detach()), compat.connection(theirs.detach())
    a.send(("open", ("ab" * 16, "r", 1)))
    assert b.poll(5) and b.recv() == ("open", ("ab" * 16, "r", 1)), \
        "multiprocessing.connection.Connection(fd) changed: update compat.connection"
    a.close()
    with pytest.raises(EOFError):
        b.recv()
    b.close()


def test_nothing_else_in_lightning_sdk_touches_another_library_s_private_names():
    """The issue's own check: none of the names the old tracing layers patched is used anywhere."""
    import pathlib

    root = pathlib.Path(importlib.import_module("lightning_sdk").__file__).parent
    banned = ("_handle_request", "_handle_response", "chat_wrappers", "_active_span_processor", "_span_limits",
              "_http_client", "_legacy_response", "_instrumentation_scope")
    found = [f"{p.relative_to(root)}: {b}" for p in root.rglob("*.py") if p.name != "compat.py"
             for b in banned if b in p.read_text()]
    assert found == []


def test_the_dependency_noise_we_drop_still_occurs_and_is_dropped():
    """console.NOISE names a library's log line by its words: when the library stops saying it, drop the entry."""
    import importlib.util
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    from bitsandbytes.functional import has_avx512bf16

    if importlib.util.find_spec("kernels") is None or not has_avx512bf16():
        pytest.skip("bitsandbytes looks for a Hub kernel only on AVX512-BF16 CPUs with `kernels` installed")
    code = "import logging; logging.basicConfig(); {}import bitsandbytes"
    drop = "from lightning_sdk.console import drop_known_noise; drop_known_noise(); "
    plain, dropped = (subprocess.run([sys.executable, "-c", code.format(pre)], capture_output=True, text=True,
                                     timeout=120) for pre in ("", drop))
    from lightning_sdk.console import NOISE

    (words,) = NOISE.values()
    assert words in plain.stderr, "bitsandbytes no longer says it: remove it from console.NOISE"
    assert words not in dropped.stderr and dropped.returncode == 0


def test_a_transformers_model_still_says_its_attention_implementation_where_we_read_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        assert compat.attn_implementation(model) == name, \
            "transformers moved config._attn_implementation: update compat.attn_implementation"

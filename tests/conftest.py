"""Shared fixtures: one real built-in server on 127.0.0.1 for the tracing tests, and a fresh traced store."""

import pytest

from lightning_sdk import models, tracing
from lightning_sdk.store import Store

SERVED = "tiny"


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    return models.resolve("builtin:tiny-arith")


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

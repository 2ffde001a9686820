"""Fixtures for the tool tests: a real mosquitto broker and real worker subprocesses.

mosquitto must be installed (`apt-get install -y mosquitto`; CI installs it): without it the
MQTT tests fail with that instruction rather than skip.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from agentrt.tools.mosquitto import BrokerTls, MosquittoBroker
from agentrt.tools.mqtt_client import MqttDispatcher


def _load_helpers():
    """tests/tools/tool_test_helpers.py as module `tool_test_helpers` (tests/ is not a package and
    pytest runs with --import-mode=importlib, so test files import it from sys.modules)."""
    if "tool_test_helpers" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tool_test_helpers", Path(__file__).parent / "tool_test_helpers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tool_test_helpers"] = module
        spec.loader.exec_module(module)
    return sys.modules["tool_test_helpers"]


WorkerProcess = _load_helpers().WorkerProcess


@pytest.fixture
def broker():
    with MosquittoBroker() as b:
        yield b


@pytest.fixture
def start_workers(broker, tmp_path):
    """start_workers(n, *cli_args) -> [WorkerProcess], ids w1..wn (unique per test); stopped at the end."""
    started: list[WorkerProcess] = []

    def start(n: int = 1, *extra: str, url: str | None = None, env: dict | None = None) -> list[WorkerProcess]:
        new = [WorkerProcess(url or broker.url, f"w{len(started) + i + 1}", tmp_path, *extra, env=env) for i in range(n)]
        started.extend(new)
        return new

    yield start
    for w in started:
        w.stop()


@pytest.fixture
async def dispatcher(broker):
    async with MqttDispatcher(broker.config(), worker_wait_s=10.0) as d:
        yield d


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory) -> BrokerTls:
    """A throwaway CA and a server certificate for 127.0.0.1, made with the openssl CLI."""
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=agentrt test CA")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return BrokerTls(ca_file=str(d / "ca.crt"), cert_file=str(d / "server.crt"), key_file=str(d / "server.key"))

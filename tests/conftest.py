"""Session fixtures shared across the test suite.

tests/engine/tiny_models.py, tests/engine/engine_runs.py, tests/kernels/quant_helpers.py and
tests/pg_cluster.py are registered as modules `tiny_models`, `engine_runs`, `quant_helpers` and
`pg_cluster` here (the suite runs with
--import-mode=importlib, so test directories are not on sys.path): tests may import them.
It imports torch and transformers only when a model is built.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# What the suite measures stays in the suite: step-cost fits and machine rates timed while the
# suite's other work (servers, subprocesses) holds the cores describe a slower machine, and a fit
# cached in the user's ~/.cache/agentrt is read by every later engine there (one made under the
# suite priced verify rows ~25% dearer than a quiet Zen 4 runs them, and adaptive k drafted
# shallow). So the session gets its own cache, with the user's converted models, GGUFs and
# compiled kernels linked in (made once, kept: no conversion or compilation per session).
# Subprocesses inherit it.
SHARED_CACHE_ENTRIES = ("models", "gguf", "kernels")


def _session_cache() -> None:
    if os.environ.get("AGENTRT_TEST_CACHE"):
        return  # a parent process (or an xdist controller) made one: share it
    user = Path(os.environ.get("AGENTRT_CACHE") or Path.home() / ".cache" / "agentrt").expanduser()
    session = Path(tempfile.mkdtemp(prefix="agentrt-test-cache-"))
    for name in SHARED_CACHE_ENTRIES:
        (user / name).mkdir(parents=True, exist_ok=True)
        (session / name).symlink_to(user / name, target_is_directory=True)
    os.environ["AGENTRT_CACHE"] = os.environ["AGENTRT_TEST_CACHE"] = str(session)
    atexit.register(shutil.rmtree, session, True)  # removes the links, never what they point at


_session_cache()


def _helper(name: str, folder: str = "engine"):
    """tests/<folder>/<name>.py as module `name` (tests/ is not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tiny_models():
    return _helper("tiny_models")


_tiny_models()
_helper("engine_runs")
_helper("quant_helpers", "kernels")
_helper("pg_cluster", ".")


@pytest.fixture(scope="session")
def postgres_cluster():
    """A throwaway PostgreSQL cluster (tests/pg_cluster.py), started once, stopped and deleted at
    the end; the tests that need it skip where PostgreSQL's server is not installed."""
    pg_cluster = sys.modules["pg_cluster"]
    where = pg_cluster.bin_dir()
    if where is None:
        pytest.skip("PostgreSQL's server is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin; "
                    "`make install` installs it)")
    cluster = pg_cluster.PostgresCluster(where)
    yield cluster
    cluster.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request, tmp_path):
    """Where a run store is, once per kind: a SQLite file, or a fresh database of the cluster."""
    from agentrt.runtime.store_location import PostgresLocation

    if request.param == "sqlite":
        return tmp_path / "runs.db"
    return PostgresLocation(request.getfixturevalue("postgres_cluster").new_database())


@pytest.fixture
def open_run_store(store_location):
    """open_run_store() -> the run store at store_location, opened (again), closed after the test."""
    from agentrt.runtime.store import open_store

    opened = []

    def open_() -> object:
        opened.append(open_store(store_location))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


@pytest.fixture(scope="session")
def smollm2_source():
    """The embedded SmolLM2-135M-Instruct, converted into the user's cache on first use (~5 s, once)."""
    from agentrt.engine.loading.registry import resolve_model

    return resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(variant) -> Path of a complete tiny random HF model (tests/engine/tiny_models.py),
    built once per session per variant. Treat the directory as read-only."""
    made: dict[str, Path] = {}

    def make(variant: str) -> Path:
        if variant not in made:
            made[variant] = _tiny_models().save_tiny_model(tmp_path_factory.mktemp(f"tiny-{variant}"), variant)
        return made[variant]

    return make

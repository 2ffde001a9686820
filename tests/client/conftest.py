"""tests/client/served.py as module `served` (the suite runs with --import-mode=importlib)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

if "served" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("served", Path(__file__).parent / "served.py")
    sys.modules["served"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["served"])

KEY = "client-test-key"


@pytest.fixture
def served(tmp_path):
    app = sys.modules["served"].ServedApp(tmp_path)
    yield app
    app.close()


@pytest.fixture
def served_with_key(tmp_path):
    app = sys.modules["served"].ServedApp(tmp_path, api_keys=(KEY,))
    yield app
    app.close()

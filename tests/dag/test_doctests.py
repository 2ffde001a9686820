"""The DSL's docstring examples run as written (doctest), so the documentation cannot drift."""
import doctest
import importlib
import pkgutil

import pytest

import agentrt.dag

MODULES = sorted(m.name for m in pkgutil.iter_modules(agentrt.dag.__path__, "agentrt.dag."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), verbose=False, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest lines of {name} failed"


def test_the_run_and_render_examples_are_among_them():
    attempted = {name: doctest.testmod(importlib.import_module(name), report=False).attempted
                 for name in ("agentrt.dag.run", "agentrt.dag.render", "agentrt.dag.compiled")}
    assert all(n >= 3 for n in attempted.values()), attempted

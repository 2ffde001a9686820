"""The tools a Python module defines: its `TOOLS` list if it has one, else every module-level Tool
with a Python function (what `@tool` makes). `agentrt worker` serves them over MQTT, `agentrt
serve --tools` in process."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from agentrt.tools.errors import ToolDefinitionError
from agentrt.tools.tool import Tool, tool as make_tool


def load_tools(module_ref: str) -> list[Tool]:
    """Tools of a Python file (path/to/tools.py) or an importable module (package.module)."""
    path = Path(module_ref)
    if module_ref.endswith(".py") or path.exists():
        if not path.is_file():
            raise ToolDefinitionError(f"tool module {module_ref!r} does not exist")
        name = f"agentrt_tools_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ToolDefinitionError(f"cannot import {module_ref!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # so pydantic/dataclasses can resolve the module's own types
        sys.path.insert(0, str(path.resolve().parent))  # its sibling imports work as when run directly
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_ref)
        except ImportError as e:
            raise ToolDefinitionError(f"cannot import tool module {module_ref!r}: {e}") from e
    declared = getattr(module, "TOOLS", None)
    if declared is not None:
        tools = [t if isinstance(t, Tool) else make_tool(t) for t in declared]
    else:
        tools = [v for v in vars(module).values() if isinstance(v, Tool) and v.fn is not None]
    unique = {t.name: t for t in tools}
    if not unique:
        raise ToolDefinitionError(f"no tools found in {module_ref!r} (define them with @tool, or list them in TOOLS)")
    return list(unique.values())

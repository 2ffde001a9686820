"""Loading an example file for `agentrt run` and turning `--input key=value` into typed inputs.

An example file defines a module-level `program` (a Program or CompiledProgram), `tools` (the
Tool objects its program names, if any) and `DEFAULT_INPUTS` (a dict), so that running the file
with no --input works.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from agentrt.dag import CompiledProgram, Program
from agentrt.errors import AgentRTError, RunConfigError
from agentrt.jsonutil import parse_json


@dataclass(frozen=True)
class Example:
    path: Path
    program: CompiledProgram
    tools: tuple[Any, ...] = ()
    default_inputs: Mapping[str, Any] = field(default_factory=dict)
    description: str = ""  # the file's docstring

    @property
    def name(self) -> str:
        return self.program.name


def load_example(path: str | Path) -> Example:
    path = Path(path)
    if not path.is_file():
        raise RunConfigError(f"{path}: no such file (give the path of a Python file defining `program`)")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
    name = f"agentrt_example_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RunConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pydantic models in the file look their module up
    try:
        spec.loader.exec_module(module)
    except AgentRTError:  # the DSL's own errors name the node at fault
        sys.modules.pop(name, None)
        raise
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise RunConfigError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the user's file failed: say where in it, one line
        sys.modules.pop(name, None)
        own = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = f":{own[-1].lineno}" if own else ""
        raise RunConfigError(f"{path}{where}: importing it raised {type(e).__name__}: {e}") from None
    program = getattr(module, "program", None)
    if isinstance(program, Program):
        program = program.compile()
    if not isinstance(program, CompiledProgram):
        raise RunConfigError(f"{path}: defines no module-level `program` (a Program or CompiledProgram), "
                             f"found {type(program).__name__}")
    tools = tuple(getattr(module, "tools", ()) or ())
    defaults = getattr(module, "DEFAULT_INPUTS", {}) or {}
    if not isinstance(defaults, Mapping):
        raise RunConfigError(f"{path}: DEFAULT_INPUTS must be a dict, got {type(defaults).__name__}")
    return Example(path, program, tools, dict(defaults), (module.__doc__ or "").strip())


_TRUE, _FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}


def coerce_input(name: str, type_name: str, raw: str) -> Any:
    """One --input value as the program's declared input type (JSON type names)."""
    try:
        if type_name == "string":
            return raw
        if type_name == "integer":
            return int(raw)
        if type_name == "number":
            return float(raw)
        if type_name == "boolean":
            low = raw.strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError("expected true or false")
        value = parse_json(raw)
        want = list if type_name == "array" else dict
        if not isinstance(value, want):
            raise ValueError(f"expected a JSON {type_name}")
        return value
    except ValueError as e:  # JSONDecodeError and JsonDepthError too
        raise RunConfigError(f"--input {name}={raw!r}: not a valid {type_name} ({e})") from None


def resolve_inputs(example: Example, pairs: Sequence[str]) -> dict[str, Any]:
    """DEFAULT_INPUTS overridden by `key=value` pairs, typed by the program's inputs."""
    declared = example.program.inputs
    inputs = dict(example.default_inputs)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep:
            raise RunConfigError(f"--input {pair!r}: write key=value")
        if key not in declared:
            raise RunConfigError(f"--input {key}: not an input of program '{example.name}' "
                                 f"(inputs: {', '.join(declared) or 'none'})")
        inputs[key] = coerce_input(key, declared[key], raw)
    missing = [k for k in declared if k not in inputs]
    if missing:
        raise RunConfigError(f"program '{example.name}' needs input(s) {', '.join(missing)}: "
                             f"pass --input {missing[0]}=... (or set DEFAULT_INPUTS in {example.path.name})")
    return inputs

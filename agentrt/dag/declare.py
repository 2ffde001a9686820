"""Checks of one declaration, made as it is declared (Scope's methods call them): template and JSON
syntax, branch case keys and labels, an agent loop's tool_choice, sampling setting names. Each
raises ProgramValidationError naming the node and the file:line of the author's declaration."""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Mapping

from agentrt.dag.refs import Ref, Template, placeholders
from agentrt.dag.specs import LOOP_CHOICES
from agentrt.dag.tooldefs import ToolDef
from agentrt.errors import ProgramValidationError
from agentrt.retry import RetryPolicy, unsafe_retry

_LABEL = re.compile(r"^[A-Za-z0-9_-]+$")

_DAG_DIR = os.path.dirname(os.path.abspath(__file__))


def declaration_site() -> str:
    """file:line of the innermost caller outside agentrt.dag: the author's declaration."""
    frame = sys._getframe(1)
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _DAG_DIR:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""


def _fail(node: str, message: str) -> ProgramValidationError:
    return ProgramValidationError([(node, message)], sites={node: declaration_site()})


def _check_template(node: str, where: str, text: Any) -> Template:
    if not isinstance(text, str):
        raise _fail(node, f"{where} must be a str template, got {type(text).__name__}")
    try:
        placeholders(text)
    except ValueError as e:
        raise _fail(node, f"{where}: {e}") from None
    return Template(text)


def _check_json_value(node: str, where: str, value: Any) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise _fail(node, f"{where} must be JSON data (or a Ref / Template in tool args): {e}") from None


def _case_pairs(node: str, cases: Any) -> list[tuple[Any, Any]]:
    """The (key, body) pairs of a branch, in the order they are tried."""
    if isinstance(cases, Mapping):
        pairs = list(cases.items())
    elif isinstance(cases, (list, tuple)) and all(isinstance(c, (list, tuple)) and len(c) == 2 for c in cases):
        pairs = [(key, body) for key, body in cases]
    else:
        pairs = []
    if not pairs:
        raise _fail(node, "cases must be a non-empty dict {key: body} or list [(key or predicate, body), ...]")
    return pairs


def _case_label(node: str, key: Any, position: int) -> str:
    """The id-safe name of a case, in its nodes' ids: the key; for a predicate its function name,
    or case<position> when it has none that fits (a lambda)."""
    if callable(key):
        name = getattr(key, "__name__", "")
        return name if _LABEL.match(name) else f"case{position}"
    if isinstance(key, bool) or key is None:
        return json.dumps(key)
    if isinstance(key, int) or (isinstance(key, str) and _LABEL.match(key)):
        return str(key)
    raise _fail(node, f"case key {key!r} must be a bool, an int, None, a str of letters, digits, '_', '-', "
                      "or a predicate (a function of the value answering True or False)")


def _check_case_labels(node: str, entries: list[tuple[Any, str, Any, bool]]) -> None:
    """Labels name the cases' nodes, so they must differ; an equality key given twice is an
    error of its own, since the second case could never be taken."""
    first_key: dict[str, Any] = {}
    for key, label, _, is_default in entries:
        if label not in first_key:
            first_key[label] = key
            continue
        earlier = first_key[label]
        if not is_default and not callable(key) and not callable(earlier) \
                and isinstance(key, bool) == isinstance(earlier, bool) and key == earlier:
            raise _fail(node, f"case {label} is given twice: the second can never match (the first match wins)")
        raise _fail(node, f"two cases are labelled '{label}' (their nodes are named '{node}?{label}.<id>'); "
                          "rename one (a predicate is labelled by its function name, and a key 'default' "
                          "clashes with default=)")


def _check_loop_choice(node: str, choice: Any, tools: tuple[str, ...], max_steps: int, on_max_steps: str) -> None:
    """A tool_choice is a keyword or one of the loop's tools; one that makes step 1 call needs a
    step after it: with max_steps=1, step 1 is the last step, which under on_max_steps="answer"
    must answer in text, and under "error" fails the run when it calls."""
    # "none" would make a named tool's step answer in text (ToolCall reads it as the keyword)
    if not isinstance(choice, str) or choice == "none" or (choice not in LOOP_CHOICES and choice not in tools):
        raise _fail(node, f"tool_choice must be 'auto', 'required', 'required_first' or one of the loop's tools "
                          f"({', '.join(tools)}), got {choice!r}")
    if choice != "auto" and max_steps < 2:
        last = "must answer in text" if on_max_steps == "answer" else "fails the run if it calls a tool"
        raise _fail(node, f"tool_choice={choice!r} makes step 1 call a tool, but with max_steps=1 step 1 is the "
                          f"last step, which {last} (on_max_steps={on_max_steps!r}): use max_steps >= 2")


def _check_retry(node: str, retry: Any, tool: ToolDef | None) -> None:
    """A node's retry policy, laid over its tool's own: retrying a tool not declared idempotent
    must name the failures to retry (retry_on). A tool not declared (yet) is checked for that by
    compile(), which reports it unknown."""
    if retry is None:
        return
    if not isinstance(retry, RetryPolicy):
        raise _fail(node, f"retry must be a RetryPolicy(max_attempts=..., backoff_s=..., retry_on=(...)), "
                          f"got {retry!r}")
    if tool is None:
        return
    policy = retry.over(tool.retry or RetryPolicy())
    problem = unsafe_retry(tool.name, tool.idempotent, policy, f"retry=RetryPolicy(max_attempts={policy.max_attempts}) "
                                                               f"on tool '{tool.name}'")
    if problem:
        raise _fail(node, problem)


def _strip_refs(value: Any) -> Any:
    if isinstance(value, (Ref, Template)):
        return None
    if isinstance(value, Mapping):
        return {k: _strip_refs(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strip_refs(v) for v in value]
    return value


SAMPLING_FIELDS = ("top_p", "top_k", "seed", "stop", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "min_tokens", "logit_bias")


def _check_extra_sampling(node: str, sampling: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """The names are checked here; the engine checks the values when the call is made."""
    if sampling is None:
        return ()
    if not isinstance(sampling, Mapping):
        raise _fail(node, f"sampling must be a dict, got {type(sampling).__name__}")
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        raise _fail(node, f"sampling: unknown setting(s) {', '.join(map(str, unknown))} "
                          f"(known: {', '.join(SAMPLING_FIELDS)})")
    frozen = {k: tuple(sorted(v.items())) if isinstance(v, Mapping) else tuple(v) if isinstance(v, list) else v
              for k, v in sampling.items()}  # hashable, like the rest of a spec
    return tuple(sorted(frozen.items()))

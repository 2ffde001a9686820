"""A node's retry policy is checked where it is declared: retrying a tool not declared
idempotent must name the failures to retry."""
from __future__ import annotations

import pytest

from agentrt.dag import Program
from agentrt.errors import ProgramValidationError
from agentrt.retry import RetryPolicy
from agentrt.tools import tool


@tool
def refund(order: str) -> str:
    """Refund an order (a write: not idempotent)."""
    return order


@tool(idempotent=True)
def status(order: str) -> str:
    """Read an order's status."""
    return order


@tool(retries=2, retry_on=ConnectionRefusedError)
def charge(order: str) -> str:
    """Charge an order, retried when the gateway refuses the connection."""
    return order


def test_retrying_a_non_idempotent_tool_without_retry_on_names_the_node_tool_and_fix():
    p = Program("shop", inputs={"order": str}, tools=[refund])
    with pytest.raises(ProgramValidationError) as e:
        p.tool("give_back", "refund", args={"order": p.input("order")}, retry=RetryPolicy(max_attempts=3))
    message = str(e.value)
    assert message.startswith("give_back: retry=RetryPolicy(max_attempts=3) on tool 'refund', but 'refund' is not "
                              "declared idempotent")
    assert "retry_on=(" in message and "test_retry_declaration.py" in message  # where it was declared


def test_named_failures_an_idempotent_tool_or_the_tools_own_retry_on_make_it_valid():
    p = Program("shop", inputs={"order": str}, tools=[refund, status, charge])
    order = p.input("order")
    a = p.tool("a", "refund", args={"order": order},
               retry=RetryPolicy(max_attempts=3, retry_on=(ConnectionRefusedError,)))
    b = p.tool("b", "status", args={"order": order}, retry=RetryPolicy(max_attempts=5, backoff_s=0.5))
    c = p.tool("c", "charge", args={"order": order}, retry=RetryPolicy(max_attempts=5))  # keeps charge's retry_on
    p.output({"a": a, "b": b, "c": c})
    compiled = p.compile()
    assert compiled.graph.nodes["b"]["spec"].retry == RetryPolicy(max_attempts=5, backoff_s=0.5)


def test_a_retry_that_is_not_a_policy_is_refused():
    p = Program("shop", inputs={"order": str}, tools=[status])
    with pytest.raises(ProgramValidationError, match="s: retry must be a RetryPolicy"):
        p.tool("s", "status", args={"order": p.input("order")}, retry=3)
    with pytest.raises(ValueError, match="max_attempts must be an int >= 1"):
        RetryPolicy(max_attempts=0)


def test_an_openai_dict_tool_may_say_it_is_idempotent():
    spec = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}, "idempotent": True}
    p = Program("dicts", inputs={}, tools=[spec])
    p.output(p.tool("x", "lookup", retry=RetryPolicy(max_attempts=2)))
    p.compile()

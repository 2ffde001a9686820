"""Retry policies of tools: a tool not declared idempotent is retried only on the failures it
names; a call's policy laid over the tool's; back-off; retry_on across a process boundary."""
from __future__ import annotations

import pytest

from agentrt.retry import RetryPolicy
from agentrt.tools import Tool, ToolDefinitionError, ToolRegistry, tool
from agentrt.tools.errors import ToolRaisedError, error_from_dict


def test_retrying_a_tool_not_declared_idempotent_needs_retry_on():
    with pytest.raises(ToolDefinitionError) as e:
        @tool(retries=2)
        def refund(order: str) -> str:
            """Refund an order."""
            return order
    message = str(e.value)
    assert message.startswith("tool 'refund': retries=2, but 'refund' is not declared idempotent")
    assert "retry_on=(" in message and "idempotent=True" in message
    with pytest.raises(ToolDefinitionError, match="tool 'refund': RetryPolicy: retry_on must be exception types"):
        Tool("refund", "Refund.", {"type": "object"}, retries=1, retry_on=(42,))
    assert Tool("refund", "Refund.", {"type": "object"}, retries=1, retry_on=ConnectionRefusedError).retry_on == \
        (ConnectionRefusedError,)


async def test_only_the_named_failures_are_retried_and_the_policy_says_when():
    raised = [ConnectionRefusedError("down"), ConnectionRefusedError("down"), ConnectionRefusedError("down"),
              ValueError("declined")]

    @tool(retries=5, retry_on=ConnectionError)
    def pay() -> None:
        """Pay."""
        raise raised.pop(0) if raised else ConnectionRefusedError("still down")

    result = await ToolRegistry([pay]).call(
        "pay", retry=RetryPolicy(backoff_s=0.001, backoff_factor=3, max_backoff_s=0.005))
    assert [a.backoff_s for a in result.attempts] == [0.001, 0.003, 0.005, None]
    assert result.attempts[-1].not_retried == "retry_on (ConnectionError) does not cover ToolRaisedError (raised ValueError)"
    once = await ToolRegistry([pay]).call("pay", retry=RetryPolicy(max_attempts=1))
    assert once.attempts[0].not_retried == "no attempts left (max_attempts=1)"


async def test_a_predicate_decides_from_the_exception():
    seen = []

    @tool(retries=3, backoff_s=0, retry_on=lambda e: "try again" in str(e))
    def flaky() -> None:
        """Fails."""
        seen.append(1)
        raise RuntimeError("try again" if len(seen) < 2 else "gave up")

    result = await ToolRegistry([flaky]).call("flaky")
    assert len(result.attempts) == 2 and "<lambda>" in result.attempts[-1].not_retried


def test_retry_on_crosses_a_process_boundary_by_name():
    """A worker's declaration names the exception types; its errors name what the tool raised."""
    @tool(retries=2, retry_on=ConnectionError)
    def pay() -> None:
        """Pay."""

    decl = pay.declaration()
    assert decl["retry_on"] == ["builtins.ConnectionError"] and decl["retries"] == 2
    remote = Tool.from_declaration(decl, executor="mqtt")
    try:
        raise ToolRaisedError("pay", "tool 'pay' raised ConnectionRefusedError") from ConnectionRefusedError()
    except ToolRaisedError as e:
        sent = e.to_dict()
    assert "builtins.ConnectionError" in sent["raised"]
    assert remote.retry_policy.allows(error_from_dict("pay", sent))
    assert not remote.retry_policy.allows(error_from_dict("pay", {**sent, "raised": ["builtins.ValueError"]}))

    @tool(retries=2, retry_on=lambda e: True)
    def pay_again() -> None:
        """Pay."""

    # a predicate runs on the worker (failures it rejects come back not retryable)
    assert pay_again.declaration()["retry_on"] == ["agentrt.tools.errors.ToolRaisedError"]


def test_the_policy_docstring_examples_hold():
    import doctest

    import agentrt.retry

    result = doctest.testmod(agentrt.retry, report=False)
    assert result.attempted >= 3 and result.failed == 0

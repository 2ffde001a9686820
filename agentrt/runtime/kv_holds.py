"""KV holds across tool stalls: when a program's LLM call is followed by tools, its KV is pinned
for about as long as they are expected to take (KVHoldPolicy's time-to-live from their observed
latency), so the next call that continues it reuses the blocks instead of prefilling them again;
when that call runs, the hold is settled as a hit, a miss (evicted meanwhile) or unused."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import networkx as nx

from agentrt.dag.outputs import ToolCall
from agentrt.dag.specs import LLMSpec
from agentrt.runtime.node_state import NodeState

if TYPE_CHECKING:
    from agentrt.runtime.node_events import NodeEnv
    from agentrt.runtime.run_state import RunState

HOLD_COUNTERS = {"hit": "kv_hold_hits", "miss": "kv_hold_misses", "unused": "kv_hold_unused"}


def tool_stall_s(env: NodeEnv, rs: RunState, node: str, spec: LLMSpec, value: Any) -> float | None:
    """Expected seconds this program waits on tools after `node` before its next LLM call
    (consecutive tools add up, parallel ones take the max), or None when no tool follows: a
    tool-call node that answered in text, or a node with no tool after it."""
    hold = env.kv_hold
    if isinstance(spec.output, ToolCall):  # its calls run at once: the slowest one stalls the program
        names = [c["name"] for c in value.get("calls", [value]) if c.get("name") is not None] \
            if isinstance(value, dict) else []
        return max((hold.estimate(n) for n in names), default=None)
    graph, memo = rs.run.graph, {}

    def wait(n: str) -> float:  # tool time on the longest path from n's end to an LLM node
        if n not in memo:
            memo[n] = 0.0
            for s in graph.successors(n):
                attrs = graph.nodes[s]
                if attrs["kind"] == "tool":
                    memo[n] = max(memo[n], hold.estimate(attrs["spec"].tool) + wait(s))
                elif attrs["kind"] != "llm":
                    memo[n] = max(memo[n], wait(s))
        return memo[n]

    tools_follow = any(graph.nodes[s]["kind"] == "tool" for s in graph.successors(node))
    return wait(node) if tools_follow else None


def hold_kv(env: NodeEnv, rs: RunState, ns: NodeState, spec: LLMSpec, value: Any, response: Any) -> None:
    """Pin this call's KV while the program waits on the tool(s) that follow it, with a
    time-to-live from their observed latency (see KVHoldPolicy)."""
    if env.kv_hold is None:
        return
    stall = tool_stall_s(env, rs, ns.node, spec, value)
    if stall is None:
        return
    ttl = env.kv_hold.ttl(stall)

    def pinned(pin: Any) -> None:
        rs.stats.kv_held_blocks += pin.blocks or 0
        ns.attributes["agentrt.kv.hold_blocks"] = pin.blocks

    pin = env.backend.pin(response, ttl, pinned)
    if pin is None:
        return
    rs.stats.kv_holds += 1
    rs.holds.append((ns.node, pin))
    ns.attributes["agentrt.kv.hold_ttl_s"] = round(ttl, 4)


def settle_holds(env: NodeEnv, rs: RunState, ns: NodeState, response: Any) -> None:
    """The outcome of the program's KV holds this call continues (it descends from the held
    node): hit when the engine reused every block the call shares with the held tokens, miss when
    it reused fewer (evicted meanwhile), unused when the call shares no full block with them."""
    graph = rs.run.graph
    for held in [h for h in rs.holds if h[0] in graph and nx.has_path(graph, h[0], ns.node)]:
        rs.holds.remove(held)
        reusable, reused = env.backend.reuse(held[1], response)
        outcome = "unused" if reusable == 0 else "hit" if reused >= reusable else "miss"
        counter = HOLD_COUNTERS[outcome]
        setattr(rs.stats, counter, getattr(rs.stats, counter) + 1)
        ns.attributes.update({"agentrt.kv.hold_outcome": outcome, "agentrt.kv.hold_from": held[0],
                              "agentrt.kv.hold_reusable_tokens": reusable})

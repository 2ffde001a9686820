"""Prefill-ahead: while a program waits on a tool, the engine computes the part of the next call's
prompt that is already known.

An LLM node that waits on a running tool often has most of its prompt determined: the system
prompt, the tool declarations, the conversation so far, the template text before the tool's
result and the results of the tools that already returned. `start_prefill_ahead` renders that part (dag.render.render_prompt_prefix: the messages up
to the first missing value, cut there) and hands it to the backend's `prefill_ahead`, which
computes its KV only in engine steps that have nothing else to run, caches it and pins it for the
tool's expected latency (KVHoldPolicy). When the node starts, its ahead request is cancelled and
the call adopts the cached blocks: it prefills only the rest. When a tool returns and the node
still waits on another, more of its prompt is known: the longer start replaces the ahead request
(what the first computed stays cached, so the second feeds only what is new). Output is
unchanged: the prefix cache only ever supplies KV of identical token ids.

The node's timeline shows the ahead steps as phase `prefill_ahead` (inside its wait); its span
attribute `agentrt.prefill_ahead.tokens` and the program's `prefill_ahead_tokens` count the tokens
computed ahead. Backends without `prefill_ahead` (and engines without a prefix cache) skip it.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrt.dag.render import render_prompt_prefix
from agentrt.runtime.backend import LLMRequest, LLMStepEvent, NodeIdentity
from agentrt.runtime.node_events import NodePhase

if TYPE_CHECKING:
    from agentrt.runtime.node_events import NodeEnv
    from agentrt.runtime.run_state import RunState

log = logging.getLogger(__name__)

# where the first unknown value starts in the messages a prefill-ahead renders; the engine cuts the
# rendered prompt text at its first occurrence
MARKER = "\x00agentrt:prefill-ahead\x00"
DEFAULT_TTL_S = 30.0  # a pin's time-to-live when the runtime holds no KV otherwise (kv_hold off)


@dataclass(frozen=True)
class AheadRequest:
    """A node's prefill-ahead in flight and how much of its prompt it covers (characters of the
    rendered messages before the first unknown value)."""

    task: asyncio.Task
    known_chars: int


def known_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the rendered messages before the marker: grows as more of the prompt is known."""
    text = "".join(str(m.get("content") or "") for m in messages)
    return text.find(MARKER) if MARKER in text else len(text)


def waits_on_running_tool(rs: RunState, node: str) -> list[str]:
    """The running tool nodes this pending LLM node waits on directly (empty: not a candidate)."""
    ns = rs.nodes.get(node)
    if ns is None or ns.kind != "llm" or ns.status != "pending":
        return []
    tools = []
    for pred in rs.run.graph.predecessors(node):
        p = rs.nodes.get(pred)
        if p is not None and p.kind == "tool" and p.status == "running":
            tools.append(pred)
    return tools


def start_prefill_ahead(env: NodeEnv, rs: RunState) -> None:
    """Start a prefill-ahead for each pending LLM node that waits on a running tool and has a
    known prompt start; replace a node's earlier one when more of its prompt is known now."""
    backend_ahead = getattr(env.backend, "prefill_ahead", None)
    if not env.prefill_ahead or backend_ahead is None or rs.run.status != "running":
        return
    for node in list(rs.nodes):
        tools = waits_on_running_tool(rs, node)
        if not tools:
            continue
        spec = rs.run.spec(node)
        try:
            messages = render_prompt_prefix(spec, rs.run.values, MARKER, rs.run.spec, rs.sent)
            response_format = spec.output.to_response_format()
        except (ValueError, TypeError):  # the call itself reports what is wrong with its prompt
            messages = None
        if messages is None:
            continue
        current, known = rs.ahead.get(node), known_chars(messages)
        if current is not None:
            if known <= current.known_chars:
                continue
            current.task.cancel()  # its blocks stay cached: the longer request starts from them
        stall = max(_estimate(env, rs.run.spec(t).tool) for t in tools)
        ttl = env.kv_hold.ttl(stall) if env.kv_hold is not None else DEFAULT_TTL_S
        request = LLMRequest(tuple(messages), response_format, spec.max_tokens, spec.temperature,
                             NodeIdentity(rs.run_id, rs.program.name, node), float("inf"), {"prefill_ahead": True},
                             sampling=dict(spec.sampling))
        task = asyncio.get_running_loop().create_task(_run(env, rs, node, request, ttl),
                                                      name=f"agentrt:{rs.run_id}:{node}:prefill-ahead")
        rs.ahead[node] = AheadRequest(task, known)


def cancel_prefill_ahead(rs: RunState, node: str | None = None) -> None:
    """Cancel the node's prefill-ahead (all of the run's when node is None): the node starts, or
    the run ends. Its computed blocks stay in the prefix cache."""
    for n in [node] if node is not None else list(rs.ahead):
        ahead = rs.ahead.get(n)
        if ahead is not None and not ahead.task.done():
            ahead.task.cancel()


def _estimate(env: NodeEnv, tool: str) -> float:
    return env.kv_hold.estimate(tool) if env.kv_hold is not None else DEFAULT_TTL_S


async def _run(env: NodeEnv, rs: RunState, node: str, request: LLMRequest, ttl_s: float) -> None:
    ns = rs.nodes[node]
    task = asyncio.current_task()

    def on_step(ev: LLMStepEvent) -> None:
        # counted as each step is heard: a step can be heard after its request was cancelled (replaced
        # by a longer one, or the node started), and its tokens were computed ahead all the same
        if ev.preempted:
            return
        ns.attributes["agentrt.prefill_ahead.tokens"] = ns.attributes.get("agentrt.prefill_ahead.tokens", 0) + ev.num_new
        rs.stats.prefill_ahead_tokens += ev.num_new
        current = rs.ahead.get(node)
        if (ns.status == "pending" and ns.log.phase != "prefill_ahead" and current is not None
                and current.task is task and not task.done()):
            ns.log.enter("prefill_ahead", env.clock.at(ev.start))
            env.events.emit(NodePhase(rs.run_id, node, "prefill_ahead"))

    try:
        result = await env.backend.prefill_ahead(request, MARKER, ttl_s, on_step=on_step)
        outcome = "cached" if result is None else result.finish_reason
    except asyncio.CancelledError:  # the node started (or the run ended) first: what was computed is cached
        outcome = "interrupted"
    except Exception:  # noqa: BLE001 - an optimisation: the call itself runs and reports as usual
        log.warning("prefill-ahead of %s failed", node, exc_info=True)
        outcome = "error"
    finally:
        current = rs.ahead.get(node)
        replaced = current is not None and current.task is not asyncio.current_task()
        if ns.status == "pending" and ns.log.phase == "prefill_ahead" and not replaced:
            ns.log.enter("waiting", env.clock.now())
            env.events.emit(NodePhase(rs.run_id, node, "waiting"))
        ns.attributes.setdefault("agentrt.prefill_ahead.tokens", 0)
        ns.attributes["agentrt.prefill_ahead.outcome"] = outcome

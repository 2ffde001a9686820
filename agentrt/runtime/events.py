"""Live events of program runs, for whoever watches them as they happen (the server's SSE
streams). A subscriber gets each RunEvent on the runtime's event loop, in the order things
happened; `Runtime.subscribe_events(fn)` returns the unsubscribe function.

    run_started    program, inputs, graph (the run's graph as JSON: dag.export.to_json)
    graph          nodes, edges (added, as in the graph JSON), removed (node ids, their edges with them),
                   states (node -> new state, of nodes other than LLM, tool and wait_for ones): the graph changed
                   (a fan-out or loop step expanded, a branch case not taken left, a branch decided)
    node_started   node, kind (llm | tool | wait_for), tool (tool nodes), early (a tool started on streamed members),
                   replayed (a resumed run's node whose outcome comes from the run store)
    node_phase     node, phase: queued | prefill | decode | preempted (LLM) | tool_running (tool) |
                   input_wait (wait_for) | replayed (a resumed run's node taken from the store)
    token          node, text: output text of an LLM node as the engine generates it
    step           node, step, start, duration_s, batch_size, num_new, k, accepted: an engine step
                   the node took part in
    node_retried   node, attempt, error_kind, error, duration_s, backoff_s: a tool attempt failed
                   and is tried again after backoff_s
    tool_progress  node, progress, total, message: a running tool reported progress (MCP tools)
    input_wanted   node, schema, prompt: a wait_for node waits for a value (Runtime.provide_input)
    input_given    node, by (who answered, if they said), via (http | terminal | stdin | --answer |
                   python), at (unix seconds): the value came; the run goes on
    node_finished  node, kind, status (ok | error | cancelled), value (ok) or error, replayed
    run_finished   status (done | failed | cancelled), output, error, failed_node
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class RunEvent:
    """time: on the runtime's trace clock (seconds since the trace began)."""

    run_id: str
    type: str
    time: float
    data: Mapping[str, Any] = field(default_factory=dict)


RunEventListener = Callable[[RunEvent], None]

"""Runtime behaviour on a scripted backend: ordering, concurrency, fan-out/in, loops, branches,
tool timeouts and retries, failure propagation and cancellation."""
from __future__ import annotations

import asyncio
import threading

import pytest

from agentrt.dag import JsonSchema, Program, Template, ToolCall
from agentrt.errors import ProgramRunError, RequestError, RunConfigError
from agentrt.runtime import LLMResponse, Runtime, Usage
from agentrt.runtime.progress import progress
from agentrt.tools import tool


def node_spans(rt: Runtime, run_id: str | None = None) -> dict[str, dict]:
    return {r["attributes"]["agentrt.node"]: r for r in rt.trace.records()
            if r["type"] == "span" and r["parent_id"] is None and (run_id is None or r["run_id"] == run_id)}


def phase_spans(rt: Runtime, node: str) -> list[dict]:
    parent = node_spans(rt)[node]["span_id"]
    return sorted((r for r in rt.trace.records() if r["type"] == "span" and r["parent_id"] == parent),
                  key=lambda r: r["start"])


def phases_of(rt: Runtime, node: str) -> list[str]:
    return [p["name"] for p in phase_spans(rt, node)]


def ready_time(rt: Runtime, node: str) -> float:
    spans = phase_spans(rt, node)
    return next(p["start"] for p in spans if p["name"] != "waiting")


@tool
def upper(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


async def test_dependencies_run_in_order_and_values_flow(scripted):
    p = Program("chain", inputs={"topic": str}, tools=[upper])
    a = p.llm("a", prompt="Name a {topic}")
    b = p.tool("b", "upper", args={"text": a})
    p.output(p.llm("c", prompt="Describe {b}"))
    backend = scripted({"a": "blue whale", "c": "it is big"})
    rt = Runtime(backend, tools=[upper])
    result = await rt.run(p, {"topic": "animal"})
    assert result.status == "done" and result.output == "it is big"
    assert backend.requests[1].messages[-1]["content"] == "Describe BLUE WHALE"
    spans = node_spans(rt)
    assert ready_time(rt, "b") >= spans["a"]["end"]
    assert ready_time(rt, "c") >= spans["b"]["end"]
    assert spans["c"]["attributes"]["agentrt.waited_on"] == "b"


async def test_independent_llm_calls_share_engine_steps(scripted):
    p = Program("pair", inputs={"x": str})
    p.output({"a": p.llm("a", prompt="one {x}"), "b": p.llm("b", prompt="two {x}")})
    backend = scripted({"a": "w1 w2 w3 w4", "b": "v1 v2 v3 v4"})
    rt = Runtime(backend)
    result = await rt.run(p, {"x": "go"})
    assert result.output == {"a": "w1 w2 w3 w4", "b": "v1 v2 v3 v4"}
    steps = [r for r in rt.trace.records() if r["type"] == "engine_step"]
    assert max(s["batch_size"] for s in steps) == 2


async def test_async_tools_run_concurrently(scripted):
    # Each tool waits for the other to have started: run one after the other, they would hang.
    started = {"left": asyncio.Event(), "right": asyncio.Event()}

    @tool
    async def meet(side: str) -> str:
        """Wait for the other side."""
        started[side].set()
        await started["right" if side == "left" else "left"].wait()
        return side

    p = Program("meet", inputs={}, tools=[meet])
    p.output({"l": p.tool("l", "meet", args={"side": "left"}), "r": p.tool("r", "meet", args={"side": "right"})})
    rt = Runtime(scripted(), tools=[meet])
    async with asyncio.timeout(10):
        result = await rt.run(p, {})
    assert result.output == {"l": "left", "r": "right"}


async def test_sync_tools_run_off_the_event_loop(scripted):
    # The sync tool blocks its thread until the async tool (on the loop) releases it.
    gate = threading.Event()

    @tool
    def blocking() -> str:
        """Block until released."""
        if not gate.wait(timeout=10):
            raise TimeoutError("never released")
        return "released"

    @tool
    async def release() -> str:
        """Release the blocking tool."""
        await asyncio.sleep(0.01)
        gate.set()
        return "done"

    p = Program("threads", inputs={}, tools=[blocking, release])
    p.output({"b": p.tool("b", "blocking"), "r": p.tool("r", "release")})
    rt = Runtime(scripted(), tools=[blocking, release])
    async with asyncio.timeout(10):
        result = await rt.run(p, {})
    assert result.output == {"b": "released", "r": "done"}


async def test_many_programs_run_concurrently_on_one_engine(scripted):
    p = Program("solo", inputs={"n": int})
    p.output(p.llm("answer", prompt="Count to {n}"))
    backend = scripted(lambda req: f"reply to {req.messages[-1]['content']} " + "x " * 6)
    rt = Runtime(backend)
    handles = [rt.submit(p, {"n": i}) for i in range(4)]
    results = await asyncio.gather(*handles)
    assert [r.output.split()[4] for r in results] == ["0", "1", "2", "3"]
    assert len({r.run_id for r in results}) == 4
    steps = [r for r in rt.trace.records() if r["type"] == "engine_step"]
    assert max(s["batch_size"] for s in steps) == 4
    assert {r["run_id"] for r in rt.trace.records() if r["type"] == "program"} == {r.run_id for r in results}


@tool
def search(query: str) -> list[str]:
    """Find documents."""
    return [f"doc about {query}"]


@tool(name="search")
async def search_async(query: str) -> list[str]:
    """Find documents (on the event loop)."""
    return [f"doc about {query}"]


async def test_fan_out_and_fan_in(scripted, research_program):
    backend = scripted({"split": ["q1", "q2", "q3"], "answers*summary": lambda r: r.messages[-1]["content"],
                        "synthesis": "final"})
    rt = Runtime(backend, tools=[search_async])
    result = await rt.run(research_program(search_async), {"question": "why"})
    assert result.output == "final"
    synthesis_prompt = backend.requests[-1].messages[-1]["content"]
    assert synthesis_prompt == 'Answer from ["Summarise [\\"doc about q1\\"] for q1", "Summarise [\\"doc about q2\\"] ' \
                               'for q2", "Summarise [\\"doc about q3\\"] for q3"]'
    spans = node_spans(rt)
    assert {n for n in spans if n.startswith("answers[")} == {f"answers[{i}].{k}" for i in range(3)
                                                               for k in ("search", "summary")}
    # the three summaries were decoded together (their searches ended in the same loop turn)
    summary_steps = [{e["attributes"]["agentrt.step"] for p in phase_spans(rt, f"answers[{i}].summary")
                      for e in p["events"]} for i in range(3)]
    assert summary_steps[0] & summary_steps[1] & summary_steps[2]
    assert ready_time(rt, "synthesis") >= max(spans[f"answers[{i}].summary"]["end"] for i in range(3))


def loop_program(max_steps, on_max_steps):
    p = Program("looper", inputs={"q": str}, tools=[upper])
    p.output(p.agent_loop("agent", prompt="Do {q}", tools=["upper"], max_steps=max_steps, on_max_steps=on_max_steps))
    return p


def always_call_tool(request):
    if request.response_format["type"] == "tool_call" and request.response_format.get("tool_choice") != "none":
        return {"name": "upper", "arguments": {"text": "again"}}
    return "giving up"


async def test_agent_loop_stops_at_max_steps_with_an_answer(scripted):
    backend = scripted(always_call_tool)
    rt = Runtime(backend, tools=[upper])
    result = await rt.run(loop_program(3, "answer"), {"q": "x"})
    assert result.status == "done" and result.output == "giving up"
    # the last step still describes the tool (its prompt starts as the earlier steps' did) but must answer
    assert [(r.response_format["type"], r.response_format.get("tool_choice")) for r in backend.requests] == [
        ("tool_call", None), ("tool_call", None), ("tool_call", "none")]
    assert set(node_spans(rt)) == {"agent#1.llm", "agent#1.tool", "agent#2.llm", "agent#2.tool", "agent#3.llm"}
    # the model saw the tool results of the steps before
    assert [m["role"] for m in backend.requests[-1].messages] == ["user", "assistant", "tool", "assistant", "tool"]


async def test_agent_loop_error_at_max_steps_names_the_loop(scripted):
    rt = Runtime(scripted(always_call_tool), tools=[upper])
    result = await rt.run(loop_program(2, "error"), {"q": "x"})
    assert result.status == "failed" and result.failed_node == "agent"
    assert "max_steps=2" in result.error


async def test_agent_loop_feeds_tool_errors_back_to_the_model(scripted):
    @tool
    def broken(text: str) -> str:
        """Always fails."""
        raise RuntimeError("disk on fire")

    def reply(request):
        if len(request.messages) == 1:
            return {"name": "broken", "arguments": {"text": "a"}}
        return "could not: " + request.messages[-1]["content"]

    p = Program("loop_err", inputs={}, tools=[broken])
    p.output(p.agent_loop("agent", prompt="Go", tools=["broken"], max_steps=3))
    rt = Runtime(scripted(reply), tools=[broken])
    result = await rt.run(p, {})
    assert result.status == "done"
    assert "disk on fire" in result.output
    assert node_spans(rt)["agent#1.tool"]["status"] == "error"


async def test_branch_runs_only_the_chosen_case(scripted):
    p = Program("route", inputs={"q": str})
    kind = p.llm("kind", prompt="Kind of {q}", output=JsonSchema({"type": "string", "enum": ["math", "other"]}))
    p.output(p.branch("answer", on=kind, cases={"math": lambda b: b.llm("solve", prompt="Solve {q}"),
                                                "other": lambda b: b.llm("chat", prompt="Chat {q}")}))
    rt = Runtime(scripted({"kind": '"math"', "answer?math.solve": "42"}))
    result = await rt.run(p, {"q": "6*7"})
    assert result.output == "42"
    assert set(node_spans(rt)) == {"kind", "answer?math.solve"}


async def test_tool_timeout_retries_then_fallback(scripted):
    @tool(timeout_s=0.05, retries=1, backoff_s=0.01, idempotent=True)
    async def slow(x: int) -> int:
        """Too slow."""
        await asyncio.sleep(5)
        return x

    p = Program("slow", inputs={}, tools=[slow])
    p.output(p.tool("s", "slow", args={"x": 1}, fallback=-1))
    rt = Runtime(scripted(), tools=[slow])
    result = await rt.run(p, {})
    assert result.status == "done" and result.output == -1
    span = node_spans(rt)["s"]
    assert span["status"] == "error" and "timed out after 0.05s (attempt 2)" in span["error"]
    assert span["attributes"]["agentrt.tool.attempts"] == 2
    assert span["attributes"]["error.type"] == "timeout"
    assert phases_of(rt, "s")[-3:] == ["tool_retried", "tool_backoff", "tool_failed"]


async def test_flaky_tool_succeeds_on_retry(scripted):
    calls = []

    @tool(retries=2, backoff_s=0.01, retry_on=ConnectionError)
    def flaky() -> str:
        """Fails once."""
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("try again")
        return "ok"

    p = Program("flaky", inputs={}, tools=[flaky])
    p.output(p.tool("f", "flaky"))
    rt = Runtime(scripted(), tools=[flaky])
    result = await rt.run(p, {})
    assert result.output == "ok" and len(calls) == 2
    assert phases_of(rt, "f")[-3:] == ["tool_retried", "tool_backoff", "tool_running"]


async def test_tool_failure_without_fallback_fails_the_run_and_cancels_the_rest(scripted):
    @tool
    def explode() -> str:
        """Fails."""
        raise ValueError("bad input data")

    p = Program("boom", inputs={}, tools=[explode])
    p.output({"t": p.tool("t", "explode"), "slow": p.llm("slow", prompt="Write a lot")})
    backend = scripted({"slow": "word " * 500}, step_s=0.005)
    rt = Runtime(backend, tools=[explode])
    result = await rt.run(p, {})
    assert result.status == "failed" and result.failed_node == "t"
    assert result.error.startswith("t: tool call failed: tool 'explode' raised ValueError: bad input data")
    assert backend.aborted == ["slow"]
    spans = node_spans(rt)
    assert spans["t"]["status"] == "error" and spans["slow"]["status"] == "cancelled"
    program = next(r for r in rt.trace.records() if r["type"] == "program")
    assert program["status"] == "failed" and program["error"]["node"] == "t"


@pytest.mark.parametrize("reply, message", [
    (RequestError("prompt (900 tokens) + max_tokens (512) exceeds the context length 1024"),
     "the engine rejected the request: prompt (900 tokens)"),
    (LLMResponse("", None, "error", Usage(3, 0), error="engine step failed: boom"), "the engine failed: engine step failed"),
    (RuntimeError("backend bug"), "the LLM backend raised RuntimeError: backend bug"),
    (LLMResponse("partial", None, "abort", Usage(3, 1)), "the engine aborted the request"),
])
async def test_llm_failures_fail_the_run_naming_the_node(scripted, reply, message):
    p = Program("fails", inputs={})
    p.output(p.llm("ask", prompt="Hello"))
    rt = Runtime(scripted({"ask": reply}))
    result = await rt.run(p, {})
    assert result.status == "failed" and result.failed_node == "ask"
    assert message in result.error
    assert node_spans(rt)["ask"]["status"] == "error"


async def test_json_outputs_parsed_from_text_or_rejected(scripted):
    schema = JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    for text, status in [('Sure! ```json\n{"n": 3}\n```', "done"), ("no json here", "failed"), ('{"n": "x"}', "failed")]:
        p = Program("js", inputs={})
        p.output(p.llm("j", prompt="Give n", output=schema))
        result = await Runtime(scripted({"j": text})).run(p, {})
        assert result.status == status, text
        if status == "done":
            assert result.output == {"n": 3}
    assert "the model's output is not JSON: 'no json here'" in (await Runtime(scripted({"j": "no json here"})).run(p, {})).error


async def test_tool_call_outputs_drive_tool_nodes(scripted):
    p = Program("call", inputs={}, tools=[upper])
    pick = p.llm("pick", prompt="Call upper", output=ToolCall(["upper"]))
    p.output(p.tool("run", "upper", args=pick))
    for reply in ({"name": "upper", "arguments": {"text": "hi"}}, '{"name": "upper", "arguments": {"text": "hi"}}'):
        rt = Runtime(scripted({"pick": reply}), tools=[upper])
        result = await rt.run(p, {})
        assert result.output == "HI"
    result = await Runtime(scripted({"pick": "I will not"}), tools=[upper]).run(p, {})
    assert result.failed_node == "pick" and "answered in text" in result.error


async def test_cancelling_a_run_aborts_its_requests(scripted):
    p = Program("long", inputs={})
    p.output(p.llm("essay", prompt="Write"))
    backend = scripted({"essay": "word " * 10_000}, step_s=0.002)
    rt = Runtime(backend)
    handle = rt.submit(p, {})
    while not backend.requests:
        await asyncio.sleep(0.005)
    handle.cancel()
    result = await handle
    assert result.status == "cancelled" and backend.aborted == ["essay"]
    assert node_spans(rt)["essay"]["status"] == "cancelled"
    assert rt.runs[handle.run_id].run.status == "running"  # the DSL run was abandoned, not failed


async def test_configuration_errors_are_raised_before_running(scripted):
    p = Program("cfg", inputs={"n": int}, tools=[upper])
    p.output(p.tool("u", "upper", args={"text": Template("{n}")}))
    with pytest.raises(RunConfigError, match="upper"):
        Runtime(scripted()).submit(p, {"n": 1})
    with pytest.raises(ProgramRunError, match="n: input must be integer"):
        Runtime(scripted(), tools=[upper]).submit(p, {"n": "one"})
    with pytest.raises(RunConfigError, match="max_tokens"):
        Runtime(scripted(), max_tokens=0)


class ByProgram:
    """Requests of program "low" go after the others, until another program finishes a call."""

    def priority(self, program, node):
        return 5.0 if program.program == "low" else 1.0

    def reprioritize(self, programs):
        return {s.run_id: 0.5 for s in programs if s.program == "low"}


def one_call(name, max_tokens=100):
    p = Program(name, inputs={})
    p.output(p.llm("first", prompt="a", max_tokens=max_tokens))
    return p


async def test_max_tokens_cap_and_policy_priorities(scripted):
    backend = scripted({"first": "x " * 50})
    rt = Runtime(backend, policy=ByProgram(), max_tokens=8)
    low, high = rt.submit(one_call("low"), {}), rt.submit(one_call("high"), {})
    results = await asyncio.gather(low, high)
    assert all(r.status == "done" for r in results)
    assert sorted((r.node.program, r.priority, r.max_tokens) for r in backend.requests) == [("high", 1.0, 8), ("low", 5.0, 8)]
    assert node_spans(rt, low.run_id)["first"]["attributes"]["gen_ai.response.finish_reasons"] == ["length"]


async def test_reprioritize_reaches_requests_in_flight(scripted):
    backend = scripted(lambda r: "x " * (60 if r.node.program == "low" else 2))
    rt = Runtime(backend, policy=ByProgram())
    low, high = rt.submit(one_call("low"), {}), rt.submit(one_call("high"), {})
    await asyncio.gather(low, high)
    low_request = node_spans(rt, low.run_id)["first"]["attributes"]["agentrt.engine.request_id"]
    assert (low_request, 0.5) in backend.priority_changes


async def test_progress_names_what_is_stalled_on_what(scripted, research_program):
    gate = asyncio.Event()

    @tool
    async def search(query: str) -> list[str]:
        """Slow search."""
        if query == "q2":
            await gate.wait()
        return [query]

    backend = scripted({"split": ["q1", "q2"], "answers*summary": "s", "synthesis": "done"})
    rt = Runtime(backend, tools=[search])
    handle = rt.submit(research_program(search), {"question": "why"})
    rs = rt.runs[handle.run_id]
    async with asyncio.timeout(10):
        while "answers[1].search" not in rs.nodes or not rs.nodes["answers[1].search"].active \
                or rs.nodes["answers[0].summary"].status != "ok":
            await asyncio.sleep(0.005)
    view = progress(rs, rt.trace.now())
    assert [r.node for r in view.running] == ["answers[1].search"]
    stalls = {(s.node, s.blocker) for s in view.stalls}
    assert stalls == {("synthesis", "answers[1].search"), ("answers[1].summary", "answers[1].search")}
    assert view.stalls[0].describe().startswith(f"{view.stalls[0].node} waits on answers[1].search (tool_running ")
    assert view.done == 3 and view.total == 6
    gate.set()
    assert (await handle).status == "done"


async def test_graph_events_add_up_to_the_final_graph(scripted, research_program):
    """run_started carries the graph; each `graph` event only what changed (a fan-out expanding,
    the states of nodes other than LLM and tool ones): applied in order they give the graph the
    trace records at the end."""

    @tool
    async def search(query: str) -> list[str]:
        """Search."""
        return [query]

    rt = Runtime(scripted({"split": ["q1", "q2", "q3"], "answers*summary": "s", "synthesis": "done"}), tools=[search])
    events: list = []
    rt.subscribe_events(lambda e: events.append((e.type, dict(e.data))))
    result = await rt.run(research_program(search), {"question": "why"})
    assert result.status == "done"
    [started] = [d for t, d in events if t == "run_started"]
    nodes = {n["id"]: n for n in started["graph"]["nodes"]}
    edges = {(e["source"], e["target"]) for e in started["graph"]["edges"]}
    deltas = [d for t, d in events if t == "graph"]
    assert deltas and all(set(d) == {"nodes", "edges", "removed", "states"} for d in deltas)
    for d in deltas:
        assert not any(n["id"] in nodes for n in d["nodes"])  # each node is sent once
        nodes.update({n["id"]: n for n in d["nodes"]})
        for node, state in d["states"].items():  # branches, fan-outs, joins: their states as they change
            nodes[node] = {**nodes[node], "state": state}
        edges |= {(e["source"], e["target"]) for e in d["edges"]}
        for gone in d["removed"]:
            nodes.pop(gone)
            edges = {e for e in edges if gone not in e}
    [program] = [r for r in rt.trace.records() if r["type"] == "program"]
    final = program["graph"]
    assert sorted(nodes) == sorted(n["id"] for n in final["nodes"]) and "answers[2].summary" in nodes
    assert edges == {(e["source"], e["target"]) for e in final["edges"]}
    assert {n["id"]: n["kind"] for n in final["nodes"]} == {k: n["kind"] for k, n in nodes.items()}
    other = {n["id"]: n.get("state") for n in final["nodes"] if n["kind"] not in ("llm", "tool")}
    assert other == {k: n.get("state") for k, n in nodes.items() if k in other}
    assert set(other.values()) == {"done"}

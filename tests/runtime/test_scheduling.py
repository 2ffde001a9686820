"""Program-aware scheduling in the runtime: least attained service (LAS) ordering against FCFS,
the critical-path tie-break, attained service along the heaviest path for fan-out programs, the
KV hold's time-to-live, and, on a real (tiny) engine, KV held through a tool stall so a program's
second call reuses its first call's prefix."""
from __future__ import annotations

import asyncio

import pytest

from agentrt.dag import JsonSchema, Program, ToolCall
from agentrt.errors import RunConfigError
from agentrt.runtime import FCFSPolicy, KVHoldPolicy, LASPolicy, NodeContext, ProgramStats, Runtime, policy_from_name
from agentrt.runtime.summary import summarize
from agentrt.tools import tool


def ctx(node: str = "n", critical_path: float = 1.0, path_s: float = 0.0, path_tokens: int = 0) -> NodeContext:
    return NodeContext("run", node, critical_path, False, path_s, path_tokens)


def node_spans(rt: Runtime) -> dict[tuple[str, str], dict]:
    return {(r["run_id"], r["attributes"]["agentrt.node"]): r for r in rt.trace.records()
            if r["type"] == "span" and r["parent_id"] is None}


# ---- the policy itself ---------------------------------------------------------------------------


def test_las_levels_and_critical_path_tie_break():
    las = LASPolicy(quantum=0.1)
    fresh = ProgramStats("a", "p", 0.0, critical_path=5)
    assert [las.level(s) for s in (0.0, 0.09, 0.1, 0.19, 0.2, 0.4, 1.0)] == [0, 0, 1, 1, 2, 3, 4]
    # New programs first; more service, later.
    on_path = ctx(critical_path=5)
    assert las.priority(fresh, on_path) == 0.0
    served_more = [las.priority(fresh, ctx(critical_path=5, path_s=s)) for s in (0.0, 0.15, 0.5)]
    assert served_more == sorted(served_more) and len(set(served_more)) == 3
    # Equal level: a node on its program's critical path before a branch with slack (4 calls
    # left on the longest path, 1 on this branch: slack 4 -> 0.8), never across a level.
    assert las.priority(fresh, ctx(critical_path=1)) == pytest.approx(0.8)
    assert las.priority(fresh, ctx(critical_path=1)) < las.priority(fresh, ctx(critical_path=5, path_s=0.1))
    # Programs of different lengths at equal service: no reordering (slack 0 on each's own path).
    short_program = ProgramStats("b", "p", 0.0, critical_path=1)
    assert las.priority(short_program, ctx(critical_path=1)) == las.priority(fresh, on_path)
    # A node's own service so far counts (it drops a level while it decodes).
    served = ProgramStats("a", "p", 0.0, node_service_s={"n": 0.3})
    assert las.attained(served, ctx(path_s=0.05)) == pytest.approx(0.35)
    # Without critical-path mode, the program's total service is the measure.
    total = ProgramStats("a", "p", 0.0, llm_service_s=0.7, llm_tokens=90)
    assert LASPolicy(critical_path=False).attained(total, ctx(path_s=0.05)) == 0.7
    assert LASPolicy(unit="tokens", critical_path=False).attained(total, ctx()) == 90
    assert LASPolicy(unit="tokens").attained(served, ctx(path_tokens=40)) == 40


def test_policies_by_name_and_bad_settings():
    assert isinstance(policy_from_name("fcfs"), FCFSPolicy) and isinstance(policy_from_name("las"), LASPolicy)
    with pytest.raises(RunConfigError, match="unknown scheduling policy 'sjf'.*fcfs, las"):
        policy_from_name("sjf")
    with pytest.raises(RunConfigError, match="unit"):
        LASPolicy(unit="joules")
    with pytest.raises(RunConfigError, match="quantum"):
        LASPolicy(quantum=0)
    with pytest.raises(RunConfigError, match="quantile"):
        KVHoldPolicy(quantile=1.0)


def test_kv_hold_ttl_follows_observed_latency():
    hold = KVHoldPolicy(default_s=2.0, margin_s=0.5, max_s=30.0)
    assert hold.estimate("never_seen") == 2.0 and hold.ttl(hold.estimate("never_seen")) == 2.5
    hold.observe("fast", 0.3)
    # One observation does not claim a tight tail: p90 under the prior spread (sd 1 in log space).
    assert hold.estimate("fast") == pytest.approx(0.3 * 2.71828 ** 1.2816, rel=1e-3)
    for _ in range(40):  # a steady latency: the spread decays and the estimate converges on it
        hold.observe("fast", 0.3)
        hold.observe("slow", 4.0)
    assert 0.3 <= hold.estimate("fast") < 0.33 and 4.0 <= hold.estimate("slow") < 4.4
    assert hold.ttl(100.0) == 30.0


# ---- LAS against FCFS in a controlled two-program scenario (scripted engine, one seat) ---------


def two_programs(gate: asyncio.Event, running: asyncio.Event):
    @tool
    async def wait_gate() -> str:
        """Wait until the test opens the gate."""
        running.set()
        await gate.wait()
        return "open"

    old = Program("old", inputs={}, tools=[wait_gate])
    first = old.llm("first", prompt="Write at length")
    stall = old.tool("stall", "wait_gate", args={})
    old.output(old.llm("second", prompt="Continue after {stall} and {first}"))
    new = Program("new", inputs={})
    new.output(new.llm("only", prompt="Say hi"))
    return old, new, wait_gate


@pytest.mark.parametrize("policy", ["fcfs", "las"])
async def test_las_runs_a_fresh_program_before_one_that_was_served(scripted, policy):
    """Program "old" got a long first call; its second call is queued before "new"'s first. With
    one seat, FCFS serves old's second call first; LAS serves the fresh program first."""
    gate, running = asyncio.Event(), asyncio.Event()
    old, new, wait_gate = two_programs(gate, running)
    backend = scripted({"first": "w " * 40, "second": "x " * 10, "only": "y " * 10}, max_batch=1)
    las = LASPolicy(unit="tokens", quantum=8)
    rt = Runtime(backend, tools=[wait_gate], policy=las if policy == "las" else "fcfs")
    h_old = rt.submit(old, {})
    await asyncio.wait_for(running.wait(), 10)
    gate.set()
    async with asyncio.timeout(10):
        while len(backend.requests) < 2:  # old's second call is queued
            await asyncio.sleep(0.001)
    h_new = rt.submit(new, {})
    r_old, r_new = await asyncio.gather(h_old, h_new)
    assert r_old.ok and r_new.ok
    spans = node_spans(rt)
    second, only = spans[h_old.run_id, "second"], spans[h_new.run_id, "only"]
    if policy == "fcfs":
        assert second["end"] < only["end"]
        assert second["attributes"]["agentrt.priority"] == only["attributes"]["agentrt.priority"] == 0.0
    else:
        assert only["end"] < second["end"]
        assert only["attributes"]["agentrt.priority"] < second["attributes"]["agentrt.priority"]
        first_tokens = sum(e["attributes"]["agentrt.num_new"] + e["attributes"]["agentrt.k"]
                           for e in _events(rt, spans[h_old.run_id, "first"]))
        assert las.level(first_tokens) >= 2  # what "second" was charged for


def _events(rt: Runtime, node_span: dict) -> list[dict]:
    return [e for r in rt.trace.records() if r["type"] == "span" and r["parent_id"] == node_span["span_id"]
            for e in r["events"] if e["name"] == "engine_step"]


@pytest.mark.parametrize("policy", ["fcfs", "las"])
async def test_critical_path_breaks_ties_between_siblings(scripted, policy):
    """Two sibling calls ready together with no service yet: `short` (only the join after it)
    is started first, `long` has another call before the join: it is on the program's critical
    path, `short` has slack. FCFS keeps arrival order; LAS runs the critical one first."""
    p = Program("fork", inputs={})
    p.llm("short", prompt="a")
    p.llm("long", prompt="b")
    p.llm("then", prompt="after {long}")
    p.output(p.llm("join", prompt="{short} {then}"))
    backend = scripted({"*": "z " * 6}, max_batch=1)
    rt = Runtime(backend, policy=policy)
    result = await rt.run(p, {})
    assert result.ok
    assert [r.node.node for r in backend.requests[:2]] == ["short", "long"]  # arrival order
    spans = {node: s for (_, node), s in node_spans(rt).items()}
    first_done = "short" if policy == "fcfs" else "long"
    other = "long" if first_done == "short" else "short"
    assert spans[first_done]["end"] < spans[other]["end"]
    if policy == "las":
        assert spans["long"]["attributes"]["agentrt.priority"] < spans["short"]["attributes"]["agentrt.priority"]


class Recording(LASPolicy):
    """LAS that keeps every NodeContext it was asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, NodeContext] = {}
        self.stats: dict[str, ProgramStats] = {}

    def priority(self, program, node):
        self.seen.setdefault(node.node, node)
        self.stats[node.node] = program
        return super().priority(program, node)


async def test_fan_out_branches_are_charged_for_their_path_not_their_siblings(scripted):
    p = Program("fan", inputs={})
    split = p.llm("split", prompt="topics", output=JsonSchema({"type": "array", "items": {"type": "string"}}))
    p.fan_out("answers", over=split, body=lambda b: b.llm("summary", prompt="on {item}"))
    p.output(p.llm("synthesis", prompt="{answers}"))
    replies = {"split": ["a", "b", "c"], "synthesis": "done",
               "answers*summary": lambda r: "w " * (5 if "a" in r.messages[-1]["content"] else 20)}
    policy = Recording()
    # without streamed dispatch: branches start after the split, so their path is the whole split
    rt = Runtime(scripted(replies), policy=policy, stream_outputs=False)
    result = await rt.run(p, {})
    assert result.ok
    stats = policy.stats["synthesis"]
    split_s = stats.node_service_s["split"]
    branches = {n: s for n, s in stats.node_service_s.items() if n.endswith("summary")}
    assert len(branches) == 3
    for n in branches:  # each branch starts charged for the split only
        assert policy.seen[n].path_service_s == pytest.approx(split_s)
    # The synthesis: the split plus the heaviest branch, not the sum over the branches.
    assert policy.seen["synthesis"].path_service_s == pytest.approx(split_s + max(branches.values()))
    assert policy.seen["synthesis"].path_service_s < stats.llm_service_s - min(branches.values()) / 2
    assert policy.seen["synthesis"].path_tokens == stats.node_tokens["split"] + max(
        stats.node_tokens[n] for n in branches)


# ---- KV held through a tool stall, on a real tiny engine ---------------------------------------


SYSTEM = "You are a tiny agent that calls tools when asked. " * 3
PING = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_engine_factory(tiny_model_dir):
    from agentrt.engine import AsyncEngine, EngineConfig, LLMEngine
    from agentrt.engine.loading.model_loader import load_model

    path = tiny_model_dir("smollm")
    loaded = load_model(str(path), "float32", progress=False)
    made = []

    def make(**kw) -> AsyncEngine:
        cfg = EngineConfig(model=str(path), dtype="float32", block_size=8, **kw)
        engine = AsyncEngine(LLMEngine(cfg, loaded=loaded))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def holder_program(other_traffic):
    """pick -> ping (tool; meanwhile other traffic runs on the engine) -> again (same prompt
    start: it continues the first call's conversation prefix)."""

    @tool
    async def ping() -> str:
        """Ping the service."""
        await other_traffic()
        return "pong"

    p = Program("holder", inputs={}, tools=[ping])
    pick = p.llm("pick", system=SYSTEM, prompt="Call ping now.", output=ToolCall(["ping"]), max_tokens=40)
    res = p.tool("run", "ping", args=pick)
    p.output(p.llm("again", system=SYSTEM, prompt="Call ping now. It said {run}; call it again.",
                   output=ToolCall(["ping"]), max_tokens=40))
    return p, ping


@pytest.mark.parametrize("hold", [True, False])
async def test_kv_held_through_a_tool_stall_is_reused_by_the_next_call(tiny_engine_factory, hold):
    """While the program waits on its tool, two other requests go through a KV cache too small
    to keep everything: the second one needs blocks beyond the never-used ones, and least
    recently freed, the program's first call comes first. Held (pinned), its prefix survives and
    the program's second call reuses it; not held, it is evicted."""
    from agentrt.engine import SamplingParams
    from agentrt.runtime import EngineBackend

    engine = tiny_engine_factory(kv_cache_tokens=8 * 64)
    llm = engine.engine
    num_blocks = llm.blocks.allocator.num_blocks

    async def other_traffic():
        held = llm.blocks.prefix.num_blocks  # the first call's cached prompt and output
        spare = num_blocks - held  # never used so far
        assert spare >= 8, f"test sizing: only {spare} spare blocks"
        for n_blocks, token in ((spare - 1, 200), (spare - 3, 201)):  # recent traffic, then a bigger need
            ids = [token] * (n_blocks * 8)
            await engine.generate(ids, SamplingParams(max_tokens=1, temperature=0))

    program, ping = holder_program(other_traffic)
    backend = EngineBackend(engine)
    rt = Runtime(backend, tools=[ping], kv_hold=KVHoldPolicy(default_s=5.0, margin_s=0.5) if hold else False,
                 prefill_ahead=False)  # holds alone: prefill-ahead would compute the prompt start again
    try:
        result = await asyncio.wait_for(rt.run(program, {}), 60)
    finally:
        await rt.aclose()
        backend.close()
    assert result.ok, result.error
    spans = {node: s["attributes"] for (_, node), s in node_spans(rt).items()}
    pick, again = spans["pick"], spans["again"]
    (record,) = [r for r in rt.trace.records() if r["type"] == "program"]
    service = record["service"]
    first_full_blocks = (pick["gen_ai.usage.input_tokens"] // 8) * 8
    if hold:
        assert pick["agentrt.kv.hold_ttl_s"] == 5.5  # the tool was never observed: default + margin
        assert pick["agentrt.kv.hold_blocks"] >= first_full_blocks // 8
        assert again["agentrt.kv.hold_outcome"] == "hit" and again["agentrt.kv.hold_from"] == "pick"
        # the prompts part at the end of the first user message: all but its last block or two
        assert again["gen_ai.usage.cache_read.input_tokens"] >= again["agentrt.kv.hold_reusable_tokens"] \
            >= first_full_blocks - 16
        # the second call also ends in a tool call: held too, with the tool's observed latency now
        assert again["agentrt.kv.hold_ttl_s"] < 5.5
        assert service["kv_holds"] == 2 and service["kv_hold_hits"] == 1 and service["kv_hold_misses"] == 0
        assert service["prefill_saved_tokens"] == again["gen_ai.usage.cache_read.input_tokens"]
        assert summarize(rt.trace.records())["runs"][0]["service"]["kv_hold_hits"] == 1  # `agentrt inspect --json`
        assert llm.blocks.prefix.stats.pin_hits >= 1
    else:
        assert "agentrt.kv.hold_ttl_s" not in pick and "agentrt.kv.hold_outcome" not in again
        assert again["gen_ai.usage.cache_read.input_tokens"] < first_full_blocks // 2
        assert service["kv_holds"] == 0
    llm.blocks.check_invariants()


def test_run_cli_selects_the_policy():
    import argparse

    from agentrt.cli.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["examples/x.py"]).policy == "las"
    assert parser.parse_args(["examples/x.py", "--policy", "fcfs"]).policy == "fcfs"
    assert isinstance(Runtime(_NoBackend()).policy, LASPolicy)  # the runtime's default
    assert isinstance(Runtime(_NoBackend(), policy="fcfs").policy, FCFSPolicy)


class _NoBackend:
    """Enough of a backend to construct a Runtime (nothing is run)."""

    model_name = "none"

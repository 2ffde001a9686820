"""A machine-readable summary of a trace (what `agentrt inspect --json` prints; the terminal and
HTML views read it too). Computed from the records alone:

    {"trace": {name, wall_start, end, meta},
     "runs": [{run_id, program, status, start, end, duration_s, error, output, service,
               "stalls": {waiting_on_llm_s, waiting_on_tool_s, waiting_on_input_s, waiting_other_s,
                          queued_llm_s, queued_tool_s, preempted_s, tool_backoff_s,
                          llm_active_s, tool_only_s, waiting_for_input_s, neither_s},
               "warnings": [str: a node cut at max_tokens, or a text answer shaped like a tool call],
               "loops": [{loop, ended, llm_steps, tool_steps}: how each agent loop ended],
               "nodes": [{node, kind, name, status, error, start, end, duration_s,
                          phases: {phase: seconds}, waited_on, value (preview), tool, attempts,
                          attempt_log: [{attempt, ok, error_kind, error, duration_s, backoff_s,
                                         not_retried, executor, worker}] (tool),
                          prompt, schema, answered_by, via, asked_at, answered_at (wait_for),
                          usage: {input_tokens, cached_input_tokens, output_tokens},
                          spec: {drafted, accepted, forced, alpha, alpha_free, alpha_forced,
                                 target_passes, emitted, tokens_per_pass}, steps, finish_reason, tool_call}]}],
     "engine": {steps, busy_s, idle_s, busy_fraction, mean_batch, max_batch, drafted, accepted,
                alpha, max_k}}

Stalls: waiting_on_* add each node's waiting time by the kind of the node it waited on last
(waiting_on_input_s: a wait_for node, i.e. a person or system outside the program);
queued_* the time ready nodes spent before starting; llm_active_s / tool_only_s /
waiting_for_input_s / neither_s split the run's wall time into: some LLM call of the run in the
engine, only tools running, only waits for outside input (no LLM call, no tool), neither.
"""
from __future__ import annotations

import json
import re

from typing import Any, Iterable

STALL_KEYS = ("waiting_on_llm_s", "waiting_on_tool_s", "waiting_on_input_s", "waiting_other_s", "queued_llm_s",
              "queued_tool_s", "preempted_s", "tool_backoff_s", "llm_active_s", "tool_only_s", "waiting_for_input_s",
              "neither_s")
WAITED_ON_KEYS = {"llm": "waiting_on_llm_s", "tool": "waiting_on_tool_s", "wait_for": "waiting_on_input_s"}
LLM_ACTIVE = ("queued", "prefill", "decode", "preempted", "prefill_ahead")
TOOL_ACTIVE = ("tool_running", "tool_retried", "tool_backoff", "tool_failed")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of (disjoint, sorted) intervals outside (disjoint, sorted) cut."""
    out = []
    for a, b in intervals:
        t = a
        for c, d in cut:
            if d <= t or c >= b:
                continue
            if c > t:
                out.append((t, c))
            t = max(t, d)
        if t < b:
            out.append((t, b))
    return out


PREVIEW_CHARS = 300


def value_preview(value: Any) -> str | None:
    """A node's value as a prompt shows it (text as is, else JSON), cut to PREVIEW_CHARS; the
    whole value is in the node span's attributes (`agentrt inspect TRACE --node ID`)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


def node_summary(span: dict[str, Any], phases: list[dict[str, Any]]) -> dict[str, Any]:
    a = span["attributes"]
    durations: dict[str, float] = {}
    steps = 0
    for p in phases:
        name = p["attributes"]["agentrt.phase"]
        durations[name] = durations.get(name, 0.0) + p["end"] - p["start"]
        steps += sum(1 for e in p.get("events", []) if e.get("name") == "engine_step")
    out: dict[str, Any] = {
        "node": a["agentrt.node"], "kind": a["agentrt.node.kind"], "name": span["name"], "status": span["status"],
        "error": span.get("error"), "start": span["start"], "end": span["end"],
        "duration_s": _r(span["end"] - span["start"]), "phases": {k: _r(v) for k, v in durations.items()},
        "waited_on": a.get("agentrt.waited_on"),
        "value": value_preview(a.get("agentrt.value", a.get("gen_ai.tool.call.result"))),
    }
    if out["kind"] == "tool":
        out.update(tool=a.get("gen_ai.tool.name"), attempts=a.get("agentrt.tool.attempts", 0),
                   attempt_log=a.get("agentrt.tool.attempt_log", []))
        if "agentrt.started_before_caller_end_s" in a:  # started early, on the streamed call of waited_on
            out["started_before_caller_end_s"] = a["agentrt.started_before_caller_end_s"]
    elif out["kind"] == "wait_for":
        out.update(prompt=a.get("agentrt.input.prompt"), schema=a.get("agentrt.input.schema"),
                   answered_by=a.get("agentrt.input.answered_by"), via=a.get("agentrt.input.via"),
                   asked_at=a.get("agentrt.input.asked_at"), answered_at=a.get("agentrt.input.answered_at"))
    else:
        out["usage"] = {"input_tokens": a.get("gen_ai.usage.input_tokens"),
                        "cached_input_tokens": a.get("gen_ai.usage.cache_read.input_tokens"),
                        "output_tokens": a.get("gen_ai.usage.output_tokens")}
        out["spec"] = {k: a.get(f"agentrt.spec.{k}") for k in (
            "drafted", "accepted", "forced", "alpha", "alpha_free", "alpha_forced", "target_passes", "emitted",
            "tokens_per_pass")}
        out["steps"] = steps
        out["finish_reason"] = (a.get("gen_ai.response.finish_reasons") or [None])[0]
        out["tool_call"] = a.get("agentrt.tool_call")  # the tool it called (its value is that call)
        if "agentrt.tool_calls" in a:  # parallel calls: the tools it called, in order
            out["tool_calls"] = a["agentrt.tool_calls"]
    return out


_TOOL_CALL_TEXT = re.compile(r'^\s*(?:```(?:json)?\s*)?\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"(?:arguments|parameters)"\s*:')


def run_warnings(nodes: list[dict[str, Any]]) -> list[str]:
    """What looks finished but may not be: LLM nodes cut at max_tokens, and text answers shaped
    like a tool call that nothing parsed (a model that meant to call a tool, or a loop's last
    step that answered with one)."""
    out = []
    for n in nodes:
        if n["kind"] != "llm" or n["status"] != "ok":
            continue
        if n.get("finish_reason") == "length":
            out.append(f"{n['node']}: cut at max_tokens ({(n.get('usage') or {}).get('output_tokens')} tokens): "
                       "the answer may be incomplete")
        if not n.get("tool_call") and isinstance(n.get("value"), str) and _TOOL_CALL_TEXT.match(n["value"]):
            out.append(f"{n['node']}: answered with text shaped like a tool call, which no tool ran")
    return out


def run_loops(node_spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How each agent loop of a run ended, from the span of the LLM step that ended it
    (agentrt.loop.* attributes), in the order they ended."""
    ends = sorted((s for s in node_spans if "agentrt.loop.ended" in s["attributes"]), key=lambda s: s["end"])
    return [{"loop": a["agentrt.loop"], "ended": a["agentrt.loop.ended"], "llm_steps": a.get("agentrt.loop.llm_steps"),
             "tool_steps": a.get("agentrt.loop.tool_steps")} for a in (s["attributes"] for s in ends)]


def run_stalls(nodes: list[dict[str, Any]], phase_spans: list[dict[str, Any]], start: float, end: float) -> dict[str, float]:
    kinds = {n["node"]: n["kind"] for n in nodes}
    st = dict.fromkeys(STALL_KEYS, 0.0)
    for n in nodes:
        ph = n["phases"]
        waited = kinds.get(n["waited_on"] or "")
        st[WAITED_ON_KEYS.get(waited or "", "waiting_other_s")] += ph.get("waiting", 0.0) + ph.get("prefill_ahead", 0.0)
        st["queued_llm_s" if n["kind"] == "llm" else "queued_tool_s"] += ph.get("queued", 0.0)
        st["preempted_s"] += ph.get("preempted", 0.0)
        st["tool_backoff_s"] += ph.get("tool_backoff", 0.0)
    # a tool node's queued phase is not an LLM call in the engine: only LLM nodes' phases count here
    llm = _union((p["start"], p["end"]) for p in phase_spans if p["attributes"]["agentrt.phase"] in LLM_ACTIVE
                 and kinds.get(p["attributes"].get("agentrt.node", "")) == "llm")
    tool = _union((p["start"], p["end"]) for p in phase_spans if p["attributes"]["agentrt.phase"] in TOOL_ACTIVE)
    tool_only = _minus(tool, llm)
    asked = _union((p["start"], p["end"]) for p in phase_spans if p["attributes"]["agentrt.phase"] == "input_wait")
    st["llm_active_s"] = _length(llm)
    st["tool_only_s"] = _length(tool_only)
    st["waiting_for_input_s"] = _length(_minus(asked, _union([*llm, *tool])))
    st["neither_s"] = max(0.0, (end - start) - st["llm_active_s"] - st["tool_only_s"] - st["waiting_for_input_s"])
    return {k: _r(v) for k, v in st.items()}


def engine_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in records if r["type"] == "engine_step"]
    idle = [r for r in records if r["type"] == "engine_idle"]
    busy = sum(s["end"] - s["start"] for s in steps)
    idle_s = sum(r["end"] - r["start"] for r in idle)
    drafted = sum(s.get("drafted", 0) for s in steps)
    accepted = sum(s.get("accepted", 0) for s in steps)
    return {
        "steps": len(steps), "busy_s": _r(busy), "idle_s": _r(idle_s),
        "busy_fraction": _r(busy / (busy + idle_s)) if busy + idle_s > 0 else None,
        "mean_batch": _r(sum(s["batch_size"] for s in steps) / len(steps)) if steps else None,
        "max_batch": max((s["batch_size"] for s in steps), default=0),
        "drafted": drafted, "accepted": accepted, "alpha": _r(accepted / drafted) if drafted else None,
        "max_k": max((s.get("max_k", 0) for s in steps), default=0),
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    header = records[0]
    spans = [r for r in records if r["type"] == "span"]
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        if s["parent_id"] is not None:
            children.setdefault(s["parent_id"], []).append(s)
    end = next((r["end"] for r in records if r["type"] == "trace_end"), None)
    runs = []
    for prog in (r for r in records if r["type"] == "program"):
        node_spans = [s for s in spans if s["run_id"] == prog["run_id"] and s["parent_id"] is None]
        nodes = [node_summary(s, sorted(children.get(s["span_id"], []), key=lambda p: p["start"])) for s in node_spans]
        nodes.sort(key=lambda n: (n["start"] + n["phases"].get("waiting", 0.0), n["node"]))  # by ready time
        phase_spans = [p for s in node_spans for p in children.get(s["span_id"], [])]
        runs.append({
            "run_id": prog["run_id"], "program": prog["program"], "status": prog["status"],
            "start": prog["start"], "end": prog["end"], "duration_s": _r(prog["end"] - prog["start"]),
            "error": prog.get("error"), "output": prog.get("output"), "inputs": prog.get("inputs"),
            "service": prog.get("service"), "stalls": run_stalls(nodes, phase_spans, prog["start"], prog["end"]),
            "warnings": run_warnings(nodes), "loops": run_loops(node_spans), "nodes": nodes,
        })
    return {"trace": {"name": header.get("name"), "wall_start": header.get("wall_start"), "end": end,
                      "meta": header.get("meta", {})},
            "runs": runs, "engine": engine_summary(records)}

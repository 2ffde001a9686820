"""`agentrt bench workload`'s statistics: percentiles, k by load, averaging over repeats and the
summary, from the per-policy rows and details that workload.run_policy returns."""
from __future__ import annotations

import math
import statistics
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def k_by_load(step_log: list[Any], n_programs: int) -> dict[str, Any]:
    """k over decoding rows (one new token fed: they may carry drafts), in steps with few sequences
    (batch <= max(1, N // 4): most programs stall on tools or wait) and in steps with a full batch
    (batch >= ceil(N / 2)): all drafts, and the free ones (not grammar-forced). Forced drafts are
    accepted by construction and cost one verified position each, so the controller takes them at
    any load; the free ones are the speculation that load should cut."""
    idle_max, busy_min = max(1, n_programs // 4), math.ceil(n_programs / 2)
    out: dict[str, Any] = {"idle_batch_max": idle_max, "busy_batch_min": busy_min}
    for cls in ("idle", "busy"):
        out.update({f"{cls}_k_sum": 0, f"{cls}_free_k_sum": 0, f"{cls}_rows": 0})
    for rec in step_log:
        cls = "idle" if rec.batch_size <= idle_max else "busy" if rec.batch_size >= busy_min else None
        if cls is None:
            continue
        forced = rec.forced or [0] * len(rec.k)  # records from before forced counts existed
        for k, f, n in zip(rec.k, forced, rec.num_new):
            if n == 1:
                out[f"{cls}_k_sum"] += k
                out[f"{cls}_free_k_sum"] += k - f
                out[f"{cls}_rows"] += 1
    return out


def k_means(loads: list[dict[str, Any]]) -> dict[str, float | None]:
    """k_idle_mean, k_busy_mean (all drafts) and k_free_idle_mean, k_free_busy_mean pooled over the
    rows of several runs."""
    out = {}
    for cls in ("idle", "busy"):
        rows = sum(x[f"{cls}_rows"] for x in loads)
        out[f"k_{cls}_mean"] = sum(x[f"{cls}_k_sum"] for x in loads) / rows if rows else None
        out[f"k_free_{cls}_mean"] = sum(x[f"{cls}_free_k_sum"] for x in loads) / rows if rows else None
    return out


def average(rows: list[dict[str, Any]], details: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy's row over its repeats: numbers averaged, k pooled over rows, done the worst."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [r[key] for r in rows]
        if key == "done":
            out[key] = min(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and None not in values:
            out[key] = statistics.fmean(values)
        else:
            out[key] = value
    out.update(k_means([d["k_by_load"] for d in details]))
    return out


def post_tool_ttft(records: list[dict[str, Any]]) -> list[float]:
    """Per LLM node that waited on a tool last (agentrt.waited_on): seconds from that tool's end
    to the node's first generated token (the start of its decode phase): what a tool return costs
    before the program moves on."""
    spans = [r for r in records if r.get("type") == "span"]
    nodes = {(s["run_id"], s["attributes"]["agentrt.node"]): s for s in spans
             if s["parent_id"] is None and "agentrt.node" in s["attributes"]}
    decode = {}
    for s in spans:
        if s["parent_id"] is not None and s["attributes"].get("agentrt.phase") == "decode":
            decode.setdefault(s["parent_id"], s["start"])
    out = []
    for (run_id, _), s in nodes.items():
        waited = nodes.get((run_id, s["attributes"].get("agentrt.waited_on")))
        if (s["attributes"].get("agentrt.node.kind") == "llm" and waited is not None and s["span_id"] in decode
                and waited["attributes"].get("agentrt.node.kind") == "tool"):
            out.append(max(0.0, decode[s["span_id"]] - waited["end"]))
    return out


def critical_path_split(records: list[dict[str, Any]]) -> tuple[float, float]:
    """Mean over the program runs of a trace of the tool time and the LLM time on each run's
    critical path: from the node that ended last, back through the input each node waited on
    last (agentrt.waited_on), a node counting its span less its waiting phase, up to where the
    next node on the path began (streamed dispatch starts a tool before its LLM input ends). The tool latencies
    are the same under every policy (the path through them may differ where branches end close
    together); the LLM time is what an engine policy can shorten."""
    spans = [r for r in records if r.get("type") == "span"]
    waiting: dict[str, float] = {}
    for s in spans:
        if s["parent_id"] is not None and s["attributes"].get("agentrt.phase") in ("waiting", "prefill_ahead"):
            waiting[s["parent_id"]] = waiting.get(s["parent_id"], 0.0) + s["end"] - s["start"]
    nodes: dict[str, dict[str, dict[str, Any]]] = {}
    for s in spans:
        if s["parent_id"] is None and "agentrt.node" in s["attributes"]:
            nodes.setdefault(s["run_id"], {})[s["attributes"]["agentrt.node"]] = s
    tool = llm = 0.0
    for by_name in nodes.values():
        node, seen, limit = max(by_name.values(), key=lambda s: s["end"]), set(), float("inf")
        while node is not None and node["span_id"] not in seen:
            seen.add(node["span_id"])
            began = node["start"] + waiting.get(node["span_id"], 0.0)
            busy = max(0.0, min(node["end"], limit) - began)  # a node started early overlaps its input
            limit = began
            if node["attributes"].get("agentrt.node.kind") == "llm":
                llm += busy
            else:
                tool += busy
            node = by_name.get(node["attributes"].get("agentrt.waited_on"))
    n = max(1, len(nodes))
    return tool / n, llm / n


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    a, b, c = rows
    llm_a, llm_c = a.get("llm_critical_path_s"), c.get("llm_critical_path_s")
    return {
        "mean_latency_speedup_vs_fcfs": a["mean_s"] / c["mean_s"],
        "p90_latency_speedup_vs_fcfs": a["p90_s"] / c["p90_s"],
        "k_idle_mean": c["k_idle_mean"],
        "k_busy_mean": c["k_busy_mean"],
        "k_free_idle_mean": c.get("k_free_idle_mean"),
        "k_free_busy_mean": c.get("k_free_busy_mean"),
        "makespan_speedup_vs_fcfs": a["makespan_s"] / c["makespan_s"],
        "mean_latency_speedup_vs_fixed_k4": b["mean_s"] / c["mean_s"],
        "prefill_saved_tokens": c["prefill_saved"],
        "done": f"{a['done']}/{b['done']}/{c['done']}",
        # what the engine policy controls, and what it cannot (see critical_path_split)
        "llm_critical_path_speedup_vs_fcfs": llm_a / llm_c if llm_a and llm_c else None,
        "tool_critical_path_s": c.get("tool_critical_path_s"),
    }


# two-sided 95% quantiles of Student's t for 1..10 degrees of freedom
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def t975(df: int) -> float:
    """Student's t 0.975 quantile: the table, then the Cornish-Fisher series (error < 0.003 past 10)."""
    if df <= len(T975):
        return T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def speedup_interval(base: list[float], full: list[float]) -> tuple[float, float] | None:
    """95% interval of the speedup base / full from paired repeats (run back to back): a t
    interval on the mean log of the per-repeat ratios, since the machine's drift scales a
    repeat's times. None with fewer than two repeats."""
    logs = [math.log(b / f) for b, f in zip(base, full)]
    if len(logs) < 2:
        return None
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mid = statistics.fmean(logs)
    return math.exp(mid - half), math.exp(mid + half)


def speedup_done_everywhere(base: list[dict[str, Any]], full: list[dict[str, Any]]) -> float | None:
    """Mean completion speedup over the programs that finished (status done) in every run of both
    policies: a program that fails early (e.g. a structured output cut at max_tokens) shortens
    its policy's mean."""
    runs = base + full
    ids = [p["run_id"] for p in runs[0]["programs"]
           if all(q["status"] == "done" for d in runs for q in d["programs"] if q["run_id"] == p["run_id"])]
    if not ids:
        return None

    def mean(ds: list[dict[str, Any]]) -> float:
        return statistics.fmean(q["duration_s"] for d in ds for q in d["programs"] if q["run_id"] in ids)

    return mean(base) / mean(full)


def same_outputs(details: list[dict[str, Any]]) -> int:
    """Programs whose output is the same in every run (greedy decoding: all of them in bf16 on the
    C kernels, which are batch-invariant; fp32 on the PyTorch path may differ at near-ties)."""
    outs = [[p["output"] for p in d["programs"]] for d in details]
    return sum(len({repr(o) for o in col}) == 1 for col in zip(*outs))

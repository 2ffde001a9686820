"""Terminal views of a trace summary and its records (rich): the α table, the stall totals, the
program's output and a timeline with a lane per node plus the engine's batch and k lanes."""
from __future__ import annotations

import json
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from agentrt.runtime.summary import LLM_ACTIVE, TOOL_ACTIVE
from agentrt.spec.report import SpecFigures

# phase -> (character, style): readable without colour too
PHASE_STYLE: dict[str, tuple[str, str]] = {
    "waiting": ("·", "grey50"),
    "queued": ("q", "yellow"),
    "prefill_ahead": ("a", "magenta"),
    "prefill": ("p", "bold magenta"),
    "decode": ("█", "green"),
    "preempted": ("!", "bold red"),
    "tool_running": ("T", "bold cyan"),
    "tool_retried": ("r", "bold bright_red"),
    "tool_backoff": ("~", "bright_red"),
    "tool_failed": ("X", "bold red"),
    "input_wait": ("?", "bold yellow"),
}
_ACTIVE = set(LLM_ACTIVE[1:]) | set(TOOL_ACTIVE)  # phases doing work (queued counts as stall here)


PIPED_WIDTH = 160  # a file or a pipe has no width; rich would assume 80 and cut the tables' cells


def report_console() -> Console:
    """The console `agentrt run` and `inspect` print on: the terminal's width, or when the
    output is piped or redirected PIPED_WIDTH columns, so the tables are not cut to 80."""
    console = Console()
    return console if console.is_terminal else Console(width=PIPED_WIDTH)


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def alpha_table(run: dict[str, Any]) -> Table:
    """Per LLM node: tokens, drafts, α (all, free, forced) and tokens per target pass."""
    t = Table(title=f"speculation per LLM node ({run['program']})", title_justify="left")
    for col in ("node", "in", "cached", "out", "drafted", "accepted", "forced", "α", "α free", "α forced", "tok/pass", "steps"):
        t.add_column(col, justify="left" if col == "node" else "right", overflow="fold")  # wrap, never "…"
    per_node = []
    for n in run["nodes"]:
        if n["kind"] != "llm":
            continue
        s, u = n["spec"], n["usage"]
        t.add_row(n["node"], str(u["input_tokens"] or 0), str(u.get("cached_input_tokens") or 0),
                  str(u["output_tokens"] or 0), str(s["drafted"] or 0),
                  str(s["accepted"] or 0), str(s["forced"] or 0), _f(s["alpha"]), _f(s["alpha_free"]),
                  _f(s["alpha_forced"]), _f(s["tokens_per_pass"]), str(n["steps"]))
        per_node.append(SpecFigures.from_dict(s))
    tot = SpecFigures.sum(per_node)
    t.add_section()
    t.add_row("all", "", "", "", str(tot.drafted), str(tot.accepted), str(tot.forced), _f(tot.alpha),
              _f(tot.alpha_free), _f(tot.alpha_forced), _f(tot.tokens_per_pass), "")
    return t


def stall_table(run: dict[str, Any]) -> Table:
    """Two kinds of figures, kept apart: a split of the run's wall clock (its rows add up to the
    run's duration), and waits summed over nodes (nodes wait side by side, so these can add up to
    more than the run took)."""
    st = run["stalls"]
    t = Table(title=f"where the time went ({run['duration_s']:.2f}s)", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("s", justify="right")
    t.add_row(Text("the run's clock, split (adds up to its duration)", style="bold"), "")
    for label, key in [("some LLM call in the engine", "llm_active_s"), ("only tools running", "tool_only_s"),
                       ("waiting for input (wait_for: a person or system)", "waiting_for_input_s"),
                       ("neither (runtime)", "neither_s")]:
        t.add_row("  " + label, f"{st[key]:.3f}")
    t.add_section()
    t.add_row(Text("summed over nodes (they wait side by side: may exceed the duration)", style="bold"), "")
    for label, key in [("waiting on LLM nodes", "waiting_on_llm_s"), ("waiting on tool nodes", "waiting_on_tool_s"),
                       ("waiting on input (wait_for nodes)", "waiting_on_input_s"),
                       ("LLM calls queued in the engine", "queued_llm_s"), ("tool calls queued", "queued_tool_s"),
                       ("preempted", "preempted_s"), ("tool retry backoff", "tool_backoff_s")]:
        t.add_row("  " + label, f"{st[key]:.3f}")
    return t


def output_view(run: dict[str, Any]) -> Panel:
    if run["status"] == "done":
        out = run["output"]
        body = out if isinstance(out, str) else json.dumps(out, indent=2, ensure_ascii=False)
        return Panel(Text(body), title=f"output of {run['program']}", border_style="green")
    err = run.get("error") or {}
    return Panel(Text(str(err.get("message")), style="red"),
                 title=f"{run['program']} {run['status']}", border_style="red")


def _lane(phases: list[dict[str, Any]], t0: float, dt: float, width: int) -> Text:
    """One character per column: the working phase covering most of it, else the stall phase."""
    text = Text()
    for col in range(width):
        a, b = t0 + col * dt, t0 + (col + 1) * dt
        cover: dict[str, float] = {}
        for p in phases:
            overlap = min(b, p["end"]) - max(a, p["start"])
            if overlap > 0 or (p["start"] == p["end"] and a <= p["start"] < b):
                name = p["attributes"]["agentrt.phase"]
                cover[name] = cover.get(name, 0.0) + max(overlap, 0.0)
        if not cover:
            text.append(" ")
            continue
        active = {k: v for k, v in cover.items() if k in _ACTIVE}
        pool = active or cover
        phase = max(pool, key=pool.get)
        ch, style = PHASE_STYLE.get(phase, ("?", ""))
        text.append(ch, style=style)
    return text


def _engine_lanes(steps: list[dict[str, Any]], t0: float, dt: float, width: int) -> tuple[Text, Text]:
    batch, k = [0] * width, [0] * width
    for s in steps:
        first = max(0, int((s["start"] - t0) / dt))
        last = min(width - 1, int((s["end"] - t0) / dt))
        for col in range(first, last + 1):
            batch[col] = max(batch[col], s["batch_size"])
            k[col] = max(k[col], s.get("max_k", 0))

    def digits(values: list[int], style: str) -> Text:
        out = Text()
        for v in values:
            out.append(" " if v == 0 else str(v) if v < 10 else "+", style=style)
        return out

    return digits(batch, "bold blue"), digits(k, "bold yellow")


def timeline(summary: dict[str, Any], records: list[dict[str, Any]], total_width: int = 120) -> Group:
    """A lane per node (phase characters), then the engine's batch size and max draft length;
    labels and lanes together take total_width characters."""
    runs = summary["runs"]
    if not runs:
        return Group(Text("(no program runs in this trace)"))
    label_w = min(34, max([len("engine batch")] + [len(n["node"]) for r in runs for n in r["nodes"]]) + 2)
    width = max(20, total_width - label_w)
    t0 = min(r["start"] for r in runs)
    t1 = max(r["end"] for r in runs)
    dt = max(t1 - t0, 1e-6) / width
    phase_of: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec["type"] == "span" and rec["parent_id"] is not None:
            phase_of.setdefault(rec["parent_id"], []).append(rec)
    node_span = {(r["run_id"], r["attributes"].get("agentrt.node")): r["span_id"]
                 for r in records if r["type"] == "span" and r["parent_id"] is None}
    lines = [Text(f"{'':<{label_w}}0s{'':>{max(0, width - 2 - len(f'{t1 - t0:.2f}s'))}}{t1 - t0:.2f}s", style="dim")]
    for run in runs:
        if len(runs) > 1:
            lines.append(Text(f"{run['program']} ({run['run_id']})", style="bold"))
        for n in run["nodes"]:
            label = n["node"] if len(n["node"]) <= label_w - 1 else "…" + n["node"][-(label_w - 2):]
            line = Text(f"{label:<{label_w}}", style="red" if n["status"] == "error" else "")
            line.append_text(_lane(phase_of.get(node_span.get((run["run_id"], n["node"]), ""), []), t0, dt, width))
            lines.append(line)
    steps = [r for r in records if r["type"] == "engine_step" and r["end"] >= t0 and r["start"] <= t1]
    batch, k = _engine_lanes(steps, t0, dt, width)
    lines.append(Text(f"{'engine batch':<{label_w}}", style="bold").append_text(batch))
    lines.append(Text(f"{'engine k':<{label_w}}", style="bold").append_text(k))
    legend = Text("legend: ")
    for phase, (ch, style) in PHASE_STYLE.items():
        legend.append(ch, style=style).append(f" {phase}  ")
    legend.append("engine lanes: max batch size / max drafts per step (blank: idle)", style="dim")
    lines.append(legend)
    return Group(*lines)


def loop_line(loop: dict[str, Any]) -> str:
    """How an agent loop ended, e.g. "agent loop agent: answered at step 1, without calling a tool"."""
    steps, calls = loop.get("llm_steps"), loop.get("tool_steps") or 0
    how = {"answered": f"answered at step {steps}",
           "answered_at_max_steps": f"made to answer at its last step ({steps})",
           "exceeded_max_steps": f"still calling a tool at its last step ({steps})"}.get(
        loop["ended"], f"{loop['ended']} at step {steps}")
    tools = "without calling a tool" if not calls else f"after {calls} tool call{'s' if calls > 1 else ''}"
    return f"agent loop {loop['loop']}: {how}, {tools}"


def answer_line(n: dict[str, Any]) -> str:
    """A wait_for node in one line: its question, who answered how and after how long, the value
    (`inspect --node` shows the schema and the whole value)."""
    asked = f"{n['node']} (wait_for) asked {n['prompt']!r}" if n.get("prompt") else f"{n['node']} (wait_for)"
    if n.get("answered_at") is None:
        return f"{asked}: not answered ({n['status']})"
    who = f" by {n['answered_by']}" if n.get("answered_by") else ""
    waited = f" after {n['answered_at'] - n['asked_at']:.1f} s" if n.get("asked_at") else ""
    return f"{asked}: answered{who} via {n.get('via')}{waited}: {n.get('value')}"


def render_report(console: Console, summary: dict[str, Any], records: list[dict[str, Any]], *,
                  show_output: bool = True) -> None:
    """Everything `agentrt run` prints after a run and `agentrt inspect` prints for a trace."""
    for run in summary["runs"]:
        if show_output:
            console.print(output_view(run))
        for warning in run.get("warnings", ()):
            console.print(Text(f"warning: {warning}", style="yellow"))
        for loop in run.get("loops", ()):
            console.print(Text(loop_line(loop), style="dim"))
        for n in run["nodes"]:
            if n["kind"] == "wait_for":
                console.print(Text(answer_line(n)))
        console.print(alpha_table(run))
        console.print(stall_table(run))
    eng = summary["engine"]
    console.print(Text(f"engine: {eng['steps']} steps, busy {_f(eng['busy_s'], '{:.2f}')}s, idle "
                       f"{_f(eng['idle_s'], '{:.2f}')}s, mean batch {_f(eng['mean_batch'])}, "
                       f"drafted {eng['drafted']}, accepted {eng['accepted']}, α {_f(eng['alpha'])}", style="dim"))
    console.print(Panel(timeline(summary, records, min(160, console.width - 4)), title="timeline", border_style="dim"))

"""`agentrt inspect --html`: one self-contained HTML page (inline SVG and CSS, no scripts from
anywhere): a lane per node coloured by phase, the engine's batch-size and draft-length lanes,
and the α and stall tables. Hovering a bar shows its phase, times and engine-step details."""
from __future__ import annotations

import html
import json
from typing import Any

PHASE_COLORS = {
    "waiting": "#d9d9d9", "queued": "#f2c14e", "prefill": "#b05fd0", "decode": "#3fa34d", "preempted": "#e4572e",
    "tool_running": "#2e86ab", "tool_retried": "#f18f01", "tool_backoff": "#f6bd8b", "tool_failed": "#c0392b",
    "input_wait": "#8e7cc3",
}
LABEL_W, LANE_H, GAP, AXIS_H, PLOT_W = 260, 18, 4, 28, 1000


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


class _Scale:
    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.span = t0, max(t1 - t0, 1e-9)

    def x(self, t: float) -> float:
        return LABEL_W + PLOT_W * (t - self.t0) / self.span


def _axis(scale: _Scale, y: float, height: float) -> list[str]:
    out = []
    step = _nice_step(scale.span / 10)
    t = 0.0
    while t <= scale.span + 1e-12:
        x = scale.x(scale.t0 + t)
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + height}" class="grid"/>')
        out.append(f'<text x="{x:.1f}" y="{y - 6}" class="tick">{t:.{2 if step < 0.1 else 1}f}s</text>')
        t += step
    return out


def _nice_step(raw: float) -> float:
    for unit in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600):
        if unit >= raw:
            return unit
    return raw


def _node_lane(y: float, scale: _Scale, node: dict[str, Any], phases: list[dict[str, Any]]) -> list[str]:
    label = node["node"] if len(node["node"]) <= 34 else "…" + node["node"][-33:]
    cls = "label err" if node["status"] == "error" else "label"
    out = [f'<text x="{LABEL_W - 8}" y="{y + LANE_H - 5}" class="{cls}">{_e(label)}</text>']
    for p in phases:
        phase = p["attributes"]["agentrt.phase"]
        x0, x1 = scale.x(p["start"]), scale.x(p["end"])
        steps = [e["attributes"] for e in p.get("events", [])]
        detail = f"{node['node']}: {phase} {p['start']:.3f}s → {p['end']:.3f}s ({p['end'] - p['start']:.3f}s)"
        if steps:
            ks = [s.get("agentrt.k", 0) for s in steps]
            acc = [s.get("agentrt.accepted", 0) for s in steps]
            detail += f"\n{len(steps)} engine steps, drafted {sum(ks)}, accepted {sum(acc)}"
        if node.get("error") and phase in ("tool_failed", "decode", "queued"):
            detail += f"\nerror: {node['error']}"
        out.append(f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 1.5):.2f}" height="{LANE_H}" '
                   f'fill="{PHASE_COLORS.get(phase, "#999")}"><title>{_e(detail)}</title></rect>')
        for e in p.get("events", []):  # a tick per step that verified drafts, taller when more were accepted
            s, t = e["attributes"], e["time"]
            k = s.get("agentrt.k", 0)
            if k:
                h = LANE_H * (0.3 + 0.7 * s.get("agentrt.accepted", 0) / k)
                out.append(f'<line x1="{scale.x(t):.2f}" y1="{y + LANE_H}" x2="{scale.x(t):.2f}" '
                           f'y2="{y + LANE_H - h:.1f}" class="tick-k"/>')
    return out


def _engine_lanes(y: float, scale: _Scale, steps: list[dict[str, Any]], idle: list[dict[str, Any]]) -> list[str]:
    h = 3 * LANE_H
    max_b = max((s["batch_size"] for s in steps), default=1) or 1
    max_k = max((s.get("max_k", 0) for s in steps), default=0) or 1
    out = [f'<text x="{LABEL_W - 8}" y="{y + h / 2 + 4}" class="label b">engine batch (max {max_b})</text>',
           f'<text x="{LABEL_W - 8}" y="{y + h + GAP + h / 2 + 4}" class="label b">engine k (max {max_k})</text>']
    for r in idle:
        x0, x1 = scale.x(r["start"]), scale.x(r["end"])
        out.append(f'<rect x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.5):.2f}" height="{h}" class="idle">'
                   f'<title>idle {r["end"] - r["start"]:.3f}s</title></rect>')
    for s in steps:
        x0, x1 = scale.x(s["start"]), scale.x(s["end"])
        w = max(x1 - x0, 0.6)
        tip = (f"step {s['step']}: {1000 * (s['end'] - s['start']):.1f} ms, batch {s['batch_size']}, "
               f"{s['num_tokens']} tokens ({s.get('num_prefill_tokens', 0)} prefill), drafted {s.get('drafted', 0)}, "
               f"accepted {s.get('accepted', 0)}")
        bh = h * s["batch_size"] / max_b
        out.append(f'<rect x="{x0:.2f}" y="{y + h - bh:.1f}" width="{w:.2f}" height="{bh:.1f}" class="batch">'
                   f'<title>{_e(tip)}</title></rect>')
        kh = h * s.get("max_k", 0) / max_k
        if kh:
            out.append(f'<rect x="{x0:.2f}" y="{y + 2 * h + GAP - kh:.1f}" width="{w:.2f}" height="{kh:.1f}" '
                       f'class="k"><title>{_e(tip)}</title></rect>')
    return out


def _tables(summary: dict[str, Any]) -> str:
    parts = []
    for run in summary["runs"]:
        rows = "".join(
            f"<tr><td>{_e(n['node'])}</td><td>{n['usage']['input_tokens']}</td><td>{n['usage']['output_tokens']}</td>"
            f"<td>{n['spec']['drafted']}</td><td>{n['spec']['accepted']}</td><td>{n['spec']['forced']}</td>"
            f"<td>{_fmt(n['spec']['alpha'])}</td><td>{_fmt(n['spec']['alpha_free'])}</td>"
            f"<td>{_fmt(n['spec']['tokens_per_pass'])}</td></tr>"
            for n in run["nodes"] if n["kind"] == "llm")
        stalls = "".join(f"<tr><td>{_e(k)}</td><td>{v:.3f}</td></tr>" for k, v in run["stalls"].items())
        err = run.get("error")
        status = f"{run['status']}" + (f": {_e(err['message'])}" if err else "")
        out = run.get("output")
        parts.append(
            f"<h2>{_e(run['program'])} <small>{_e(run['run_id'])} · {status} · {run['duration_s']:.2f}s</small></h2>"
            f"<div class='row'><table><tr><th>LLM node</th><th>in</th><th>out</th><th>drafted</th><th>accepted</th>"
            f"<th>forced</th><th>α</th><th>α free</th><th>tok/pass</th></tr>{rows}</table>"
            f"<table><tr><th>stall</th><th>s</th></tr>{stalls}</table></div>"
            f"<pre>{_e(out if isinstance(out, str) else json.dumps(out, indent=2, ensure_ascii=False))}</pre>")
    return "".join(parts)


def render_html(summary: dict[str, Any], records: list[dict[str, Any]]) -> str:
    runs = summary["runs"]
    t0 = min((r["start"] for r in runs), default=0.0)
    t1 = max((r["end"] for r in runs), default=1.0)
    scale = _Scale(t0, t1)
    phases: dict[str, list[dict[str, Any]]] = {}
    node_span: dict[tuple[str, str], str] = {}
    for rec in records:
        if rec["type"] == "span" and rec["parent_id"] is not None:
            phases.setdefault(rec["parent_id"], []).append(rec)
        elif rec["type"] == "span":
            node_span[(rec["run_id"], rec["attributes"]["agentrt.node"])] = rec["span_id"]
    steps = [r for r in records if r["type"] == "engine_step" and r["end"] >= t0 and r["start"] <= t1]
    idle = [r for r in records if r["type"] == "engine_idle" and r["end"] >= t0 and r["start"] <= t1]
    y, body = AXIS_H, []
    for run in runs:
        if len(runs) > 1:
            body.append(f'<text x="4" y="{y + LANE_H - 5}" class="run">{_e(run["program"])} ({_e(run["run_id"])})</text>')
            y += LANE_H + GAP
        for n in run["nodes"]:
            body += _node_lane(y, scale, n, phases.get(node_span.get((run["run_id"], n["node"]), ""), []))
            y += LANE_H + GAP
    y += 2 * GAP
    body += _engine_lanes(y, scale, [dict(s) for s in steps], idle)
    height = y + 6 * LANE_H + 2 * GAP + 10
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + PLOT_W + 20}" height="{height}">',
           *_axis(scale, AXIS_H, height - AXIS_H), *body, "</svg>"]
    legend = "".join(f'<span class="sw" style="background:{c}"></span>{_e(p)} ' for p, c in PHASE_COLORS.items())
    title = _e(summary["trace"].get("name") or "agentrt trace")
    meta = _e(", ".join(f"{k}={v}" for k, v in summary["trace"].get("meta", {}).items()))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{title}</title><style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
.tick {{ font-size: 10px; fill: #666; text-anchor: middle; }}
.grid {{ stroke: #eee; }}
.label {{ font-size: 11px; text-anchor: end; fill: #333; font-family: monospace; }}
.label.err {{ fill: #c0392b; font-weight: bold; }} .label.b {{ font-weight: bold; }}
.run {{ font-weight: bold; font-size: 12px; }}
.batch {{ fill: #3b5ba5; }} .k {{ fill: #e0a800; }} .idle {{ fill: #f4f4f4; }}
.tick-k {{ stroke: #1b5e20; stroke-width: 1; }}
.sw {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 10px; vertical-align: middle; }}
table {{ border-collapse: collapse; margin: 6px 24px 6px 0; }}
td, th {{ border: 1px solid #ddd; padding: 2px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; font-family: monospace; }}
.row {{ display: flex; flex-wrap: wrap; align-items: flex-start; }}
pre {{ background: #f7f7f7; padding: 8px; white-space: pre-wrap; max-width: 1200px; }}
</style></head><body>
<h1>{title}</h1><div class="meta">{meta}</div>
<p>{legend}<span class="sw" style="background:#3b5ba5"></span>engine batch size
<span class="sw" style="background:#e0a800"></span>drafts per step (max k)</p>
{''.join(svg)}
{_tables(summary)}
</body></html>
"""

// The page `agentrt inspect --html` writes: reads the trace embedded in
// <script type="application/json" id="agentrt-trace"> and draws every run of it with the same
// renderers the console uses (header, graph, timeline, α table, tool table, output), the legend
// once. Inlined last into the page, after the modules it uses.
import { htmlEl, renderLegend } from "./phases.js";
import { viewsFromTrace } from "./model.js";
import { renderTimeline } from "./timeline.js";
import { renderDag } from "./dag.js";
import { renderAlphaTable, renderOutput, renderRunHeader, renderToolTable } from "./details.js";

// One titled box; `id` only for the first run, so ids stay unique on a page of several runs.
function standaloneSection(parent, title, cls, id) {
  const sec = htmlEl(parent, "section", { class: `av-section ${cls}` });
  htmlEl(sec, "h3", null, title);
  return htmlEl(sec, "div", { class: "av-section-body", id: id || null });
}

// A renderer that throws leaves a note in its box instead of a blank page.
function standaloneGuard(box, what, draw) {
  try {
    return draw();
  } catch (e) {
    console.error(`agentrt: drawing the ${what} failed`, e);
    htmlEl(box, "p", { class: "av-draw-error", role: "alert" }, `The ${what} could not be drawn: ${e.message}`);
    return null;
  }
}

export function renderRunSection(parent, view, first) {
  const id = (name) => (first ? name : null);
  const sec = htmlEl(parent, "article", { class: "av-run", id: `run-${view.run.run_id}`, "data-run-id": view.run.run_id,
    "data-status": view.run.status });
  const header = htmlEl(sec, "div", { class: "av-run-header" });
  standaloneGuard(header, "run header", () => renderRunHeader(header, view));
  const out = standaloneSection(sec, view.run.error ? "Error and output" : "Output", "av-sec-output", id("run-output"));
  standaloneGuard(out, "output", () => renderOutput(out, view));
  const dagBox = standaloneSection(sec, "Graph", "av-sec-dag", id("dag"));
  const tlBox = standaloneSection(sec, "Timeline", "av-sec-timeline", id("timeline"));
  // Clicking a node in one drawing marks it in the other.
  let dag = null, timeline = null;
  dag = standaloneGuard(dagBox, "graph", () => renderDag(dagBox, view, { onSelect: (n) => timeline?.select(n) }));
  timeline = standaloneGuard(tlBox, "timeline", () => renderTimeline(tlBox, view, { onSelect: (n) => dag?.select(n) }));
  const alpha = standaloneSection(sec, "LLM nodes: tokens and speculation", "av-sec-alpha", id("alpha-table"));
  standaloneGuard(alpha, "α table", () => renderAlphaTable(alpha, view));
  const tools = standaloneSection(sec, "Tool nodes", "av-sec-tools", id("tool-table"));
  standaloneGuard(tools, "tool table", () => renderToolTable(tools, view));
  return sec;
}

export function renderStandalone(root, data) {
  const summary = data.summary || null;
  const views = viewsFromTrace(data.records || [], summary);
  const trace = summary?.trace || {};
  const top = htmlEl(root, "header", { class: "av-page-header" });
  htmlEl(top, "h1", null, trace.name || views[0]?.run.program || "agentrt trace");
  const meta = Object.entries(trace.meta || {}).filter(([, v]) => v !== null && typeof v !== "object");
  if (meta.length) htmlEl(top, "p", { class: "av-meta" }, meta.map(([k, v]) => `${k}=${v}`).join(", "));
  if (typeof trace.wall_start === "number") {
    htmlEl(top, "p", { class: "av-meta" }, `recorded ${new Date(trace.wall_start * 1000).toISOString().replace("T", " ").slice(0, 19)} UTC`);
  }
  const legend = htmlEl(root, "div", { class: "av-legend-box" });
  renderLegend(legend);
  if (views.length > 1) { // several runs (a bench): a list to jump to each
    const nav = htmlEl(root, "nav", { class: "av-run-index", "aria-label": "runs in this trace" });
    const ol = htmlEl(nav, "ol");
    for (const v of views) {
      const li = htmlEl(ol, "li");
      htmlEl(li, "a", { href: `#run-${v.run.run_id}` }, `${v.run.program} ${v.run.run_id}`);
      htmlEl(li, "span", { class: `av-status st-${v.run.status}` }, ` ${v.run.status}`);
    }
  }
  if (!views.length) htmlEl(root, "p", { class: "av-empty" }, "This trace holds no finished program run.");
  views.forEach((v, i) => renderRunSection(root, v, i === 0));
}

function standaloneBoot() {
  const holder = typeof document !== "undefined" && document.getElementById("agentrt-trace");
  if (!holder) return; // imported by something other than the inspect page
  const root = document.getElementById("agentrt-root") || document.body;
  try {
    renderStandalone(root, JSON.parse(holder.textContent));
  } catch (e) {
    console.error("agentrt: could not draw the trace", e);
    htmlEl(root, "p", { class: "av-draw-error", role: "alert" }, `The trace could not be drawn: ${e.message}`);
  }
}

standaloneBoot();

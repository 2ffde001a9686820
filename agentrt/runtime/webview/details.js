// The tables and text around the drawings: the run header (status in words, duration, where the
// run's time went), the α table of the LLM nodes with each node's accepted-run histogram, the
// tool table, and the output or the error naming the node that failed.
import { ENGINE_COLORS, PHASE_COLORS, RUN_STATUS_ICONS, STATE_ICONS, fmtSec, htmlEl, svgEl, svgTitle } from "./phases.js";

// -- helpers --------------------------------------------------------------------------------------
function detailsDuration(view) {
  const run = view.run || {};
  if (typeof run.start !== "number") return null;
  const end = typeof run.end === "number" ? run.end : view.now;
  return typeof end === "number" ? Math.max(0, end - run.start) : null;
}

function detailsTable(container, cls, head) {
  const wrap = htmlEl(container, "div", { class: "av-table-wrap" });
  const table = htmlEl(wrap, "table", { class: `av-table ${cls}` });
  const tr = htmlEl(htmlEl(table, "thead"), "tr");
  for (const [label, title, cls] of head) htmlEl(tr, "th", { scope: "col", title: title || null, class: cls || null }, label);
  return htmlEl(table, "tbody");
}

function detailsCell(tr, text, attrs) {
  return htmlEl(tr, "td", attrs || null, text === null || text === undefined ? "–" : text);
}

function detailsRatio(x) {
  return typeof x === "number" && Number.isFinite(x) ? x.toFixed(2) : "–";
}

function phaseSeconds(n, names) {
  let total = 0;
  for (const p of n.phases || []) {
    if (!names.includes(p.phase)) continue;
    const end = typeof p.end === "number" ? p.end : p.start;
    total += Math.max(0, end - p.start);
  }
  return total;
}

// Union length of the node phases that `keep(node, phase)` picks (a live run has no summary yet).
function unionSeconds(nodes, keep, now) {
  const spans = [];
  for (const n of nodes) for (const p of n.phases || []) if (keep(n, p)) spans.push([p.start, p.end ?? now ?? p.start]);
  spans.sort((a, b) => a[0] - b[0]);
  let total = 0, cur = null;
  for (const [a, b] of spans) {
    if (cur && a <= cur[1]) cur[1] = Math.max(cur[1], b);
    else { if (cur) total += cur[1] - cur[0]; cur = [a, b]; }
  }
  return cur ? total + cur[1] - cur[0] : 0;
}

const LLM_ACTIVE_PHASES = ["queued", "prefill", "decode", "preempted", "prefill_ahead"];
const TOOL_ACTIVE_PHASES = ["tool_running", "tool_retried", "tool_backoff", "tool_failed"];

// The run's clock split four ways (summary.stalls; computed from the phases while live).
function clockSplit(view, duration) {
  const s = view.summary?.stalls;
  if (s) return { llm: s.llm_active_s, tool: s.tool_only_s, input: s.waiting_for_input_s ?? 0, neither: s.neither_s };
  const nodes = view.nodes || [];
  // An LLM call is in the engine from its queue to its end; a tool's queue is not the engine's.
  const inEngine = (n, p) => n.kind === "llm" && LLM_ACTIVE_PHASES.includes(p.phase);
  const toolRuns = (n, p) => n.kind === "tool" && TOOL_ACTIVE_PHASES.includes(p.phase);
  const llm = unionSeconds(nodes, inEngine, view.now);
  const both = unionSeconds(nodes, (n, p) => inEngine(n, p) || toolRuns(n, p), view.now);
  const asked = (n, p) => n.kind === "wait_for" && p.phase === "input_wait";
  const any = unionSeconds(nodes, (n, p) => inEngine(n, p) || toolRuns(n, p) || asked(n, p), view.now);
  return { llm, tool: Math.max(0, both - llm), input: Math.max(0, any - both), neither: Math.max(0, (duration ?? 0) - any) };
}

// -- the header -----------------------------------------------------------------------------------
export function renderRunHeader(container, view) {
  const run = view.run || {};
  const root = htmlEl(container, "div", { class: "av-header", "data-status": run.status });
  const h = htmlEl(root, "h2", { class: "av-run-title" });
  htmlEl(h, "span", { class: "av-program" }, run.program ?? "run");
  htmlEl(h, "code", { class: "av-run-id" }, run.run_id ?? "");
  htmlEl(h, "span", { class: `av-status st-${run.status}`, "data-status": run.status },
    `${RUN_STATUS_ICONS[run.status] || ""} ${run.status}`);
  const duration = detailsDuration(view);
  if (duration !== null) htmlEl(h, "span", { class: "av-duration" }, `${fmtSec(duration)}${run.end === null ? " so far" : ""}`);
  const meta = view.trace?.meta || {};
  // "dtype": what traces written before "precision" recorded
  const facts = ["model", "precision", "drafter", "policy", "device", "dtype"].filter((k) => meta[k] !== undefined && meta[k] !== null)
    .map((k) => `${k} ${meta[k]}`);
  if (facts.length) htmlEl(root, "p", { class: "av-meta" }, facts.join(" · "));
  if (duration) renderClockSplit(root, clockSplit(view, duration), duration);
  const s = view.summary?.stalls;
  if (s) {
    const parts = [["waiting on LLM nodes", s.waiting_on_llm_s], ["waiting on tools", s.waiting_on_tool_s],
      ["waiting on input", s.waiting_on_input_s], ["waiting, other", s.waiting_other_s], ["LLM queued", s.queued_llm_s], ["tools queued", s.queued_tool_s],
      ["preempted", s.preempted_s], ["tool backoff", s.tool_backoff_s]].filter(([, v]) => v);
    if (parts.length) {
      htmlEl(root, "p", { class: "av-stalls", title: "summed over nodes: they wait side by side, so this may exceed the duration" },
        `summed over nodes: ${parts.map(([k, v]) => `${k} ${fmtSec(v)}`).join(" · ")}`);
    }
  }
  const warnings = view.summary?.warnings || [];
  if (warnings.length) {
    const ul = htmlEl(root, "ul", { class: "av-warnings" });
    for (const w of warnings) htmlEl(ul, "li", null, `⚠ ${w}`);
  }
  for (const loop of view.summary?.loops || []) {
    htmlEl(root, "p", { class: "av-loop" }, `agent loop ${loop.loop}: ${loop.ended} after ${loop.llm_steps ?? "?"} LLM and ${loop.tool_steps ?? "?"} tool steps`);
  }
  for (const n of (view.nodes || []).filter((x) => x.kind === "wait_for")) renderAnswer(root, n);
  return root;
}

// One wait_for node: its question, then who answered, how, after how long, and the value; or
// that it still waits.
function renderAnswer(root, n) {
  const input = n.input || {};
  const p = htmlEl(root, "p", { class: "av-answer", "data-node": n.id });
  htmlEl(p, "span", { class: "av-kind-badge kind-wait_for" }, "input");
  htmlEl(p, "code", null, n.id);
  htmlEl(p, "span", null, input.prompt ? ` asked “${input.prompt}”: ` : " asked for a value: ");
  if (n.status === "ok") {
    const waited = (n.phases || []).filter((ph) => ph.phase === "input_wait").reduce((t, ph) => t + ((ph.end ?? n.end) - ph.start), 0);
    htmlEl(p, "span", null, `answered${input.answered_by ? ` by ${input.answered_by}` : ""}${input.via ? ` via ${input.via}` : ""}` +
      `${waited > 0 ? ` after ${fmtSec(waited)}` : ""}: `);
    htmlEl(p, "code", { class: "av-answer-value" }, n.value ?? "null");
  } else {
    htmlEl(p, "span", null, n.end === null ? "waiting for the answer" : n.status);
  }
}

// A stacked bar of the run's clock with each part named and timed beside it.
function renderClockSplit(root, split, duration) {
  const parts = [["some LLM call in the engine", split.llm, ENGINE_COLORS.batch, "llm"],
    ["only tools running", split.tool, "#2e86ab", "tool"], ["waiting for input (a person or system)", split.input, PHASE_COLORS.input_wait, "input"],
    ["neither (runtime)", split.neither, "#bbbbbb", "neither"]];
  const fig = htmlEl(root, "div", { class: "av-split" });
  const bar = htmlEl(fig, "div", { class: "av-split-bar", role: "img",
    "aria-label": parts.map(([k, v]) => `${k} ${fmtSec(v)}`).join(", ") });
  const legend = htmlEl(fig, "ul", { class: "av-split-legend" });
  for (const [name, secs, colour, key] of parts) {
    const share = duration > 0 ? Math.max(0, (secs || 0) / duration) : 0;
    if (share > 0) htmlEl(bar, "span", { style: `width:${(share * 100).toFixed(2)}%;background:${colour}`, title: `${name}: ${fmtSec(secs)}`, "data-part": key });
    const li = htmlEl(legend, "li", { "data-part": key });
    htmlEl(li, "span", { class: "av-swatch", style: `background:${colour}`, "aria-hidden": "true" });
    htmlEl(li, "span", null, `${name} ${fmtSec(secs)} (${(share * 100).toFixed(0)}%)`);
  }
}

// -- the α table ----------------------------------------------------------------------------------
// Bars of {accepted count: steps}: how often a verifying step kept 0, 1, 2 … of its drafts.
function runHistogramSvg(parent, hist) {
  const keys = Object.keys(hist || {}).map(Number).filter(Number.isFinite);
  if (!keys.length) { htmlEl(parent, "span", { class: "av-muted" }, "no drafts"); return; }
  const maxKey = Math.max(...keys), bins = [];
  for (let k = 0; k <= maxKey; k++) bins.push(hist[k] || 0);
  const top = Math.max(...bins), bw = 10, h = 26;
  const svg = svgEl(parent, "svg", { class: "av-hist", width: bins.length * bw + 2, height: h + 11, role: "img",
    "aria-label": bins.map((c, k) => `${k} accepted: ${c} steps`).join(", ") });
  bins.forEach((c, k) => {
    const bh = c ? Math.max(1.5, (h * c) / top) : 0;
    const r = svgEl(svg, "rect", { x: 1 + k * bw, y: h - bh, width: bw - 2, height: bh, fill: ENGINE_COLORS.accepted });
    svgTitle(r, `${k} drafts accepted: ${c} step${c === 1 ? "" : "s"}`);
    svgEl(svg, "text", { x: 1 + k * bw + (bw - 2) / 2, y: h + 10, class: "av-hist-label" }, k);
  });
}

const ALPHA_HEAD = [["node"], ["in", "prompt tokens"], ["cached", "prompt tokens read from the prefix cache"],
  ["out", "generated tokens"], ["drafted", "drafted tokens verified"], ["accepted", "drafted tokens accepted"],
  ["forced", "tokens the grammar forced (drafted for free)"], ["α", "accepted / drafted"],
  ["α free", "α over the tokens the grammar did not force"], ["α forced", "α over the forced tokens"],
  ["tok/pass", "tokens per target model pass"], ["accepted-run histogram", "steps by how many drafts they accepted", "txt"]];

export function renderAlphaTable(container, view) {
  const llms = (view.nodes || []).filter((n) => n.kind === "llm");
  if (!llms.length) { htmlEl(container, "p", { class: "av-empty alpha-table" }, "no LLM nodes"); return; }
  const body = detailsTable(container, "alpha-table", ALPHA_HEAD);
  body.parentElement.setAttribute("aria-label", "speculation per LLM node");
  const total = { in: 0, cached: 0, out: 0, drafted: 0, accepted: 0, forced: 0, passes: 0 };
  for (const n of llms) {
    const l = n.llm || {};
    const tr = htmlEl(body, "tr", { "data-node": n.id, "data-status": n.status });
    htmlEl(tr, "th", { scope: "row", title: n.error ? `error: ${n.error}` : n.status },
      `${n.status === "ok" ? "" : `${STATE_ICONS[n.status] || ""} `}${n.id}`);
    for (const k of ["input_tokens", "cached_input_tokens", "output_tokens", "drafted", "accepted", "forced"]) detailsCell(tr, l[k]);
    for (const k of ["alpha", "alpha_free", "alpha_forced"]) {
      const v = l[k]; // shown with 2 decimals even when whole ("1.00"), so the column lines up
      // The raw number for whoever reads the page (tests, scripts); "" when there were no drafts.
      detailsCell(tr, detailsRatio(v), { "data-alpha": typeof v === "number" ? String(v) : "", "data-metric": k });
    }
    detailsCell(tr, detailsRatio(l.tokens_per_pass));
    runHistogramSvg(htmlEl(tr, "td", { class: "av-hist-cell" }), l.run_hist);
    total.in += l.input_tokens || 0; total.cached += l.cached_input_tokens || 0; total.out += l.output_tokens || 0;
    total.drafted += l.drafted || 0; total.accepted += l.accepted || 0; total.forced += l.forced || 0;
    total.passes += l.target_passes || 0;
  }
  if (llms.length > 1) { // the run as a whole, as the terminal report's "all" row
    const tr = htmlEl(body, "tr", { class: "av-total" });
    htmlEl(tr, "th", { scope: "row" }, "all");
    for (const v of [total.in, total.cached, total.out, total.drafted, total.accepted, total.forced]) detailsCell(tr, v);
    detailsCell(tr, total.drafted ? detailsRatio(total.accepted / total.drafted) : "–");
    detailsCell(tr, "");
    detailsCell(tr, "");
    detailsCell(tr, total.passes ? detailsRatio(total.out / total.passes) : "–");
    detailsCell(tr, "");
  }
}

// -- the tool table -------------------------------------------------------------------------------
const TOOL_HEAD = [["node"], ["tool", null, "txt"], ["attempts"], ["latency", "first attempt to the end, backoff included"],
  ["queued", "ready, before the first attempt"], ["status", null, "txt"], ["error / result", null, "txt"]];

export function renderToolTable(container, view) {
  const tools = (view.nodes || []).filter((n) => n.kind === "tool");
  if (!tools.length) { htmlEl(container, "p", { class: "av-empty tool-table" }, "no tool nodes"); return; }
  const body = detailsTable(container, "tool-table", TOOL_HEAD);
  for (const n of tools) {
    const tr = htmlEl(body, "tr", { "data-node": n.id, "data-status": n.status });
    htmlEl(tr, "th", { scope: "row" }, n.id);
    detailsCell(tr, n.tool, { class: "txt" });
    const retried = (n.retries || []).length;
    detailsCell(tr, n.attempts ?? "–", { title: retried ? (n.retries || []).map((r) => `attempt ${r.attempt} failed${r.error ? `: ${r.error}` : ""}`).join("\n") : null });
    const running = phaseSeconds(n, TOOL_ACTIVE_PHASES);
    detailsCell(tr, running || (n.end !== null && n.phases?.length) ? fmtSec(running) : "–"); // no phases: not known
    detailsCell(tr, n.phases?.length ? fmtSec(phaseSeconds(n, ["queued"])) : "–");
    detailsCell(tr, `${STATE_ICONS[n.status] || ""} ${n.status}`, { class: `txt st-${n.status}` });
    if (n.error) detailsCell(tr, n.error, { class: "av-error-text" });
    else { // the result's start; all of it on hover and under "node values"
      const v = n.value === null || n.value === undefined ? "" : String(n.value);
      detailsCell(tr, v.length > 160 ? `${v.slice(0, 159)}…` : v, { class: "av-value", title: v || null });
    }
  }
}

// -- the output -----------------------------------------------------------------------------------
function outputText(value) {
  if (value === null || value === undefined) return null;
  if (typeof value === "string") return value;
  try { return JSON.stringify(value, null, 2); } catch (e) { return String(value); }
}

export function renderOutput(container, view) {
  const run = view.run || {};
  const root = htmlEl(container, "div", { class: "av-output-box" });
  if (run.error) {
    const err = htmlEl(root, "div", { class: "run-error", role: "alert" });
    htmlEl(err, "strong", null, `${STATE_ICONS.error} failed`);
    if (run.error.node) { htmlEl(err, "span", null, " at node "); htmlEl(err, "code", null, run.error.node); }
    htmlEl(err, "pre", { class: "av-error-text" }, run.error.message ?? "(no message)");
  }
  const text = outputText(run.output);
  if (text !== null) htmlEl(root, "pre", { class: "av-output" }, text);
  else if (!run.error) {
    const say = { done: "(no output)", cancelled: "cancelled: no output", queued: "queued: not started yet",
      waiting: "waiting for an input value" }[run.status] || "running: the output comes when the run ends";
    htmlEl(root, "p", { class: "av-muted" }, say);
  }
  // Every node's value or error, folded: what each step gave the next.
  const nodes = (view.nodes || []).filter((n) => n.value !== null && n.value !== undefined || n.error);
  if (nodes.length) {
    const det = htmlEl(root, "details", { class: "av-node-values" });
    htmlEl(det, "summary", null, `node values (${nodes.length})`);
    const dl = htmlEl(det, "dl");
    for (const n of nodes) {
      htmlEl(dl, "dt", { "data-node": n.id }, `${STATE_ICONS[n.status] || ""} ${n.id}`);
      htmlEl(dl, "dd", { class: n.error ? "av-error-text" : null }, n.error ? `error: ${n.error}` : String(n.value));
    }
  }
  return root;
}

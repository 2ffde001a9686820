// The vocabulary every view shares: phase colours and meanings, node-state colours and icons,
// and the few DOM and number helpers the other renderer modules build on.
//
// This file is served as /view/phases.js by `agentrt serve` and inlined (imports and `export`
// keywords removed) into the page `agentrt inspect --html` writes, so: no imports here, and
// every top-level name must be unique across agentrt/runtime/webview/*.js.

// Phases of a node's life (agentrt/runtime/phases.py). The colours are the ones the Python-only
// page used, so old screenshots and new pages read the same.
export const PHASE_COLORS = {
  waiting: "#d9d9d9",
  queued: "#f2c14e",
  prefill_ahead: "#dcb8ea",
  prefill: "#b05fd0",
  decode: "#3fa34d",
  preempted: "#e4572e",
  tool_running: "#2e86ab",
  tool_retried: "#f18f01",
  tool_backoff: "#f6bd8b",
  tool_failed: "#c0392b",
  input_wait: "#8e7cc3",
  replayed: "#9aa5b1",
};

// Same texts as PHASES in agentrt/runtime/phases.py, plus the live-only "replayed".
export const PHASE_MEANINGS = {
  waiting: "inputs not done yet",
  queued: "ready, not started (engine queue / before the first attempt)",
  prefill_ahead: "computing the known start of the prompt while inputs are not done",
  prefill: "feeding the prompt",
  decode: "generating",
  preempted: "evicted from the batch, to be prefilled again",
  tool_running: "tool attempt that succeeded (or is running)",
  tool_retried: "tool attempt that failed and was retried",
  tool_backoff: "wait between tool attempts",
  tool_failed: "last tool attempt, failed",
  input_wait: "waiting for a value from outside the program",
  replayed: "outcome taken from the run store (a resumed run)",
};

// DAG node fill by state. Pale fills keep the black label text readable; the state is also
// written as a word with an icon (STATE_ICONS), so the colour is never the only signal.
export const STATE_COLORS = {
  pending: "#f4f4f4",
  waiting: "#e6e6e6",
  running: "#fff3cd",
  ok: "#d4edda",
  error: "#f8d7da",
  cancelled: "#e2e3e5",
};

export const STATE_ICONS = {
  pending: "○",
  waiting: "◔",
  running: "▶",
  ok: "✓",
  error: "✗",
  cancelled: "⊘",
};

// Engine lanes of the timeline (not phases, but shown in the same legend).
export const ENGINE_COLORS = {
  batch: "#3b5ba5",
  k: "#e0a800",
  drafted: "#c9d6ef",
  accepted: "#1b7f3a",
  idle: "#eeeeee",
  preempted: "#e4572e",
};

// The run statuses a header shows, each with an icon (queued … cancelled).
export const RUN_STATUS_ICONS = {
  queued: "◔",
  running: "▶",
  waiting: "‖", // a pause sign the common fonts have (U+23F8 is missing from DejaVu)
  done: "✓",
  failed: "✗",
  cancelled: "⊘",
};

export const SVG_NS = "http://www.w3.org/2000/svg";

// Small element builders: attributes as an object (null/undefined/false skipped), optional text.
// Everything is built with createElement/textContent, never innerHTML, so trace values (model
// output, tool errors) can hold any markup without being interpreted.
function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    node.setAttribute(k, v === true ? "" : String(v));
  }
  return node;
}

export function svgEl(parent, tag, attrs, text) {
  const node = setAttrs(document.createElementNS(SVG_NS, tag), attrs);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (parent) parent.appendChild(node);
  return node;
}

export function htmlEl(parent, tag, attrs, text) {
  const node = setAttrs(document.createElement(tag), attrs);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (parent) parent.appendChild(node);
  return node;
}

// A <title> child: the hover text of an SVG element (and what screen readers announce).
export function svgTitle(parent, text) {
  return svgEl(parent, "title", null, text);
}

// Durations: ms below a second (engine steps are ms-scale), seconds above, minutes for long runs.
export function fmtSec(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  const a = Math.abs(s);
  if (a < 0.001) return `${(s * 1000).toFixed(2)} ms`;
  if (a < 1) return `${(s * 1000).toFixed(a < 0.1 ? 1 : 0)} ms`;
  if (a < 120) return `${s.toFixed(2)} s`;
  const m = Math.floor(a / 60);
  return `${s < 0 ? "-" : ""}${m}m ${String(Math.round(a - 60 * m)).padStart(2, "0")}s`;
}

export function fmtNum(x, digits = 2) {
  if (x === null || x === undefined || !Number.isFinite(x)) return "–";
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}

// A label cut in the middle ("trips[12].wea…ather") so both the fan-out index and the node
// name stay visible; callers put the full text in a <title>.
export function clipMiddle(text, max) {
  const s = String(text);
  if (s.length <= max || max < 5) return s;
  const head = Math.ceil((max - 1) / 2);
  return s.slice(0, head) + "…" + s.slice(s.length - (max - 1 - head));
}

// One legend item: a swatch (colour) next to its name (words), the meaning as hover text.
function legendItem(list, colour, name, meaning, cls) {
  const li = htmlEl(list, "li", { title: meaning || null, class: cls || null });
  htmlEl(li, "span", { class: "av-swatch", style: `background:${colour}`, "aria-hidden": "true" });
  htmlEl(li, "span", { class: "av-legend-name" }, name);
  return li;
}

// The legend of the phases, the engine lanes and the DAG states: names written out next to
// every colour (colour is never the only signal), meanings on hover.
export function renderLegend(container) {
  const root = htmlEl(null, "div", { class: "av-legend" });
  const phases = htmlEl(root, "ul", { class: "av-legend-list", "aria-label": "node phases" });
  htmlEl(phases, "li", { class: "av-legend-head" }, "phases");
  for (const [name, colour] of Object.entries(PHASE_COLORS)) {
    legendItem(phases, colour, name, PHASE_MEANINGS[name], "av-legend-phase").dataset.phase = name;
  }
  const engine = htmlEl(root, "ul", { class: "av-legend-list", "aria-label": "engine lanes" });
  htmlEl(engine, "li", { class: "av-legend-head" }, "engine");
  legendItem(engine, ENGINE_COLORS.batch, "batch size", "sequences in each engine step");
  legendItem(engine, ENGINE_COLORS.k, "k (max drafts)", "the largest number of drafted tokens of a sequence in the step");
  legendItem(engine, ENGINE_COLORS.drafted, "drafted", "drafted tokens of the step, all sequences");
  legendItem(engine, ENGINE_COLORS.accepted, "accepted", "accepted drafted tokens of the step");
  legendItem(engine, ENGINE_COLORS.idle, "idle", "no engine step running");
  const states = htmlEl(root, "ul", { class: "av-legend-list", "aria-label": "graph node states" });
  htmlEl(states, "li", { class: "av-legend-head" }, "graph");
  for (const [name, colour] of Object.entries(STATE_COLORS)) {
    const li = legendItem(states, colour, `${STATE_ICONS[name]} ${name}`, null, "av-legend-state");
    li.dataset.state = name;
  }
  container.appendChild(root);
  return root;
}

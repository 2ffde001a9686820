// The run's timeline: one SVG, one time axis shared by a lane per node (its phases, a tick per
// engine step it took part in) and the engine lanes under them (batch size, k per step,
// accepted/drafted per step, idle gaps), so a stall in a node lines up with what the engine did
// at that moment. Zoom (buttons, ctrl+wheel, drag on the axis) is kept across update(view), so
// a live run can be redrawn many times a second while the user looks at one part of it.
import { ENGINE_COLORS, PHASE_COLORS, PHASE_MEANINGS, STATE_ICONS, clipMiddle, fmtNum, fmtSec, htmlEl, svgEl, svgTitle } from "./phases.js";
import { kindLabel } from "./model.js";

// padL: room left of time 0 so its tick label is not hidden under the label column.
const TL_GEOM = { laneH: 18, laneGap: 4, axisH: 30, engineH: 30, sectionGap: 16, padL: 12, padR: 14, minPlotW: 560, charW: 6.7 };
// [data-lane, name, what the scale's maximum counts]
const TL_ENGINE_LANES = [
  ["engine-batch", "batch size", "max"],
  ["engine-k", "k per step", "max"],
  ["engine-accepted", "accepted", "of drafted, max"],
];
let tlCounter = 0; // clip-path ids must be unique when a page holds several timelines

export function renderTimeline(container, view, opts = {}) {
  const root = htmlEl(null, "div", { class: "av-timeline" });
  const st = { view, opts, zoom: null, selected: null, geom: null, drag: null, id: ++tlCounter };
  const bar = htmlEl(root, "div", { class: "av-toolbar", role: "toolbar", "aria-label": "timeline zoom" });
  const button = (label, title, fn) => {
    htmlEl(bar, "button", { type: "button", title, "aria-label": title }, label).addEventListener("click", fn);
  };
  button("−", "zoom out", () => tlZoomBy(st, 2));
  button("+", "zoom in", () => tlZoomBy(st, 0.5));
  button("◀", "pan left", () => tlPan(st, -0.5));
  button("▶", "pan right", () => tlPan(st, 0.5));
  button("reset", "show the whole run", () => tlSetZoom(st, null));
  st.rangeLabel = htmlEl(bar, "span", { class: "av-range", "aria-live": "polite" });
  htmlEl(bar, "span", { class: "av-hint" }, "drag on the time axis to zoom · ctrl+wheel zooms · shift+wheel pans");
  st.box = htmlEl(root, "div", { class: "av-scroll av-tl-box" });
  st.tip = htmlEl(root, "div", { class: "av-tip", role: "tooltip", hidden: true });
  container.replaceChildren(root);
  tlWire(st);
  tlDraw(st);
  if (typeof ResizeObserver !== "undefined") { // the plot fills the box: redraw when its width changes
    let width = st.box.clientWidth;
    new ResizeObserver(() => {
      if (st.box.clientWidth !== width) { width = st.box.clientWidth; tlDraw(st); }
    }).observe(st.box);
  }
  return {
    update(next) { st.view = next; tlDraw(st); },
    select(id) { st.selected = id; tlMarkSelected(st); },
    zoom(t0, t1) { tlSetZoom(st, t0 === undefined ? null : [t0, t1]); },
  };
}

// [start, end] of the whole run; a live run's end is the latest time seen.
function tlFullRange(view) {
  const run = view?.run;
  if (!run || typeof run.start !== "number") return null;
  const end = typeof run.end === "number" ? run.end : Math.max(view.now ?? run.start, run.start);
  return [run.start, Math.max(end, run.start + 1e-3)];
}

function tlWindow(st, full) {
  if (!st.zoom) return full;
  const a = Math.max(st.zoom[0], full[0]), b = Math.min(st.zoom[1], full[1]);
  return b - a > 1e-9 ? [a, b] : full;
}

function tlSetZoom(st, z) {
  const full = tlFullRange(st.view);
  st.zoom = null;
  if (z && full) {
    let [a, b] = z;
    const fullSpan = full[1] - full[0];
    const minSpan = Math.max(fullSpan * 1e-5, 2e-5); // 20 µs: below one engine step
    if (b - a < minSpan) { const m = (a + b) / 2; a = m - minSpan / 2; b = m + minSpan / 2; }
    const span = b - a;
    if (span < fullSpan) {
      if (a < full[0]) { a = full[0]; b = a + span; }
      if (b > full[1]) { b = full[1]; a = b - span; }
      st.zoom = [a, b];
    }
  }
  tlDraw(st);
}

function tlZoomBy(st, factor, center) {
  const full = tlFullRange(st.view);
  if (!full) return;
  const [a, b] = tlWindow(st, full);
  const c = center ?? (a + b) / 2;
  tlSetZoom(st, [c - (c - a) * factor, c + (b - c) * factor]);
}

function tlPan(st, fraction) {
  if (!st.zoom) return;
  const d = (st.zoom[1] - st.zoom[0]) * fraction;
  tlSetZoom(st, [st.zoom[0] + d, st.zoom[1] + d]);
}

// 1, 2, 5 × 10^n seconds: tick steps a reader can add up.
function tlNiceStep(raw) {
  const p = 10 ** Math.floor(Math.log10(Math.max(raw, 1e-9)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function tlTicks(sc) {
  const step = tlNiceStep((sc.t1 - sc.t0) / Math.max(2, Math.floor(sc.plotW / 90)));
  // Below 0.1 s a step reads better in ms ("2.5ms", not "0.0025s").
  const [unit, mult] = step < 0.1 ? ["ms", 1000] : ["s", 1];
  const decimals = Math.max(0, Math.min(5, -Math.floor(Math.log10(step * mult) + 1e-9)));
  const first = Math.ceil((sc.t0 - sc.origin) / step - 1e-9);
  const out = [];
  for (let i = first; out.length < 200; i++) {
    const rel = i * step;
    if (sc.origin + rel > sc.t1 + step * 1e-6) break;
    out.push({ x: sc.x(sc.origin + rel), label: `${(rel * mult).toFixed(decimals)}${unit}` });
  }
  return out;
}

function tlDraw(st) {
  const { view, box } = st;
  const full = tlFullRange(view);
  const keepScroll = box.scrollLeft;
  if (!full) {
    box.replaceChildren(htmlEl(null, "p", { class: "av-empty" }, "The run has not started yet."));
    st.geom = null;
    st.rangeLabel.textContent = "";
    return;
  }
  const G = TL_GEOM;
  const [t0, t1] = tlWindow(st, full);
  const nodes = view.nodes || [];
  const avail = box.clientWidth || 1000;
  const longest = nodes.reduce((m, n) => Math.max(m, String(n.id).length), 16);
  // Narrow boxes give the plot the room: labels are cut in the middle (full id on hover).
  const labelW = Math.round(Math.min(Math.max(longest * G.charW + 34, 110), avail < 480 ? 124 : avail < 800 ? 160 : 250));
  const plotW = Math.max(avail - labelW - G.padR - 2, G.minPlotW);
  const x0 = labelW + G.padL, w = plotW - G.padL; // time t0 is drawn at x0, t1 at labelW + plotW
  const sc = { t0, t1, labelW, plotW, origin: full[0],
    x: (t) => x0 + ((t - t0) / (t1 - t0)) * w, t: (x) => t0 + ((x - x0) / w) * (t1 - t0) };
  sc.v0 = sc.t(labelW); // the time at the plot's left edge: zoomed in, bars run on into the padding
  const engineY = G.axisH + nodes.length * (G.laneH + G.laneGap) + G.sectionGap;
  const height = engineY + TL_ENGINE_LANES.length * (G.engineH + G.laneGap) + 4;
  const width = labelW + plotW + G.padR;
  const svg = svgEl(null, "svg", { class: "av-tl-svg", width, height, viewBox: `0 0 ${width} ${height}`,
    role: "group", "aria-label": `timeline of run ${view.run.run_id ?? ""}` });
  const clipId = `av-tl-clip-${st.id}`, defs = svgEl(svg, "defs");
  svgEl(svgEl(defs, "clipPath", { id: clipId }), "rect", { x: labelW, y: 0, width: plotW, height });
  // Hatching for "no data": engine time a live page did not see (not idle, not busy: unknown).
  const hatch = svgEl(defs, "pattern", { id: `${clipId}-nodata`, patternUnits: "userSpaceOnUse", width: 6, height: 6, patternTransform: "rotate(45)" });
  svgEl(hatch, "rect", { width: 6, height: 6, fill: "#fbfbfb" });
  svgEl(hatch, "line", { x1: 0, y1: 0, x2: 0, y2: 6, stroke: "#d6d6d6", "stroke-width": 2 });
  const ticks = tlTicks(sc);
  const grid = svgEl(svg, "g", { class: "grid", "aria-hidden": "true" });
  for (const tk of ticks) svgEl(grid, "line", { x1: tk.x, x2: tk.x, y1: G.axisH, y2: height });
  const critical = new Set(view.critical || []);
  nodes.forEach((n, i) => tlNodeLane(svg, n, G.axisH + i * (G.laneH + G.laneGap), sc, view, clipId, critical.has(n.id), st.selected));
  if (!nodes.length) svgEl(svg, "text", { class: "av-note", x: labelW + 8, y: G.axisH + 14 }, "no LLM or tool node yet");
  const steps = tlEngineLanes(svg, view, sc, engineY, clipId);
  tlAxis(svg, sc, ticks);
  st.cursor = svgEl(svg, "line", { class: "cursor", y1: G.axisH - 4, y2: height, x1: -10, x2: -10, visibility: "hidden" });
  st.sel = svgEl(svg, "rect", { class: "zoom-sel", x: 0, y: 0, width: 0, height, visibility: "hidden" });
  box.replaceChildren(svg);
  box.scrollLeft = keepScroll;
  const stepByNum = new Map(steps.map((s) => [s.step, s]));
  // own: a node's steps by time, built on the first hover over its lane (not on every move)
  st.geom = { sc, svg, nodes, engineY, height, steps, stepByNum, own: new Map() };
  const zoomed = st.zoom !== null;
  st.rangeLabel.textContent = `${(t0 - full[0]).toFixed(3)}–${(t1 - full[0]).toFixed(3)} s` +
    (zoomed ? ` (zoomed; run ${fmtSec(full[1] - full[0])})` : ` (whole run${view.run.end === null ? " so far" : ""})`);
}

function tlRel(t, origin) {
  return `${(t - origin).toFixed(3)}s`;
}

function tlPhaseText(n, p, end, origin) {
  let text = `${n.id}: ${p.phase} ${tlRel(p.start, origin)}→${tlRel(end, origin)} (${fmtSec(end - p.start)})` +
    (p.end === null ? ", still going" : "") + `\n${PHASE_MEANINGS[p.phase] || ""}`;
  const steps = (p.steps || []).filter((s) => !s.preempted);
  if (steps.length) {
    const drafted = steps.reduce((a, s) => a + (s.k || 0), 0), accepted = steps.reduce((a, s) => a + (s.accepted || 0), 0);
    text += `\n${steps.length} engine steps, drafted ${drafted}, accepted ${accepted}`;
  }
  if (n.error && ["tool_failed", "decode", "queued", "prefill"].includes(p.phase) && p === n.phases[n.phases.length - 1]) {
    text += `\nerror: ${n.error}`;
  }
  return text;
}

// A label column that stays in view when the box scrolls sideways (CSS moves .av-sticky by the
// box's scrollLeft); its background hides the bars scrolling under it.
function tlStickyLabel(parent, sc, y, h) {
  const g = svgEl(parent, "g", { class: "av-sticky lane-label" });
  svgEl(g, "rect", { class: "label-bg", x: 0, y, width: sc.labelW, height: h });
  return g;
}

function tlNodeLane(svg, n, y, sc, view, clipId, critical, selected) {
  const G = TL_GEOM;
  const cls = ["lane", critical ? "critical" : null, n.id === selected ? "selected" : null].filter(Boolean).join(" ");
  const g = svgEl(svg, "g", { class: cls, "data-lane": "node", "data-node": n.id, "data-status": n.status, "data-kind": n.kind });
  svgEl(g, "rect", { class: "lane-bg", x: sc.labelW, y: y - G.laneGap / 2, width: sc.plotW, height: G.laneH + G.laneGap });
  const bars = svgEl(g, "g", { "clip-path": `url(#${clipId})` });
  const now = Math.max(view.now ?? sc.t1, n.start ?? sc.v0);
  for (const p of n.phases || []) {
    const end = typeof p.end === "number" ? p.end : Math.max(now, p.start);
    if (end < sc.v0 || p.start > sc.t1) continue;
    const x0 = sc.x(Math.max(p.start, sc.v0)), x1 = sc.x(Math.min(end, sc.t1));
    const r = svgEl(bars, "rect", { class: p.end === null ? "phase open" : "phase", "data-phase": p.phase, x: x0, y,
      width: Math.max(x1 - x0, 1), height: G.laneH, fill: PHASE_COLORS[p.phase] || "#999" });
    svgTitle(r, tlPhaseText(n, p, end, sc.origin));
  }
  // A tick per step that verified drafts, taller when more were accepted; one per pixel at most.
  let lastX = -Infinity;
  for (const p of n.phases || []) {
    for (const s of p.steps || []) {
      if (!(s.k > 0) || s.time < sc.v0 || s.time > sc.t1) continue;
      const x = sc.x(s.time);
      if (x - lastX < 1.5) continue;
      lastX = x;
      const h = G.laneH * (0.3 + 0.7 * Math.min(1, (s.accepted || 0) / s.k));
      svgEl(bars, "line", { class: "step-tick", x1: x, x2: x, y1: y + G.laneH, y2: y + G.laneH - h });
    }
  }
  for (const r of n.retries || []) { // failed attempts (a live tool shows no retry phases yet)
    if (typeof r.time !== "number" || r.time < sc.v0 || r.time > sc.t1) continue;
    const m = svgEl(bars, "path", { class: "retry-mark", d: `M${sc.x(r.time)},${y - 1} l-4,-4 h8 z` });
    svgTitle(m, `${n.id}: attempt ${r.attempt} failed${r.error ? `: ${r.error}` : ""}`);
  }
  const label = tlStickyLabel(g, sc, y - G.laneGap / 2, G.laneH + G.laneGap);
  const icon = STATE_ICONS[n.status] || "";
  svgEl(label, "text", { class: `lane-state st-${n.status}`, x: 6, y: y + G.laneH - 5 }, icon);
  const maxChars = Math.max(6, Math.floor((sc.labelW - 30) / G.charW));
  svgEl(label, "text", { class: "lane-name", x: sc.labelW - 8, y: y + G.laneH - 5 }, clipMiddle(n.id, maxChars));
  const kind = kindLabel(n.kind, n.tool);
  svgTitle(label, `${n.id} (${kind}): ${n.status}${critical ? ", on the critical path" : ""}` +
    (n.start !== null && n.end !== null ? `, ${fmtSec(n.end - n.start)}` : "") + (n.error ? `\nerror: ${n.error}` : ""));
  if (critical) svgEl(label, "rect", { class: "critical-mark", x: 0, y: y, width: 3, height: G.laneH });
}

// Bars of one value per engine step. Steps narrower than a pixel are merged per pixel column
// (the tallest wins), so a run of thousands of steps stays a few hundred elements.
function tlBars(parent, steps, sc, value, max, y, h, fill) {
  let col = null, best = 0;
  const flush = () => {
    if (col !== null && best > 0) svgEl(parent, "rect", { x: col, y: y + h - (h * best) / max, width: 1, height: (h * best) / max, fill });
    col = null; best = 0;
  };
  for (const s of steps) {
    const v = value(s) || 0;
    const x0 = sc.x(Math.max(s.start, sc.v0)), x1 = sc.x(Math.min(s.end, sc.t1));
    if (x1 - x0 >= 1.5) {
      flush();
      if (v > 0) svgEl(parent, "rect", { x: x0, y: y + h - (h * v) / max, width: x1 - x0, height: (h * v) / max, fill });
      continue;
    }
    const c = Math.floor(x0);
    if (c !== col) { flush(); col = c; }
    best = Math.max(best, v);
  }
  flush();
}

function tlEngineLanes(svg, view, sc, y0, clipId) {
  const G = TL_GEOM;
  const all = view.engine?.steps || [];
  const steps = all.filter((s) => s.end >= sc.v0 && s.start <= sc.t1);
  // Scales over the whole run (not the zoomed window), so bar heights do not jump when zooming.
  const maxOf = (f) => all.reduce((m, s) => Math.max(m, f(s) || 0), 0);
  const maxB = maxOf((s) => s.batch_size) || 1, maxK = maxOf((s) => s.max_k) || 1, maxD = maxOf((s) => s.drafted) || 1;
  const scales = { "engine-batch": maxB, "engine-k": maxK, "engine-accepted": maxD };
  TL_ENGINE_LANES.forEach(([key, name, scaleText], i) => {
    const y = y0 + i * (G.engineH + G.laneGap);
    const g = svgEl(svg, "g", { class: "lane engine", "data-lane": key });
    svgEl(g, "rect", { class: "lane-bg engine-bg", x: sc.labelW, y, width: sc.plotW, height: G.engineH });
    const bars = svgEl(g, "g", { "clip-path": `url(#${clipId})` });
    for (const r of view.engine?.nodata || []) {
      if (r.end < sc.v0 || r.start > sc.t1) continue;
      const x0 = sc.x(Math.max(r.start, sc.v0)), x1 = sc.x(Math.min(r.end, sc.t1));
      const why = r.why === "dropped" ? "older engine steps were dropped to save memory"
        : "the page did not receive these engine steps (it opened later, or its connection dropped)";
      svgTitle(svgEl(bars, "rect", { class: "nodata", x: x0, y, width: Math.max(x1 - x0, 0.5), height: G.engineH,
        fill: `url(#${clipId}-nodata)` }), `no engine data ${fmtSec(r.end - r.start)} (${tlRel(r.start, sc.origin)}→${tlRel(r.end, sc.origin)}): ${why}`);
      if (i === 0 && x1 - x0 > 70) svgEl(bars, "text", { class: "av-note nodata-note", x: x0 + 6, y: y + 18 }, "no data");
    }
    for (const r of view.engine?.idle || []) {
      if (r.end < sc.v0 || r.start > sc.t1) continue;
      const x0 = sc.x(Math.max(r.start, sc.v0)), x1 = sc.x(Math.min(r.end, sc.t1));
      svgTitle(svgEl(bars, "rect", { class: "idle", x: x0, y, width: Math.max(x1 - x0, 0.5), height: G.engineH,
        fill: ENGINE_COLORS.idle }), `engine idle ${fmtSec(r.end - r.start)} (${tlRel(r.start, sc.origin)}→${tlRel(r.end, sc.origin)})`);
    }
    if (key === "engine-batch") {
      tlBars(bars, steps, sc, (s) => s.batch_size, maxB, y, G.engineH, ENGINE_COLORS.batch);
      for (const s of steps) {
        const x0 = sc.x(Math.max(s.start, sc.v0)), x1 = sc.x(Math.min(s.end, sc.t1));
        if (s.preempted > 0) svgEl(bars, "rect", { class: "preempt-mark", x: x0, y, width: Math.max(x1 - x0, 2), height: 4, fill: ENGINE_COLORS.preempted });
        // Zoomed in far enough to see a step: where the cost model expected it to end.
        if (x1 - x0 >= 8 && typeof s.predicted_s === "number") {
          const xp = sc.x(s.start + s.predicted_s);
          svgEl(bars, "line", { class: "pred-mark", x1: xp, x2: xp, y1: y, y2: y + G.engineH });
        }
      }
    } else if (key === "engine-k") {
      tlBars(bars, steps, sc, (s) => s.max_k, maxK, y, G.engineH, ENGINE_COLORS.k);
    } else {
      tlBars(bars, steps, sc, (s) => s.drafted, maxD, y, G.engineH, ENGINE_COLORS.drafted);
      tlBars(bars, steps, sc, (s) => s.accepted, maxD, y, G.engineH, ENGINE_COLORS.accepted);
    }
    const label = tlStickyLabel(g, sc, y, G.engineH);
    svgEl(label, "text", { class: "lane-name engine-name", x: sc.labelW - 8, y: y + 13 }, name);
    svgEl(label, "text", { class: "lane-max", x: sc.labelW - 8, y: y + 25 }, `${scaleText} ${scales[key]}`);
  });
  if (!all.length && !(view.engine?.nodata || []).length) svgEl(svg, "text", { class: "av-note", x: sc.labelW + 8, y: y0 + 18 }, "no engine steps recorded");
  return steps;
}

function tlAxis(svg, sc, ticks) {
  const G = TL_GEOM;
  const g = svgEl(svg, "g", { class: "axis", "data-axis": "time" });
  svgEl(g, "rect", { class: "axis-band", x: sc.labelW, y: 0, width: sc.plotW, height: G.axisH });
  svgEl(g, "line", { class: "axis-line", x1: sc.labelW, x2: sc.labelW + sc.plotW, y1: G.axisH - 2, y2: G.axisH - 2 });
  for (const tk of ticks) {
    svgEl(g, "line", { class: "axis-tick", x1: tk.x, x2: tk.x, y1: G.axisH - 7, y2: G.axisH - 2 });
    // A label at the very left would hide half under the label column: it starts at its tick.
    const start = tk.x - sc.labelW < 22;
    svgEl(g, "text", { class: "axis-label", x: tk.x, y: G.axisH - 11, "text-anchor": start ? "start" : null }, tk.label);
  }
  const corner = tlStickyLabel(svg, sc, 0, G.axisH - 2);
  svgEl(corner, "text", { class: "axis-caption", x: sc.labelW - 8, y: G.axisH - 11 }, "since run start");
}

// The pointer's position in SVG coordinates, and whether it is over the (sticky) label column.
function tlPoint(st, e) {
  const r = st.geom.svg.getBoundingClientRect();
  const x = e.clientX - r.left, y = e.clientY - r.top;
  const inLabels = e.clientX - st.box.getBoundingClientRect().left < st.geom.sc.labelW;
  return { x, y, inLabels };
}

function tlWire(st) {
  const { box } = st;
  box.addEventListener("scroll", () => box.style.setProperty("--av-sx", `${box.scrollLeft}px`), { passive: true });
  box.addEventListener("pointermove", (e) => {
    if (!st.geom) return;
    const p = tlPoint(st, e);
    const { sc } = st.geom;
    if (st.drag) {
      const a = Math.max(Math.min(st.drag.x, p.x), sc.labelW), b = Math.min(Math.max(st.drag.x, p.x), sc.labelW + sc.plotW);
      st.sel.setAttribute("x", a); st.sel.setAttribute("width", Math.max(b - a, 0)); st.sel.setAttribute("visibility", "visible");
    }
    if (p.inLabels || p.x > sc.labelW + sc.plotW) { tlHideHover(st); return; }
    st.cursor.setAttribute("x1", p.x); st.cursor.setAttribute("x2", p.x); st.cursor.setAttribute("visibility", "visible");
    tlHover(st, e, p);
  });
  box.addEventListener("pointerleave", () => tlHideHover(st));
  box.addEventListener("pointerdown", (e) => {
    if (!st.geom || e.button !== 0) return;
    const p = tlPoint(st, e);
    if (p.y > TL_GEOM.axisH || p.inLabels) return;
    st.drag = { x: p.x };
    box.setPointerCapture?.(e.pointerId);
    e.preventDefault();
  });
  box.addEventListener("pointerup", (e) => {
    if (!st.drag || !st.geom) return;
    const p = tlPoint(st, e), { sc } = st.geom, x0 = st.drag.x;
    st.drag = null;
    st.sel.setAttribute("visibility", "hidden");
    if (Math.abs(p.x - x0) > 4) tlSetZoom(st, [sc.t(Math.min(p.x, x0)), sc.t(Math.max(p.x, x0))]);
  });
  box.addEventListener("dblclick", (e) => { if (st.geom && tlPoint(st, e).y <= TL_GEOM.axisH) tlSetZoom(st, null); });
  box.addEventListener("wheel", (e) => {
    if (!st.geom) return;
    const p = tlPoint(st, e);
    if (e.ctrlKey || e.metaKey || (p.y <= TL_GEOM.axisH && !p.inLabels)) {
      e.preventDefault();
      const t = p.inLabels ? undefined : st.geom.sc.t(p.x);
      tlZoomBy(st, e.deltaY > 0 ? 1.25 : 0.8, t);
    } else if (e.shiftKey && st.zoom) {
      e.preventDefault();
      const d = e.deltaX || e.deltaY;
      tlPan(st, Math.sign(d) * Math.min(0.25, Math.abs(d) / st.geom.sc.plotW));
    }
  }, { passive: false });
  box.addEventListener("click", (e) => {
    const lane = e.target.closest?.("[data-lane=node]");
    if (!lane || !st.geom) return;
    st.selected = lane.dataset.node;
    tlMarkSelected(st);
    st.opts.onSelect?.(st.selected);
  });
}

function tlMarkSelected(st) {
  if (!st.geom) return;
  for (const lane of st.geom.svg.querySelectorAll("[data-lane=node]")) {
    lane.classList.toggle("selected", lane.dataset.node === st.selected);
  }
}

function tlHideHover(st) {
  st.tip.hidden = true;
  st.cursor?.setAttribute("visibility", "hidden");
}

// The step nearest time t among steps sorted by start, if within tolerance seconds.
function tlNearestStep(steps, t, tolerance, startOf = (s) => s.start, endOf = (s) => s.end) {
  let lo = 0, hi = steps.length - 1, i = -1;
  while (lo <= hi) { const mid = (lo + hi) >> 1; if (startOf(steps[mid]) <= t) { i = mid; lo = mid + 1; } else hi = mid - 1; }
  let best = null, bestD = tolerance;
  for (const j of [i - 1, i, i + 1]) {
    const s = steps[j];
    if (!s) continue;
    const d = t < startOf(s) ? startOf(s) - t : t > endOf(s) ? t - endOf(s) : 0;
    if (d <= bestD) { best = s; bestD = d; }
  }
  return best;
}

function tlHover(st, e, p) {
  const G = TL_GEOM, { sc, engineY, nodes, steps, stepByNum } = st.geom;
  const perPx = (sc.t1 - sc.v0) / sc.plotW, t = sc.t(p.x);
  const rows = [];
  if (p.y >= engineY - G.laneGap) {
    const s = tlNearestStep(steps, t, 3 * perPx);
    if (s) tlStepRows(rows, s, sc.origin);
  } else if (p.y >= G.axisH) {
    const n = nodes[Math.floor((p.y - G.axisH + G.laneGap / 2) / (G.laneH + G.laneGap))];
    let own = n ? st.geom.own.get(n.id) : [];
    if (!own) {
      own = (n.phases || []).flatMap((ph) => (ph.steps || []).map((s) => ({ ...s, phase: ph.phase }))).sort((a, b) => a.time - b.time);
      st.geom.own.set(n.id, own);
    }
    const s = tlNearestStep(own, t, 4 * perPx, (x) => x.time, (x) => x.time);
    if (s) {
      rows.push([`${n.id}`, `step ${s.step ?? "?"} (${s.phase})`]);
      rows.push(["this node", s.preempted ? "preempted" : `k ${s.k}, accepted ${s.accepted}, ${s.num_new} new tokens`]);
      const eng = stepByNum.get(s.step);
      if (eng) tlStepRows(rows, eng, sc.origin);
    }
  }
  if (!rows.length) { st.tip.hidden = true; return; }
  const dl = htmlEl(null, "dl");
  for (const [k, v] of rows) { htmlEl(dl, "dt", null, k); htmlEl(dl, "dd", null, v); }
  st.tip.replaceChildren(dl);
  st.tip.hidden = false;
  const root = st.tip.parentElement.getBoundingClientRect();
  const w = st.tip.offsetWidth, h = st.tip.offsetHeight;
  let left = e.clientX - root.left + 14;
  if (left + w > root.width) left = Math.max(0, e.clientX - root.left - w - 14);
  st.tip.style.left = `${left}px`;
  st.tip.style.top = `${Math.max(0, e.clientY - root.top - h - 12)}px`;
}

// What a demanding reader asks of an engine step: measured vs the cost model's prediction, the
// batch, and per sequence the drafts proposed and kept.
function tlStepRows(rows, s, origin) {
  const ms = (x) => (typeof x === "number" ? `${(x * 1000).toFixed(2)} ms` : "–");
  const measured = s.end - s.start;
  let pred = ms(s.predicted_s);
  if (typeof s.predicted_s === "number" && s.predicted_s > 0) {
    const diff = (measured / s.predicted_s - 1) * 100;
    pred += ` (measured ${Math.abs(diff).toFixed(0)}% ${diff >= 0 ? "over" : "under"})`;
  }
  rows.push(["engine step", `${s.step} at ${tlRel(s.start, origin)}`]);
  rows.push(["measured", ms(measured)]);
  rows.push(["predicted", pred]);
  rows.push(["batch", `${s.batch_size} sequences${s.preempted ? `, ${s.preempted} preempted` : ""}`]);
  rows.push(["tokens", `${s.num_tokens ?? "–"} (${s.num_prefill_tokens ?? 0} prefill), kv ${s.kv_tokens ?? "–"}`]);
  rows.push(["drafted / accepted", `${s.drafted ?? 0} / ${s.accepted ?? 0}, max k ${s.max_k ?? 0}, draft ${ms(s.draft_s)}`]);
  rows.push(["k per sequence", Array.isArray(s.ks) ? s.ks.join(" ") || "–" : "not recorded"]);
  rows.push(["accepted per sequence", Array.isArray(s.accepted_ks) ? s.accepted_ks.join(" ") || "–" : "not recorded"]);
  if (s.drafted) rows.push(["α of the step", fmtNum(s.accepted / s.drafted)]);
}

// The run's graph as a layered drawing, left to right: a node's layer is its longest path from
// a source, its place in the layer follows the mean place of its parents (a few sweeps each way
// to uncross edges). Every node says its state in words and an icon, not only by its fill.
// Traces from before graphs were recorded get a graph rebuilt from the nodes that ran, with an
// edge from what each node waited on last, and say so.
import { STATE_COLORS, STATE_ICONS, clipMiddle, fmtSec, htmlEl, svgEl, svgTitle } from "./phases.js";
import { EXEC_KINDS, kindLabel } from "./model.js";

const DAG_GEOM = { nodeW: 184, nodeH: 54, colGap: 58, rowGap: 14, pad: 14, charW: 6.9 };
let dagCounter = 0; // arrow-marker ids must be unique per page

export function renderDag(container, view, opts = {}) {
  const root = htmlEl(null, "div", { class: "av-dag" });
  const st = { view, opts, selected: null, id: ++dagCounter };
  st.box = htmlEl(root, "div", { class: "av-scroll av-dag-box" });
  st.caption = htmlEl(root, "p", { class: "av-caption" });
  container.replaceChildren(root);
  dagDraw(st);
  st.box.addEventListener("click", (e) => {
    const node = e.target.closest?.(".dag-node");
    if (!node) return;
    st.selected = node.dataset.node;
    dagMarkSelected(st);
    st.opts.onSelect?.(st.selected);
  });
  st.box.addEventListener("keydown", (e) => {
    const node = e.target.closest?.(".dag-node");
    if (node && (e.key === "Enter" || e.key === " ")) { e.preventDefault(); node.dispatchEvent(new MouseEvent("click", { bubbles: true })); }
  });
  return {
    update(next) { st.view = next; dagDraw(st); },
    select(id) { st.selected = id; dagMarkSelected(st); },
  };
}

// The graph to draw: the recorded one, or one rebuilt from the node list (old traces).
function dagGraph(view) {
  if (view.graph && view.graph.nodes && view.graph.nodes.length) return { ...view.graph, recorded: true };
  const nodes = (view.nodes || []).map((n) => ({ id: n.id, kind: n.kind, label: kindLabel(n.kind, n.tool), tool: n.tool }));
  const ids = new Set(nodes.map((n) => n.id));
  const edges = (view.nodes || []).filter((n) => n.waited_on !== null && n.waited_on !== undefined && ids.has(n.waited_on))
    .map((n) => ({ source: n.waited_on, target: n.id }));
  return { nodes, edges, recorded: false };
}

// The layout: layer = longest path from a source; an edge spanning several layers passes
// through a virtual node in each layer between (so it runs in a slot of its own instead of
// across the boxes); within a layer, nodes sit at the mean place of their neighbours in the
// layer before (then after), a few sweeps each way. Returns {layer, pos, layers, rows, routes}:
// routes maps "source\0target" to the virtual ids the edge goes through.
export function layoutDag(nodes, edges) {
  const ids = nodes.map((n) => n.id);
  const parents = new Map(ids.map((id) => [id, []])), children = new Map(ids.map((id) => [id, []]));
  const kept = edges.filter((e) => parents.has(e.target) && children.has(e.source) && e.source !== e.target);
  for (const e of kept) { parents.get(e.target).push(e.source); children.get(e.source).push(e.target); }
  // Kahn's order; a node left over (a cycle, which a program graph never has) goes last.
  const indeg = new Map(ids.map((id) => [id, parents.get(id).length]));
  const queue = ids.filter((id) => indeg.get(id) === 0), topo = [];
  while (queue.length) {
    const id = queue.shift();
    topo.push(id);
    for (const c of children.get(id)) { indeg.set(c, indeg.get(c) - 1); if (indeg.get(c) === 0) queue.push(c); }
  }
  const placed = new Set(topo);
  for (const id of ids) if (!placed.has(id)) topo.push(id);
  const layer = new Map();
  for (const id of topo) layer.set(id, Math.max(-1, ...parents.get(id).map((p) => layer.get(p) ?? -1)) + 1);
  const layers = [];
  for (const id of ids) (layers[layer.get(id)] ||= []).push(id); // declaration order to start with
  const routes = new Map();
  for (const e of kept) {
    const a = layer.get(e.source), b = layer.get(e.target);
    if (b - a < 2) continue;
    const chain = [];
    let prev = e.source; // the direct link gives way to the chain (for the ordering sweeps too)
    children.get(e.source).splice(children.get(e.source).indexOf(e.target), 1);
    parents.get(e.target).splice(parents.get(e.target).indexOf(e.source), 1);
    for (let l = a + 1; l < b; l++) {
      const v = `\u0001${e.source}\u0000${e.target}\u0000${l}`;
      layer.set(v, l);
      layers[l].push(v);
      parents.set(v, [prev]);
      children.set(v, []);
      children.get(prev).push(v);
      chain.push(v);
      prev = v;
    }
    children.get(prev).push(e.target);
    parents.get(e.target).push(prev);
    routes.set(`${e.source}\u0000${e.target}`, chain);
  }
  for (let l = 0; l < layers.length; l++) layers[l] ||= [];
  const rows = Math.max(1, ...layers.map((l) => l.length));
  const pos = new Map(); // centred slot: index + half the room a shorter layer leaves
  const index = (l) => l.forEach((id, i) => pos.set(id, i + (rows - l.length) / 2));
  const sweep = (order, nbrs) => {
    for (const li of order) {
      const l = layers[li];
      const key = new Map(l.map((id) => {
        const ns = nbrs.get(id).filter((n) => pos.has(n));
        return [id, ns.length ? ns.reduce((a, n) => a + pos.get(n), 0) / ns.length : pos.get(id)];
      }));
      l.sort((x, y) => key.get(x) - key.get(y));
      index(l);
    }
  };
  layers.forEach(index);
  const down = layers.map((_, i) => i).slice(1), up = layers.map((_, i) => i).reverse().slice(1);
  for (let round = 0; round < 3; round++) { sweep(down, parents); sweep(up, children); }
  sweep(down, parents);
  return { layer, pos, layers, rows, routes };
}

// A node's state: executable nodes from their NodeView, the others from the graph's own state.
function dagState(gn, nv) {
  if (nv) return ["waiting", "running", "ok", "error", "cancelled"].includes(nv.status) ? nv.status : "running";
  switch (gn.state) {
    case "done": return "ok";
    case "failed": return "error";
    case "running": return "running";
    case "cancelled": return "cancelled";
    default: return "pending";
  }
}

// Critical nodes and edges: the view's path, plus the bookkeeping nodes (items, fan-outs)
// between two of its nodes, found by a search through non-executable nodes only.
function dagCritical(graph, critical, execIds) {
  const nodes = new Set(critical), edges = new Set();
  const out = new Map();
  for (const e of graph.edges) (out.get(e.source) || out.set(e.source, []).get(e.source)).push(e.target);
  for (let i = 0; i + 1 < critical.length; i++) {
    const from = critical[i], to = critical[i + 1];
    const prev = new Map([[from, null]]), queue = [from];
    while (queue.length && !prev.has(to)) {
      const u = queue.shift();
      for (const v of out.get(u) || []) {
        if (prev.has(v) || (v !== to && execIds.has(v))) continue;
        prev.set(v, u);
        queue.push(v);
      }
    }
    for (let v = prev.has(to) ? to : null; v !== null && prev.get(v) !== null; v = prev.get(v)) {
      nodes.add(v);
      edges.add(`${prev.get(v)}\u0000${v}`);
    }
  }
  return { nodes, edges };
}

function dagDraw(st) {
  const { view, box } = st;
  const G = DAG_GEOM;
  const graph = dagGraph(view);
  if (!graph.nodes.length) {
    const waiting = view.run?.status === "queued" || (view.run && typeof view.run.start !== "number");
    box.replaceChildren(htmlEl(null, "p", { class: "av-empty" }, waiting ? "The graph comes when the run starts." : "no graph recorded"));
    st.caption.textContent = "";
    return;
  }
  const { layer, pos, layers, rows, routes } = layoutDag(graph.nodes, graph.edges);
  const width = G.pad * 2 + layers.length * G.nodeW + (layers.length - 1) * G.colGap;
  const height = G.pad * 2 + rows * G.nodeH + (rows - 1) * G.rowGap;
  const at = (id) => ({ x: G.pad + layer.get(id) * (G.nodeW + G.colGap), y: G.pad + pos.get(id) * (G.nodeH + G.rowGap) });
  const byId = new Map((view.nodes || []).map((n) => [n.id, n]));
  const execIds = new Set(graph.nodes.filter((n) => EXEC_KINDS.includes(n.kind)).map((n) => n.id));
  const crit = dagCritical(graph, view.critical || [], execIds);
  const svg = svgEl(null, "svg", { class: "av-dag-svg", width, height, viewBox: `0 0 ${width} ${height}`, role: "group",
    "aria-label": `graph of run ${view.run?.run_id ?? ""}` });
  const marker = `av-arrow-${st.id}`;
  const defs = svgEl(svg, "defs");
  for (const [suffix, cls] of [["", "arrow"], ["-crit", "arrow critical"]]) {
    // userSpaceOnUse: the same arrow size on a thick (critical) edge as on a thin one
    const m = svgEl(defs, "marker", { id: marker + suffix, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 9, markerHeight: 9,
      markerUnits: "userSpaceOnUse", orient: "auto-start-reverse" });
    svgEl(m, "path", { class: cls, d: "M0,0 L10,5 L0,10 z" });
  }
  const edgeLayer = svgEl(svg, "g", { class: "dag-edges" });
  for (const e of graph.edges) {
    if (!layer.has(e.source) || !layer.has(e.target)) continue;
    const d = dagEdgePath(at, e, routes.get(`${e.source}\u0000${e.target}`) || []);
    const isCrit = crit.edges.has(`${e.source}\u0000${e.target}`);
    const cls = ["dag-edge", e.control ? "control" : null, isCrit ? "critical" : null].filter(Boolean).join(" ");
    const path = svgEl(edgeLayer, "path", { class: cls, d,
      "marker-end": `url(#${marker}${isCrit ? "-crit" : ""})`, "data-source": e.source, "data-target": e.target });
    svgTitle(path, `${e.source} → ${e.target}${e.control ? " (control: the branch decision)" : ""}`);
  }
  const nodeLayer = svgEl(svg, "g", { class: "dag-nodes" });
  for (const gn of graph.nodes) dagNode(nodeLayer, gn, byId.get(gn.id), at(gn.id), crit.nodes.has(gn.id), st.selected);
  box.replaceChildren(svg);
  const counts = {};
  for (const el of svg.querySelectorAll(".dag-node")) counts[el.dataset.state] = (counts[el.dataset.state] || 0) + 1;
  const tally = Object.entries(counts).map(([s, n]) => `${n} ${s}`).join(", ");
  st.caption.textContent = `${graph.nodes.length} nodes (${tally}), ${graph.edges.length} edges` +
    (view.critical?.length ? "; thick outline: critical path" : "") +
    (graph.recorded ? "" : ". No graph recorded in this trace: drawn from the nodes that ran, an edge from what each waited on last.");
}

// From the source's right side to the target's left, through the slot of each virtual node on
// the way (straight across a slot, curves between), every tangent horizontal.
function dagEdgePath(at, e, chain) {
  const G = DAG_GEOM, a = at(e.source), b = at(e.target);
  const pts = [[a.x + G.nodeW, a.y + G.nodeH / 2]];
  for (const v of chain) { const p = at(v); pts.push([p.x, p.y + G.nodeH / 2], [p.x + G.nodeW, p.y + G.nodeH / 2]); }
  pts.push([b.x, b.y + G.nodeH / 2]);
  let d = `M${pts[0][0]},${pts[0][1]}`;
  for (let i = 1; i < pts.length; i++) {
    const [x1, y1] = pts[i - 1], [x2, y2] = pts[i];
    if (i % 2 === 0) { d += ` L${x2},${y2}`; continue; } // across a virtual node's slot
    const dx = Math.max((x2 - x1) / 2, 20);
    d += ` C${x1 + dx},${y1} ${x2 - dx},${y2} ${x2},${y2}`;
  }
  return d;
}

function dagNode(parent, gn, nv, p, critical, selected) {
  const G = DAG_GEOM;
  const state = dagState(gn, nv);
  const cls = ["dag-node", `kind-${gn.kind}`, critical ? "critical" : null, gn.template ? "template" : null,
    gn.id === selected ? "selected" : null].filter(Boolean).join(" ");
  const g = svgEl(parent, "g", { class: cls, "data-node": gn.id, "data-kind": gn.kind || "", "data-state": state,
    transform: `translate(${p.x},${p.y})`, tabindex: 0, role: "button" });
  const round = gn.kind === "input" ? G.nodeH / 2 : gn.kind === "branch" ? 2 : 6;
  svgEl(g, "rect", { class: "dag-box", width: G.nodeW, height: G.nodeH, rx: round, fill: STATE_COLORS[state] || "#fff" });
  const chars = Math.floor((G.nodeW - 16) / G.charW);
  svgEl(g, "text", { class: "dag-id", x: 8, y: 17 }, clipMiddle(gn.id, chars));
  const ran = dagRanSeconds(nv);
  const dur = ran === null ? "" : ` · ${fmtSec(ran)}`;
  svgEl(g, "text", { class: `dag-state st-${state}`, x: 8, y: 32 }, `${STATE_ICONS[state]} ${state}${dur}`);
  const what = gn.kind === "tool" ? `tool ${gn.tool || nv?.tool || ""}` : gn.label || gn.kind || "?";
  svgEl(g, "text", { class: "dag-kind", x: 8, y: 47 }, clipMiddle(what, chars + 3));
  const lines = [gn.id, gn.label || gn.kind, `state: ${state}${critical ? " (critical path)" : ""}`];
  if (gn.template) lines.push("template: a fan-out body not expanded");
  if (gn.kind === "wait_for") lines.push(...answerLines(gn, nv));
  if (gn.cases) lines.push(`cases: ${gn.cases.map((c) => c.label ?? c.equals ?? (c.default ? "default" : "?")).join(", ")}`);
  if (ran !== null) lines.push(`ran ${fmtSec(ran)} (after ${fmtSec(nv.end - nv.start - ran)} waiting for its inputs)`);
  if (nv?.error) lines.push(`error: ${nv.error}`);
  svgTitle(g, lines.join("\n"));
}

// A wait_for node's question and, once given, who answered, how, and the value.
function answerLines(gn, nv) {
  const input = nv?.input || {};
  const out = [`asks: ${input.prompt ?? gn.prompt ?? "(no question)"}`];
  if (input.answered_at) out.push(`answered${input.answered_by ? ` by ${input.answered_by}` : ""} via ${input.via ?? "?"}`);
  if (nv?.status === "ok" && nv.value !== null && nv.value !== undefined) out.push(`value: ${nv.value}`);
  return out;
}

// How long a node ran: from its first phase after "waiting" to its end (the waiting is the
// inputs' time, shown by the nodes before it).
function dagRanSeconds(nv) {
  if (!nv || typeof nv.end !== "number" || !nv.phases?.length) return null; // no phases: not known
  const first = (nv.phases || []).find((p) => p.phase !== "waiting");
  return first ? Math.max(0, nv.end - first.start) : 0;
}

function dagMarkSelected(st) {
  for (const el of st.box.querySelectorAll(".dag-node")) el.classList.toggle("selected", el.dataset.node === st.selected);
}

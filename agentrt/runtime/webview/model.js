// The data every view draws: a RunView per program run, built either from a saved trace
// (viewsFromTrace here: records + summary, what `inspect --html` and an ended run's page show) or
// from the live events of a run (LiveView, live.js). Both produce the same shape, so a live run
// and its saved trace look alike, and the live view is swapped for the trace-built one when it ends.
//
// RunView = {run: {run_id, program, status, start, end, inputs, output, error},
//            graph: {nodes, edges} | null, nodes: [NodeView], engine: {steps, idle, nodata (live)},
//            critical: [node ids], summary: summary.runs entry | null, now, trace: {name, meta} | null}
// NodeView = {id, kind, tool, status, error, start, end, phases: [{phase, start, end, steps}],
//             attempts, retries, text, value, waited_on, llm, input}
// input (wait_for nodes): {prompt, schema, answered_by, via, asked_at, answered_at}
// All times are seconds on the trace clock. Old traces lack fields (no `graph`, no `ks`):
// every reader here tolerates a missing field instead of failing the whole page.

// Node kinds that run (a lane in the timeline, a row in the tables); the other graph kinds
// (input, item, fan_out, branch, agent_loop ...) are bookkeeping of the graph. A wait_for node
// runs nothing: its lane is the time the run waited for a value from outside (dag.EXEC_KINDS).
export const EXEC_KINDS = ["llm", "tool", "wait_for"];

// How a node's kind is named where it is shown (lanes, boxes, tooltips).
export function kindLabel(kind, tool) {
  if (kind === "tool") return `tool ${tool || ""}`.trim();
  if (kind === "wait_for") return "waits for input";
  return kind || "?";
}
const PREVIEW_CHARS = 300; // as summary.PREVIEW_CHARS

// A node's value as the summary previews it: text as is, else JSON, cut to PREVIEW_CHARS.
export function previewValue(value) {
  if (value === null || value === undefined) return null;
  let text;
  try {
    text = typeof value === "string" ? value : JSON.stringify(value);
  } catch (e) {
    text = String(value);
  }
  return text.length <= PREVIEW_CHARS ? text : text.slice(0, PREVIEW_CHARS - 1) + "…";
}

// JSON lines -> records. Split on "\n" only: U+2028 may sit inside a JSON string.
export function parseJsonl(text) {
  const out = [];
  for (const line of String(text).split("\n")) {
    if (line.trim()) out.push(JSON.parse(line));
  }
  return out;
}

// {nodes, edges} with the fields the views read, or null when there is no usable graph.
export function normGraph(graph) {
  if (!graph || !Array.isArray(graph.nodes)) return null;
  const nodes = graph.nodes.filter((n) => n && n.id !== undefined).map((n) => ({ ...n, id: String(n.id) }));
  const ids = new Set(nodes.map((n) => n.id));
  const edges = (graph.edges || []).filter((e) => e && ids.has(String(e.source)) && ids.has(String(e.target)))
    .map((e) => ({ ...e, source: String(e.source), target: String(e.target) }));
  return { nodes, edges };
}

// An engine_step span event (or a live `step` event) as a NodeView step.
export function nodeStep(a, time) {
  const step = { step: a["agentrt.step"] ?? a.step ?? null, time, k: a["agentrt.k"] ?? a.k ?? 0,
    accepted: a["agentrt.accepted"] ?? a.accepted ?? 0, batch_size: a["agentrt.batch_size"] ?? a.batch_size ?? null,
    num_new: a["agentrt.num_new"] ?? a.num_new ?? 0 };
  if (a["agentrt.preempted"]) step.preempted = true;
  return step;
}

// {accepted count: number of steps}: how many drafted tokens each verifying step kept (steps
// that drafted nothing are not runs of speculation and are left out).
function runHistogram(phases) {
  const hist = {};
  for (const p of phases) {
    for (const s of p.steps) {
      if (s.k > 0 && !s.preempted) hist[s.accepted] = (hist[s.accepted] || 0) + 1;
    }
  }
  return hist;
}

const SPEC_KEYS = ["drafted", "accepted", "forced", "alpha", "alpha_free", "alpha_forced", "target_passes", "tokens_per_pass"];

export function llmFromTrace(a, sumNode, phases) {
  const usage = sumNode?.usage || { input_tokens: a["gen_ai.usage.input_tokens"],
    cached_input_tokens: a["gen_ai.usage.cache_read.input_tokens"], output_tokens: a["gen_ai.usage.output_tokens"] };
  const spec = sumNode?.spec || Object.fromEntries(SPEC_KEYS.map((k) => [k, a[`agentrt.spec.${k}`]]));
  const llm = { input_tokens: usage.input_tokens ?? null, cached_input_tokens: usage.cached_input_tokens ?? null,
    output_tokens: usage.output_tokens ?? null };
  for (const k of SPEC_KEYS) llm[k] = spec[k] ?? null;
  llm.run_hist = runHistogram(phases);
  return llm;
}

// A live LLM node's figures from its steps so far (the trace's exact ones replace them at the
// end): prefill steps' new tokens are the prompt, decode steps' the output.
export function llmFromSteps(node) {
  let input = 0, output = 0, drafted = 0, accepted = 0, passes = 0;
  for (const p of node.phases) {
    for (const s of p.steps) {
      if (s.preempted) continue;
      if (p.phase === "prefill") input += s.num_new || 0;
      else { output += s.num_new || 0; passes += 1; }
      drafted += s.k || 0;
      accepted += s.accepted || 0;
    }
  }
  const alpha = drafted ? accepted / drafted : null;
  return { input_tokens: input || null, cached_input_tokens: null, output_tokens: output || null, drafted, accepted,
    forced: null, alpha, alpha_free: null, alpha_forced: null, target_passes: passes,
    tokens_per_pass: passes ? output / passes : null, run_hist: runHistogram(node.phases) };
}

function nodeFromSpan(span, phaseSpans, sumNode) {
  const a = span.attributes || {};
  const id = String(a["agentrt.node"] ?? sumNode?.node ?? span.span_id);
  const kind = a["agentrt.node.kind"] || sumNode?.kind || "llm";
  const phases = phaseSpans.slice().sort((x, y) => x.start - y.start).map((p) => ({
    phase: p.attributes?.["agentrt.phase"] || p.name, start: p.start, end: p.end,
    steps: (p.events || []).filter((e) => e.name === "engine_step").map((e) => nodeStep(e.attributes || {}, e.time)),
  }));
  // Attempts that failed and were tried again, as the live node_retried events say: from the
  // node's attempt log (a trace written before it had one: from the retried phases alone).
  const retried = phases.filter((p) => p.phase === "tool_retried");
  const log = Array.isArray(a["agentrt.tool.attempt_log"]) ? a["agentrt.tool.attempt_log"].filter((r) => !r.ok && !r.not_retried) : null;
  const retries = log ? log.map((r, i) => ({ attempt: r.attempt, error_kind: r.error_kind ?? null, error: r.error ?? null,
    time: retried[Math.min(i, retried.length - 1)]?.end ?? null }))
    : retried.map((p, i) => ({ attempt: i + 1, error_kind: null, error: null, time: p.end }));
  return {
    id, kind, tool: a["gen_ai.tool.name"] ?? sumNode?.tool ?? null,
    status: span.status || "ok", error: span.error ?? sumNode?.error ?? null, start: span.start, end: span.end,
    phases, attempts: kind === "tool" ? (a["agentrt.tool.attempts"] ?? sumNode?.attempts ?? null) : null, retries,
    text: null, value: sumNode?.value ?? previewValue(a["agentrt.value"] ?? a["gen_ai.tool.call.result"]),
    waited_on: sumNode?.waited_on ?? a["agentrt.waited_on"] ?? null,
    llm: kind === "llm" ? llmFromTrace(a, sumNode, phases) : null,
    input: kind === "wait_for" ? {
      prompt: a["agentrt.input.prompt"] ?? sumNode?.prompt ?? null, schema: a["agentrt.input.schema"] ?? sumNode?.schema ?? null,
      answered_by: a["agentrt.input.answered_by"] ?? sumNode?.answered_by ?? null, via: a["agentrt.input.via"] ?? sumNode?.via ?? null,
      asked_at: a["agentrt.input.asked_at"] ?? sumNode?.asked_at ?? null, answered_at: a["agentrt.input.answered_at"] ?? sumNode?.answered_at ?? null,
    } : null,
  };
}

// The critical path: from the node that ended last, follow what each node waited on last back
// to the start. When the chain leaves the executable nodes (an input, a fan-out item), that
// graph node is kept as the path's head so the DAG can mark where it began.
export function criticalPath(nodes, graph) {
  const byId = new Map(nodes.map((n) => [n.id, n]));
  let cur = null;
  for (const n of nodes) if (n.end !== null && n.end !== undefined && (!cur || n.end > cur.end)) cur = n;
  const path = [];
  const seen = new Set();
  while (cur && !seen.has(cur.id)) {
    seen.add(cur.id);
    path.unshift(cur.id);
    const w = cur.waited_on;
    if (w === null || w === undefined) break;
    cur = byId.get(w);
    if (!cur && graph && graph.nodes.some((g) => g.id === w)) path.unshift(w);
  }
  return path;
}

function clipIdle(idle, start, end) {
  return idle.filter((r) => r.end > start && r.start < end)
    .map((r) => ({ start: Math.max(r.start, start), end: Math.min(r.end, end) }));
}

// Engine steps overlapping [start, end], by start time.
function stepsIn(steps, start, end) {
  return steps.filter((s) => s.end >= start && s.start <= end);
}

function runFromTrace(prog, ctx, sumRun) {
  const sumNodes = new Map((sumRun?.nodes || []).map((n) => [n.node, n]));
  const graph = normGraph(prog.graph);
  const order = new Map((graph?.nodes || []).map((n, i) => [n.id, i]));
  const nodes = ctx.spans.filter((s) => s.run_id === prog.run_id && (s.parent_id === null || s.parent_id === undefined))
    .map((s) => nodeFromSpan(s, ctx.kids.get(s.span_id) || [], sumNodes.get(s.attributes?.["agentrt.node"])));
  // "In the order they appeared": by creation time; ties (nodes created together with the run)
  // in declaration order, else by ready time as the summary sorts them. Nothing here depends on
  // the summary being given, so every page shows the same trace's lanes in the same order.
  const ready = (n) => n.phases.find((p) => p.phase !== "waiting")?.start ?? n.end ?? n.start;
  const rank = (n) => order.get(n.id) ?? Infinity;
  const nodeViews = nodes.sort((a, b) => a.start - b.start || (rank(a) - rank(b) || 0) || ready(a) - ready(b) ||
    (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  const start = prog.start, end = prog.end ?? ctx.traceEnd ?? start;
  return {
    run: { run_id: prog.run_id, program: prog.program, status: prog.status || "done", start, end,
      inputs: prog.inputs ?? null, output: prog.output ?? null, error: prog.error ?? null },
    graph, nodes: nodeViews,
    engine: { steps: stepsIn(ctx.steps, start, end), idle: clipIdle(ctx.idle, start, end) },
    critical: criticalPath(nodeViews, graph),
    summary: sumRun || null,
    now: end,
    trace: ctx.trace,
  };
}

// [RunView] of every program run in a trace. summary (summarize(records)) is optional: the
// figures it holds are read from the records when it is missing.
export function viewsFromTrace(records, summary) {
  const recs = (records || []).filter((r) => r && typeof r === "object");
  const header = recs.find((r) => r.type === "trace") || {};
  const spans = recs.filter((r) => r.type === "span");
  const kids = new Map();
  for (const s of spans) {
    if (s.parent_id === null || s.parent_id === undefined) continue;
    if (!kids.has(s.parent_id)) kids.set(s.parent_id, []);
    kids.get(s.parent_id).push(s);
  }
  const ctx = {
    spans, kids,
    steps: recs.filter((r) => r.type === "engine_step").sort((a, b) => a.start - b.start),
    idle: recs.filter((r) => r.type === "engine_idle"),
    traceEnd: recs.find((r) => r.type === "trace_end")?.end ?? null,
    trace: { name: header.name ?? null, meta: header.meta || {} },
  };
  const sumRuns = new Map((summary?.runs || []).map((r) => [r.run_id, r]));
  return recs.filter((r) => r.type === "program").map((p) => runFromTrace(p, ctx, sumRuns.get(p.run_id)));
}

// Gaps of at least minGap between busy intervals within [start, end] (trace.idle_gaps).
export function idleGaps(steps, start, end, minGap = 0.001) {
  const gaps = [];
  let t = start;
  for (const s of steps) {
    if (s.end < start) continue; else if (s.start > end) break;
    if (s.start - t >= minGap) gaps.push({ start: t, end: Math.min(s.start, end) });
    t = Math.max(t, s.end);
  }
  if (end - t >= minGap) gaps.push({ start: t, end });
  return gaps.filter((g) => g.end > g.start);
}

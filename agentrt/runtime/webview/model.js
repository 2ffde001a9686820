// The data every view draws: a RunView per program run, built either from a saved trace
// (viewsFromTrace: records + summary, what `inspect --html` and an ended run's page show) or
// from the live events of a run (LiveView). Both produce the same shape, so a live run and its
// saved trace look alike, and the live view is swapped for the trace-built one when it ends.
//
// RunView = {run: {run_id, program, status, start, end, inputs, output, error},
//            graph: {nodes, edges} | null, nodes: [NodeView], engine: {steps, idle, nodata (live)},
//            critical: [node ids], summary: summary.runs entry | null, now, trace: {name, meta} | null}
// NodeView = {id, kind, tool, status, error, start, end, phases: [{phase, start, end, steps}],
//             attempts, retries, text, value, waited_on, llm}
// All times are seconds on the trace clock. Old traces lack fields (no `graph`, no `ks`):
// every reader here tolerates a missing field instead of failing the whole page.

// Node kinds that run (a lane in the timeline, a row in the tables); the other graph kinds
// (input, item, fan_out, branch, agent_loop ...) are bookkeeping of the graph.
export const EXEC_KINDS = ["llm", "tool"];
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
function normGraph(graph) {
  if (!graph || !Array.isArray(graph.nodes)) return null;
  const nodes = graph.nodes.filter((n) => n && n.id !== undefined).map((n) => ({ ...n, id: String(n.id) }));
  const ids = new Set(nodes.map((n) => n.id));
  const edges = (graph.edges || []).filter((e) => e && ids.has(String(e.source)) && ids.has(String(e.target)))
    .map((e) => ({ ...e, source: String(e.source), target: String(e.target) }));
  return { nodes, edges };
}

// An engine_step span event (or a live `step` event) as a NodeView step.
function nodeStep(a, time) {
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

function llmFromTrace(a, sumNode, phases) {
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
function llmFromSteps(node) {
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
  // Attempts that failed and were tried again, as the live node_retried events say (the trace
  // keeps no message per attempt: the node's error is the last one's).
  const retries = phases.filter((p) => p.phase === "tool_retried")
    .map((p, i) => ({ attempt: i + 1, error_kind: null, error: null, time: p.end }));
  return {
    id, kind, tool: a["gen_ai.tool.name"] ?? sumNode?.tool ?? null,
    status: span.status || "ok", error: span.error ?? sumNode?.error ?? null, start: span.start, end: span.end,
    phases, attempts: kind === "tool" ? (a["agentrt.tool.attempts"] ?? sumNode?.attempts ?? null) : null, retries,
    text: null, value: sumNode?.value ?? previewValue(a["agentrt.value"] ?? a["gen_ai.tool.call.result"]),
    waited_on: sumNode?.waited_on ?? a["agentrt.waited_on"] ?? null,
    llm: kind === "llm" ? llmFromTrace(a, sumNode, phases) : null,
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

// Memory bounds of a live view watched for hours: engine steps kept (the oldest go first, 2000 at
// once; their time is then "no data", not idle) and the streamed text kept per node.
const LIVE_MAX_STEPS = 20000, LIVE_DROP_STEPS = 2000, LIVE_TEXT_CHARS = 8000;

// A run watched live: apply() takes the run's SSE events (/v1/runs/{id}/events) in order,
// addEngineSteps() the server-wide engine_steps, tick() the engine snapshots' times (so open
// phases grow while nothing happens in the run), finish() swaps in the trace-built view.
// Engine steps are known only while the page listened: `_cover` holds the intervals of the
// trace clock whose steps all arrived; idle is computed within them, the rest is "no data".
export class LiveView {
  constructor(runInfo) {
    const ri = runInfo || {};
    this._run = { run_id: ri.run_id ?? null, program: ri.program ?? null, status: ri.status || "queued",
      start: null, end: null, inputs: ri.inputs ?? null, output: ri.output ?? null, error: ri.error ?? null };
    this._summary = null;
    this._final = null; // the trace-built RunView once finish() ran
    this._reset();
  }

  // The run's clock and all on it (a resumed run starts again on the new server's clock).
  // _nodes: id -> NodeView in the order they appeared; _cover: [{start, end|null}], the last one
  // open while steps keep coming; _dropped: the end of the last step dropped for memory.
  _reset(engineToo = true) {
    Object.assign(this, { _graph: null, _nodes: new Map(), _now: null });
    this._run.start = this._run.end = null;
    if (engineToo) this._resetEngine();
  }

  _resetEngine() { Object.assign(this, { _steps: [], _cover: [], _dropped: null }); }

  apply(type, data) {
    if (this._final) return; // ended: the saved trace has the last word
    const d = data || {};
    const t = typeof d.time === "number" ? d.time : this._now;
    if (typeof d.time === "number" && type !== "run_resumed") this._now = Math.max(this._now ?? d.time, d.time);
    const run = this._run;
    switch (type) {
      case "run_queued": run.status = "queued"; run.program = d.program ?? run.program; run.inputs = d.inputs ?? run.inputs; break;
      case "run_resumed": // the server restarted: a new clock, and every node comes again (replayed)
        this._reset();
        run.program = d.program ?? run.program; run.status = d.was === "queued" ? "queued" : "running";
        break;
      case "run_started":
        run.status = "running"; run.start = t; run.program = d.program ?? run.program; run.inputs = d.inputs ?? run.inputs;
        this._steps = this._steps.filter((s) => s.end >= t); // kept until now: the events' replay lags the live steps
        this._setGraph(d.graph, t);
        break;
      case "graph": if (d.graph) this._setGraph(d.graph, t); else this._mergeGraph(d, t); break;
      case "node_started": this._started(d, t); break;
      case "node_phase": if (d.node !== undefined) this._enter(this._node(d.node, null, t), d.phase, t); break;
      case "token": if (d.node !== undefined) this._token(this._node(d.node, "llm", t), d.text); break;
      case "step": if (d.node !== undefined) this._step(this._node(d.node, "llm", t), d, t); break;
      case "node_retried": {
        const n = this._node(d.node, "tool", t);
        n.retries.push({ attempt: d.attempt ?? n.retries.length + 1, error_kind: d.error_kind ?? null, error: d.error ?? null, time: t });
        n.attempts = Math.max(n.attempts || 0, d.attempt ?? n.retries.length);
        break;
      }
      case "input_wanted": run.status = "waiting"; break;
      case "input_given": if (run.status === "waiting") run.status = "running"; break;
      case "node_finished": this._finished(d, t); break;
      case "run_finished": this._runFinished(d, t); break;
      default: break; // an event type this renderer does not know: nothing to draw
    }
  }

  // The time of an engine snapshot (once a second, the same clock): open phases reach it.
  tick(time) {
    const run = this._run;
    if (!this._final && typeof time === "number" && run.start !== null && run.end === null && time >= run.start) this._now = Math.max(this._now ?? time, time);
  }

  // The server-wide stream (re)connected at `time` (hello.now): every step from then on will
  // arrive; the steps between a drop and a reconnect are missing, so a new interval starts.
  coverFrom(time, reconnect = true) {
    if (this._final || typeof time !== "number") return;
    const last = this._steps[this._steps.length - 1], open = this._cover[this._cover.length - 1];
    if (reconnect && last && time < last.start) this._resetEngine(); // a restarted server: a new clock
    else if (open && open.end === null) {
      if (!reconnect) { open.start = Math.min(open.start, time); return; }
      open.end = last && last.end > open.start ? last.end : open.start; // known up to the last step seen
    }
    this._cover.push({ start: time, end: null });
  }

  // Steps come in order, each once; a step number going back is a restarted engine (new clock).
  addEngineSteps(steps) {
    const list = (steps || []).filter((s) => s && typeof s.start === "number" && typeof s.end === "number");
    if (this._final || !list.length) return;
    let last = this._steps[this._steps.length - 1];
    if (last && list[0].step < last.step && list[0].start < last.start) { this._resetEngine(); last = null; }
    // The first batch since the page listened has every step from its first one on.
    if (!this._cover.length || this._cover[this._cover.length - 1].end !== null) this._cover.push({ start: list[0].start, end: null });
    const start = this._run.start ?? -Infinity, end = this._run.end;
    for (const s of list) {
      if (s.end < start || (end !== null && s.start > end)) continue;
      if (last && (typeof s.step === "number" && typeof last.step === "number" ? s.step <= last.step : s.start < last.start)) continue;
      this._steps.push(s);
      last = s;
    }
    if (this._steps.length > LIVE_MAX_STEPS) {
      const gone = this._steps.splice(0, this._steps.length - LIVE_MAX_STEPS + LIVE_DROP_STEPS);
      this._dropped = Math.max(this._dropped ?? -Infinity, gone[gone.length - 1].end);
    }
  }

  // An ended run's RunInfo when its trace cannot be had: its status, output and error, its
  // summary (the stall split, and the nodes when no event brought them).
  applyInfo(info) {
    if (this._final || !info) return;
    const run = this._run, runs = info.summary?.runs || [];
    const sumRun = this._summary = runs.find((r) => r.run_id === run.run_id) ?? runs[0] ?? this._summary;
    for (const k of ["status", "output", "error"]) if (info[k] !== undefined) run[k] = info[k];
    if (run.start === null && typeof sumRun?.start === "number") run.start = sumRun.start;
    // No event brought the nodes: the summary's, without phases (it has each phase's total, not
    // when). Else the nodes still open (the events stopped before their end) end as it says.
    const seed = !this._nodes.size;
    for (const sn of sumRun?.nodes || []) {
      const known = this._nodes.get(String(sn.node));
      if (sn.node === undefined || (sn.kind && !EXEC_KINDS.includes(sn.kind)) || (!seed && known?.end !== null)) continue;
      const n = this._node(sn.node, sn.kind || "llm", sn.start ?? run.start);
      if (seed) Object.assign(n, { phases: [], tool: sn.tool ?? null, waited_on: sn.waited_on ?? null, attempts: sn.attempts ?? n.attempts,
        llm: n.kind === "llm" ? llmFromTrace({}, sn, []) : null });
      this._finished({ node: sn.node, status: sn.status || "ok", error: sn.error, value: sn.value, replayed: true }, sn.end ?? sumRun.end ?? run.start);
    }
    if (["done", "failed", "cancelled"].includes(run.status) && run.end === null) {
      this._runFinished({ status: run.status, output: run.output, error: run.error }, sumRun?.end ?? this._now ?? run.start);
    }
  }

  finish(records, summary) {
    const views = viewsFromTrace(records, summary);
    const mine = views.find((v) => v.run.run_id === this._run.run_id) || (views.length === 1 ? views[0] : null);
    if (!mine) return;
    for (const n of mine.nodes) n.text = this._nodes.get(n.id)?.text ?? n.text; // keep what was streamed
    this._final = mine;
  }

  get view() {
    if (this._final) return this._final;
    const run = { ...this._run }, ended = run.end !== null, steps = this._steps, nodes = [...this._nodes.values()];
    for (const n of nodes) if (n.kind === "llm" && n.phases.length) n.llm = llmFromSteps(n);
    return { run, graph: this._graph, nodes, engine: { steps, ...this._idle(run, steps) },
      critical: ended ? criticalPath(nodes, this._graph) : [], summary: this._summary, now: this._now, trace: null };
  }

  // {idle, nodata} over the run so far: idle only where every step is known (steps come batched
  // every 0.25 s, so the time after the last one is not idle until the run ended); "no data"
  // before the page listened, across reconnects, and where old steps were dropped for memory.
  _idle(run, steps) {
    const idle = [], nodata = [];
    if (run.start === null) return { idle, nodata };
    const last = steps.length ? steps[steps.length - 1].end : null;
    const runEnd = run.end ?? Math.max(this._now ?? run.start, last ?? run.start);
    let t = run.start; // covered or accounted for up to here
    for (const c of this._cover) {
      const a = Math.max(c.start, run.start, this._dropped ?? -Infinity);
      const b = Math.min(c.end ?? run.end ?? last ?? a, runEnd);
      if (c.end !== null && b <= a) continue; // a closed interval before the run (or dropped)
      if (a > t) nodata.push({ start: t, end: Math.min(a, runEnd), why: a === this._dropped ? "dropped" : "not received" });
      if (b > a) idle.push(...idleGaps(steps, a, b));
      t = Math.max(t, c.end === null ? runEnd : b); // after the last step of the open one: not known yet
    }
    if (t < runEnd && (this._cover.length || run.end !== null)) nodata.push({ start: t, end: runEnd, why: "not received" });
    return { idle, nodata };
  }

  // -- internals --
  _node(id, kind, t) {
    const key = String(id);
    let n = this._nodes.get(key);
    if (!n) {
      n = { id: key, kind: kind || "llm", tool: null, status: "waiting", error: null, start: t, end: null,
        phases: [{ phase: "waiting", start: t, end: null, steps: [] }], attempts: kind === "tool" ? 0 : null,
        retries: [], text: "", value: null, waited_on: null, llm: null };
      this._nodes.set(key, n);
    }
    return n;
  }

  // Streamed text: the last LIVE_TEXT_CHARS are kept (cut in chunks, not on every token).
  _token(n, text) {
    n.text = (n.text || "") + (text ?? "");
    if (n.text.length > LIVE_TEXT_CHARS + 2000) n.text = n.text.slice(-LIVE_TEXT_CHARS);
  }

  _setGraph(graph, t) {
    const g = normGraph(graph);
    if (!g) return;
    this._graph = g;
    // A branch drops the cases it did not take: their nodes, never started, leave with them.
    const ids = new Set(g.nodes.map((n) => n.id));
    for (const [id, n] of this._nodes) if (!ids.has(id) && n.status === "waiting") this._nodes.delete(id);
    this._addExec(g.nodes, t);
  }

  // A `graph` event: the nodes and edges added since, and the ids of nodes removed (their edges
  // go with them); new nodes go last. A new object, so whoever draws it sees that it changed.
  _mergeGraph(d, t) {
    const removed = new Set((d.removed || []).map(String)), old = this._graph || { nodes: [], edges: [] };
    const added = normGraph({ nodes: d.nodes || [] }).nodes, addedIds = new Set(added.map((n) => n.id));
    const key = (e) => `${e.source}\u0000${e.target}`, seen = new Set(old.edges.map(key));
    this._graph = normGraph({ nodes: old.nodes.filter((n) => !removed.has(n.id) && !addedIds.has(n.id)).concat(added),
      edges: old.edges.concat((d.edges || []).filter((e) => e && !seen.has(key(e)) && seen.add(key(e)))) });
    for (const id of removed) if (this._nodes.get(id)?.status === "waiting") this._nodes.delete(id);
    this._addExec(added, t);
  }

  _addExec(graphNodes, t) {
    for (const gn of graphNodes) {
      if (!EXEC_KINDS.includes(gn.kind) || gn.template) continue;
      const n = this._node(gn.id, gn.kind, t);
      n.kind = gn.kind; if (gn.tool) n.tool = gn.tool;
    }
  }

  _enter(n, phase, t) {
    const cur = n.phases[n.phases.length - 1];
    if (!phase || (cur && cur.phase === phase && cur.end === null)) return;
    if (cur && cur.end === null) cur.end = Math.max(t, cur.start);
    n.phases.push({ phase, start: cur ? Math.max(t, cur.start) : t, end: null, steps: [] });
  }

  _started(d, t) {
    const n = this._node(d.node, d.kind, t);
    if (d.kind) n.kind = d.kind; if (d.tool) n.tool = d.tool;
    if (n.kind === "tool" && n.attempts === null) n.attempts = 0;
    n.status = "running"; n.waited_on = this._waitedOn(n.id);
    this._enter(n, "queued", t);
  }

  // What the trace calls waited_on: among the LLM/tool nodes the node reads, directly or
  // through bookkeeping nodes (items, fan-outs, branches), the one that finished last.
  _waitedOn(id) {
    const into = new Map();
    for (const e of this._graph?.edges || []) (into.get(e.target) || into.set(e.target, []).get(e.target)).push(e.source);
    let best = null;
    const seen = new Set([id]), queue = [...(into.get(id) || [])];
    while (queue.length) {
      const src = queue.shift();
      if (seen.has(src)) continue;
      seen.add(src);
      const n = this._nodes.get(src);
      if (n) { if (n.end !== null && (!best || n.end > best.end)) best = n; } else queue.push(...(into.get(src) || []));
    }
    return best ? best.id : null;
  }

  _step(n, d, t) {
    const time = typeof d.start === "number" ? d.start : t;
    // The step belongs to the phase it put the node in (prefill, decode), whose node_phase event
    // came as the step ended: that phase began when the step began, as the trace records it.
    const i = n.phases.length - 1, p = n.phases[i];
    if (p && !p.steps.length && time < p.start && i > 0) p.start = n.phases[i - 1].end = Math.max(time, n.phases[i - 1].start);
    p?.steps.push(nodeStep(d, time));
  }

  _finished(d, t) {
    const n = this._node(d.node, d.kind, t);
    this._close(n, t, d.status || "ok");
    if (n.status === "ok") n.value = previewValue(d.value);
    else n.error = typeof d.error === "string" ? d.error : (d.error?.message ?? (d.error ? JSON.stringify(d.error) : null));
    // node_retried comes for each attempt tried again, so the last attempt is one more.
    if (n.kind === "tool" && !d.replayed && n.status !== "cancelled") n.attempts = Math.max(n.attempts || 0, n.retries.length + 1);
  }

  _runFinished(d, t) {
    const run = this._run;
    Object.assign(run, { status: d.status || "done", end: t, output: d.output ?? null });
    const err = d.error;
    run.error = err ? { node: err.node ?? d.failed_node ?? null, message: typeof err === "string" ? err : (err.message ?? JSON.stringify(err)) } : null;
    // Nodes the run never finished were cancelled with it (the trace says so too).
    for (const n of this._nodes.values()) if (n.end === null) this._close(n, t, "cancelled");
  }

  _close(n, t, status) { // the open phase ends, and the node with it
    const cur = n.phases[n.phases.length - 1];
    if (cur && cur.end === null) cur.end = Math.max(t, cur.start);
    n.end = t; n.status = status;
  }
}

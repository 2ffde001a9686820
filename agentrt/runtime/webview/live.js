// A run watched live: the RunView of model.js built from the run's events as they come.
import { EXEC_KINDS, criticalPath, idleGaps, llmFromSteps, llmFromTrace, nodeStep, normGraph, previewValue, viewsFromTrace } from "./model.js";

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
      case "input_wanted": {
        run.status = "waiting";
        if (d.node !== undefined) this._asked(this._node(d.node, "wait_for", t), d);
        break;
      }
      case "input_given": {
        if (run.status === "waiting") run.status = "running";
        if (d.node !== undefined) this._answered(this._node(d.node, "wait_for", t), d);
        break;
      }
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
        retries: [], text: "", value: null, waited_on: null, llm: null, input: null };
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

  // A `graph` event: the nodes and edges added since, the ids of nodes removed (their edges go
  // with them), new states of the graph's other nodes (branch, fan-out...); new nodes go last.
  // A new object, so whoever draws it sees that it changed.
  _mergeGraph(d, t) {
    const removed = new Set((d.removed || []).map(String)), old = this._graph || { nodes: [], edges: [] };
    const added = normGraph({ nodes: d.nodes || [] }).nodes, addedIds = new Set(added.map((n) => n.id));
    const key = (e) => `${e.source}\u0000${e.target}`, seen = new Set(old.edges.map(key)), st = d.states || {};
    this._graph = normGraph({ nodes: old.nodes.filter((n) => !removed.has(n.id) && !addedIds.has(n.id))
      .map((n) => (Object.hasOwn(st, n.id) ? { ...n, state: st[n.id] } : n)).concat(added),
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
    if (n.kind !== "wait_for") this._enter(n, "queued", t); // a wait_for node is never queued: it asks at once
  }

  // A wait_for node's question (input_wanted) and who answered it, how and when (input_given).
  _asked(n, d) {
    n.kind = "wait_for";
    n.input = { ...(n.input || {}), prompt: d.prompt ?? null, schema: d.schema ?? null };
  }

  _answered(n, d) {
    n.input = { ...(n.input || {}), answered_by: d.by ?? null, via: d.via ?? null, answered_at: d.at ?? null };
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

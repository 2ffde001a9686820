// A run's page. An ended run is drawn from its saved trace; a live one from a LiveView fed by the
// run's own events (/v1/runs/{id}/events) and the engine's steps (/v1/events), redrawn at most
// five times a second, and swapped for the trace-built view when it ends, so that what the page
// shows then is what `inspect --html` shows for the same trace.

import { ApiError, ENDED, api, el, fmtTime, getKey, onServerEvents, streamEvents } from "./api.js";
import { mountEnginePanel } from "./engine.js";
import { FieldError, fieldValue, readFields, schemaField, schemaFields, schemaType, showFormError, statusBadge } from "./runs.js";
import { LiveView } from "/view/live.js";
import { parseJsonl, viewsFromTrace } from "/view/model.js";
import { renderTimeline } from "/view/timeline.js";
import { renderDag } from "/view/dag.js";
import { renderAlphaTable, renderOutput, renderRunHeader, renderToolTable } from "/view/details.js";
import { renderLegend } from "/view/phases.js";

// ---- the drawing of one RunView (also used by the trace-file page) -----------------------------------
export class RunDisplay {
  constructor() {
    const section = (title, id, ...body) => el("section", { class: "card", "aria-labelledby": id }, el("h2", { id }, title), ...body);
    this.header = el("div", { id: "run-header", class: "run-header" });
    this.dag = el("div", { id: "dag", class: "dag-box scroll-box" });
    this.legend = el("div", { id: "legend", class: "legend-box" });
    this.timeline = el("div", { id: "timeline", class: "timeline-box" });
    this.alpha = el("div", { id: "alpha-table", class: "table-scroll" });
    this.tools = el("div", { id: "tool-table", class: "table-scroll" });
    this.output = el("div", { id: "run-output", class: "run-output" });
    this.error = el("div", { id: "run-error", class: "run-error-box", role: "alert", hidden: true });
    this.handles = { dag: null, timeline: null }; // the renderers that update in place (zoom kept)
    this.dagKey = null; // what the DAG was last drawn from: it is redrawn only when that changes
    this.root = el("div", { class: "run-display" },
      this.header,
      section("Result", "result-title", this.error, this.output),
      section("Graph", "dag-title", this.dag),
      section("Timeline", "timeline-title", this.legend, this.timeline),
      section("LLM nodes: tokens and speculation", "alpha-title", this.alpha),
      section("Tool nodes", "tools-title", this.tools));
    guard(this.legend, "legend", () => renderLegend(this.legend));
  }

  render(view) {
    guard(this.header, "run header", () => { this.header.replaceChildren(); renderRunHeader(this.header, view); });
    const dagKey = dagSignature(view);
    for (const [key, container, render] of [["dag", this.dag, renderDag], ["timeline", this.timeline, renderTimeline]]) {
      if (key === "dag" && this.handles.dag && dagKey === this.dagKey) continue; // nothing it shows changed
      if (key === "dag") this.dagKey = dagKey;
      guard(container, key, () => {
        if (this.handles[key]) this.handles[key].update(view);
        else this.handles[key] = render(container, view);
      }, () => { this.handles[key] = null; });
    }
    guard(this.alpha, "α table", () => { this.alpha.replaceChildren(); renderAlphaTable(this.alpha, view); });
    guard(this.tools, "tool table", () => { this.tools.replaceChildren(); renderToolTable(this.tools, view); });
    this.renderResult(view);
  }

  // The output when it ended well; the error, naming the node that failed, when not; while
  // running, the text the LLM nodes are streaming now.
  renderResult(view) {
    const run = view.run || {};
    const error = run.error;
    this.error.hidden = !(run.status === "failed" || (error && run.status !== "done" && run.status !== "cancelled"));
    if (!this.error.hidden) {
      this.error.replaceChildren(
        el("h3", {}, "Failed", error?.node ? [" at node ", el("code", { class: "node-name" }, error.node)] : null),
        el("pre", { class: "error-text" }, error?.message || "(no message)"),
        error?.node ? el("button", { type: "button", class: "quiet", onclick: () => this.showNode(error.node) }, "Show the node in the timeline") : null);
    }
    this.output.hidden = !this.error.hidden;
    if (this.output.hidden) return;
    if (run.status === "done") {
      guard(this.output, "output", () => { this.output.replaceChildren(); renderOutput(this.output, view); });
    } else if (run.status === "cancelled") {
      const why = error?.message && !/cancel/i.test(error.message) ? `: ${error.message}` : ".";
      this.output.replaceChildren(el("p", { class: "muted" }, `The run was cancelled${why}`));
    } else {
      const streaming = (view.nodes || []).filter((n) => n.kind === "llm" && n.status === "running" && n.text);
      this.output.replaceChildren(
        el("p", { class: "muted" }, run.status === "waiting" ? "Waiting for input (see the form above)." : "Running: the output comes when the run ends."),
        ...streaming.map((n) => el("div", { class: "stream" }, el("h3", {}, el("code", {}, n.id), " is writing"),
                                el("pre", {}, n.text.length > 4000 ? `…${n.text.slice(-4000)}` : n.text))));
    }
  }

  showNode(node) {
    const lane = this.timeline.querySelector(`[data-node="${CSS.escape(node)}"]`) || this.dag.querySelector(`[data-node="${CSS.escape(node)}"]`);
    if (!lane) return;
    lane.scrollIntoView({ behavior: "smooth", block: "center", inline: "nearest" });
    lane.classList.add("flash");
    setTimeout(() => lane.classList.remove("flash"), 2000);
  }
}

// What the DAG draws from: the graph (a new object when it changed), each node's state, the
// critical path. A live run's view changes many times a second; this, far less often.
const graphIds = new WeakMap();
let graphSeq = 0;
function dagSignature(view) {
  const g = view.graph;
  if (g && !graphIds.has(g)) graphIds.set(g, ++graphSeq);
  return [g ? graphIds.get(g) : "none", view.run?.status, typeof view.run?.start,
    (view.nodes || []).map((n) => `${n.id}:${n.status}:${n.waited_on ?? ""}`).join(","), (view.critical || []).join(",")].join("|");
}

// A renderer that throws leaves a note in its box, not a blank page.
function guard(container, what, draw, onError = () => {}) {
  try {
    draw();
  } catch (e) {
    console.error(`drawing the ${what} failed`, e);
    onError();
    container.replaceChildren(el("p", { class: "form-error" }, `The ${what} could not be drawn: ${e.message}`));
  }
}

/** The RunView of runId among a trace's runs (a trace file may hold several). */
function pickView(records, summary, runId) {
  const views = viewsFromTrace(records, summary);
  return views.find((v) => v.run?.run_id === runId) ?? views[0];
}

// ---- the page ------------------------------------------------------------------------------------------
export function showRunPage(main, runId, signal) {
  const page = el("section", { id: "run-page", class: "run-page", dataset: { runId, status: "loading" }, "aria-labelledby": "run-title" });
  const title = el("h1", { id: "run-title" }, "Run ", el("code", {}, runId));
  const statusSlot = el("span", { class: "status-slot", role: "status", "aria-live": "polite" });
  const cancel = el("button", { type: "button", id: "cancel-button", class: "danger", hidden: true }, "Cancel run");
  const actionNote = el("p", { id: "run-note", class: "form-error", role: "alert", hidden: true });
  const links = el("span", { class: "run-links" });
  const inputsBox = el("div", { id: "run-inputs", class: "run-inputs", hidden: true });
  const meta = el("div", { class: "run-meta" });
  const engineBox = el("div", { class: "engine-box" });
  const body = el("div", { class: "run-body" }, el("p", { class: "muted" }, "Loading…"));
  page.append(
    el("nav", { class: "crumbs", "aria-label": "Breadcrumb" }, el("a", { href: "#/" }, "Runs"), " / ", el("span", {}, runId)),
    el("div", { class: "run-title-row" }, title, statusSlot, el("span", { class: "spacer" }), links, cancel),
    actionNote, meta, inputsBox, engineBox, body);
  main.replaceChildren(page);
  runPage({ page, runId, signal, statusSlot, cancel, actionNote, links, inputsBox, meta, body, engineBox }).catch((e) => {
    if (signal.aborted) return;
    if (!(e instanceof ApiError)) console.error(e); // a bug, not an answer of the server
    page.dataset.status = "error";
    body.replaceChildren(el("p", { class: "form-error", role: "alert" },
      e.status === 404 ? `There is no run ${runId} (it may have been pruned).` : `Could not load the run: ${e.message}`));
  });
}

async function runPage({ page, runId, signal, statusSlot, cancel, actionNote, links, inputsBox, meta, body, engineBox }) {
  const path = `/v1/runs/${encodeURIComponent(runId)}`;
  const info = await api(path, { signal });
  document.title = `${info.program} · ${runId} · agentrt`;
  const display = new RunDisplay();
  body.replaceChildren(display.root);
  meta.replaceChildren(runMeta(info));

  // The status shown is the server's (GET, `run` events, run_finished); once ended it stays ended.
  // #run-page's data-status takes an ended status only with `drawn`, once the final view is on the
  // page: whoever waits for data-status=done then finds the finished drawing.
  let status = null;
  const setStatus = (next, { drawn = false } = {}) => {
    if (!next || (ENDED.has(status) && !ENDED.has(next))) return;
    if (next !== status) {
      status = next;
      statusSlot.replaceChildren(statusBadge(next));
      cancel.hidden = ENDED.has(next);
    }
    if (!ENDED.has(next) || drawn) page.dataset.status = next;
  };
  setStatus(info.status);

  // The forms for the wait_for nodes waiting now, one per node, kept while the user types.
  const forms = new Map();
  const syncInputs = (wanted) => {
    const nodes = new Set(wanted.map((w) => w.node));
    for (const [node, form] of forms) if (!nodes.has(node)) { form.remove(); forms.delete(node); }
    for (const w of wanted) if (!forms.has(w.node)) addInput(w);
    inputsBox.hidden = forms.size === 0;
  };
  const addInput = (w) => {
    if (forms.has(w.node) || ENDED.has(status)) return;
    const form = inputForm(path, w, signal, (updated) => { setStatus(updated.status); syncInputs(updated.waiting_for || []); });
    forms.set(w.node, form);
    inputsBox.append(form);
    inputsBox.hidden = false;
  };
  const removeInput = (node) => syncInputs([...forms.keys()].filter((n) => n !== node).map((n) => ({ node: n })));
  syncInputs(info.waiting_for || []);

  cancel.addEventListener("click", async () => {
    cancel.disabled = true;
    cancel.textContent = "Cancelling…";
    actionNote.hidden = true;
    try {
      setStatus((await api(`${path}/cancel`, { method: "POST", signal })).status);
    } catch (e) {
      if (signal.aborted) return;
      if (e.status !== 409) showNote(actionNote, `Could not cancel: ${e.message}`, true);
    } finally {
      cancel.disabled = false;
      cancel.textContent = "Cancel run";
    }
  });

  // An ended run without its trace (none written, pruned, or not readable) is drawn from its
  // RunInfo: status, output, error and the summary's figures, with a note that says so.
  const fromInfo = (ended, error = null) => {
    const view = new LiveView(ended);
    view.applyInfo(ended);
    if (error) showNote(actionNote, `trace not available: ${error.message}`);
    return view;
  };
  if (ENDED.has(info.status)) {
    if (!info.summary) { // it never started (cancelled while queued): no trace was written
      display.render(fromInfo(info).view);
    } else {
      let text = null;
      try {
        text = await api(`${path}/trace`, { signal, as: "text" });
      } catch (e) {
        if (signal.aborted || !(e instanceof ApiError)) throw e;
        display.render(fromInfo(info, e).view);
      }
      if (text !== null) {
        display.render(pickView(parseJsonl(text), info.summary, runId));
        traceLinks(links, runId, text, signal);
      }
    }
    setStatus(info.status, { drawn: true });
    return;
  }

  // ---- live ----
  // The engine's numbers now, small: they matter while this run shares the engine (not for an ended one).
  const unmountEngine = mountEnginePanel(engineBox, { compact: true });
  signal.addEventListener("abort", unmountEngine);
  const live = new LiveView(info);
  // Redraws are throttled: events come by the hundred a second on a busy run, and a redraw of a
  // long run's timeline costs milliseconds; five a second looks live.
  let timer = 0;
  let lastDraw = 0;
  let finished = false;
  const draw = () => { timer = 0; lastDraw = performance.now(); display.render(live.view); };
  const schedule = () => {
    if (!timer && !finished) timer = setTimeout(draw, Math.max(0, lastDraw + REDRAW_MS - performance.now()));
  };
  signal.addEventListener("abort", () => clearTimeout(timer));
  draw();

  const runEvents = new AbortController();
  signal.addEventListener("abort", () => runEvents.abort());

  // The end: run_finished comes from the runtime a moment before the server has written the trace
  // and the summary, so ask /wait (it answers once the server is done with the run), then draw the
  // trace-built view in place of the live one.
  let finishing = null;
  const finish = () => finishing ??= (async () => {
    syncInputs([]);
    let ended = await api(`${path}/wait?timeout=30`, { signal });
    while (!ENDED.has(ended.status)) ended = await api(`${path}/wait?timeout=30`, { signal });
    // Only now: a `run` event may say "ended" before the run's own stream brought its last events.
    runEvents.abort(); // the run's stream has nothing more to say (it would reconnect for ever)
    meta.replaceChildren(runMeta(ended));
    let text = null;
    if (ended.summary) { // none when it never started: no trace either
      try {
        text = await api(`${path}/trace`, { signal, as: "text" });
      } catch (e) {
        if (signal.aborted || !(e instanceof ApiError)) throw e;
        showNote(actionNote, `trace not available: ${e.message}`);
      }
    }
    if (text !== null) {
      live.finish(parseJsonl(text), ended.summary);
      traceLinks(links, runId, text, signal);
    } else {
      live.applyInfo(ended); // the live view stays, with the run's end as the server says it
    }
    finished = true;
    clearTimeout(timer);
    timer = 0;
    display.render(live.view);
    setStatus(ended.status, { drawn: true });
  })().catch((e) => {
    if (signal.aborted) return;
    if (status) setStatus(status, { drawn: true });
    showNote(actionNote, `The run ended, but its trace could not be loaded (${e.message}): the live view stays.`, true);
  });

  streamEvents(`${path}/events`, (type, data) => {
    live.apply(type, data);
    if (type === "input_wanted") addInput(data);
    else if (type === "input_given") removeInput(data.node);
    else if (type === "run_started" && status === "queued") setStatus("running");
    else if (type === "run_finished") { setStatus(data.status); finish(); }
    schedule();
  }, {
    signal: runEvents.signal,
    onState: (state, error) => {
      if (state === "error" && !signal.aborted) {
        showNote(actionNote, `The run's live events stopped: ${error?.message ?? "error"}`, true);
      }
    },
  });

  // hello and engine come first as the last ones kept by the shared connection (`replaying`): the
  // steps before them never reached this view, so only live ones say from when steps are whole.
  let replaying = true;
  const unsubscribe = onServerEvents((type, data) => {
    if (type === "engine_steps" && !finished && Array.isArray(data.steps)) {
      live.addEngineSteps(data.steps);
      schedule();
    } else if (type === "hello" && !replaying) {
      live.coverFrom(data.now, true); // (re)connected: what came before it is missing
    } else if (type === "engine" && !finished) {
      if (!replaying) live.coverFrom(data.time, false);
      live.tick(data.time); // open phases grow during a long tool call or input wait
      schedule();
    } else if (type === "run" && data.run_id === runId) {
      setStatus(data.status);
      if (!ENDED.has(data.status)) syncInputs(data.waiting_for || []);
      else finish(); // in case the run's own stream missed its end
    }
  });
  replaying = false;
  signal.addEventListener("abort", unsubscribe);
}

const REDRAW_MS = 200;

// The line under the title: an error (something failed), or a note (what the page shows lacks something).
function showNote(note, text, error = false) {
  note.className = error ? "form-error" : "form-note";
  note.setAttribute("role", error ? "alert" : "status");
  note.textContent = text;
  note.hidden = false;
}

function runMeta(info) {
  const times = [["created", info.created_at], ["started", info.started_at], ["ended", info.ended_at]]
    .filter(([, t]) => t).map(([what, t]) => `${what} ${fmtTime(t)}`).join(" · ");
  return el("div", {},
    el("p", { class: "muted" }, el("strong", {}, info.program), times ? ` · ${times}` : ""),
    el("details", { class: "run-inputs-json" }, el("summary", {}, "Inputs"),
      el("pre", {}, JSON.stringify(info.inputs ?? {}, null, 2))),
    Object.keys(info.metadata || {}).length
      ? el("details", {}, el("summary", {}, "Metadata"), el("pre", {}, JSON.stringify(info.metadata, null, 2))) : null);
}

// Download the trace the page already holds (no second request, and no key in a URL); the
// server's standalone page only where it needs no key (a link cannot send the header).
function traceLinks(container, runId, text, signal) {
  for (const a of container.querySelectorAll("a[href^='blob:']")) URL.revokeObjectURL(a.href);
  const url = URL.createObjectURL(new Blob([text], { type: "application/jsonl" }));
  signal.addEventListener("abort", () => URL.revokeObjectURL(url), { once: true }); // the page left: free the copy
  container.replaceChildren(el("a", { href: url, download: `${runId}.jsonl`, class: "button-link" }, "Download trace"));
  if (!getKey()) {
    container.append(el("a", { href: `/v1/runs/${encodeURIComponent(runId)}/timeline`, target: "_blank", rel: "noopener",
                               class: "button-link" }, "Open as page"));
  }
}

// ---- an input form for a wait_for node ---------------------------------------------------------------
// An object schema with properties gets a field per property; anything else one field "value".
const ANSWERED_BY_KEY = "agentrt.answeredBy";

function inputForm(path, wanted, signal, onSent) {
  const schema = wanted.schema || {};
  const perProperty = schemaType(schema) === "object" && Object.keys(schema.properties || {}).length > 0;
  const fields = el("fieldset", { class: "fields" }, el("legend", {}, `Value for ${wanted.node}`),
    perProperty ? schemaFields(schema) : schemaField("value", schema, true));
  const error = el("p", { class: "form-error", role: "alert", hidden: true });
  const submit = el("button", { type: "submit", class: "primary" }, "Send");
  // Who answers: optional, kept in the run's trace beside the value (remembered in this browser).
  const byId = `answered-by-${wanted.node}`;
  const by = el("input", { type: "text", id: byId, name: "answered-by", maxlength: 200, autocomplete: "name",
    value: localStorage.getItem(ANSWERED_BY_KEY) || "" });
  const form = el("form", { class: "card input-form", dataset: { node: wanted.node }, novalidate: true },
    el("h2", {}, "Input wanted by ", el("code", {}, wanted.node)),
    wanted.prompt ? el("p", { class: "prompt" }, wanted.prompt) : null,
    fields, el("div", { class: "field" }, el("label", { for: byId }, "Your name (optional, kept in the run's trace)"), by),
    error, el("div", { class: "buttons" }, submit));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    let value;
    try {
      value = perProperty ? readFields(fields) : fieldValue(fields.querySelector("[data-type]"));
      if (value === undefined) throw new FieldError("value", "a value is required");
    } catch (e) {
      showFormError(form, error, e);
      return;
    }
    submit.disabled = true;
    try {
      const name = by.value.trim();
      const body = name ? { value, by: name } : { value };
      const info = await api(`${path}/input/${encodeURIComponent(wanted.node)}`, { method: "POST", body, signal });
      if (name) localStorage.setItem(ANSWERED_BY_KEY, name); else localStorage.removeItem(ANSWERED_BY_KEY);
      showFormError(form, error, null);
      onSent(info);
    } catch (e) {
      if (!signal.aborted) showFormError(form, error, e);
    } finally {
      submit.disabled = false;
    }
  });
  return form;
}

// The runs page: the engine panel, the table of runs (newest first, filtered by the server, kept
// live from the `run` events of /v1/events: no polling), and the form that starts a run.
// Also the JSON-schema form fields, which the run page reuses for wait_for inputs.

import { ApiError, ENDED, api, el, fmtDuration, fmtNum, fmtTime, onServerEvents } from "./api.js";
import { docstringView } from "./docstring.js";
import { mountEnginePanel } from "./engine.js";
import { PHASE_COLORS, RUN_STATUS_ICONS } from "/view/phases.js";

const PAGE = 25;
const KEEP_NEW = 100; // rows kept beyond the loaded pages' as new runs come in (a busy server makes many)
const STATUSES = ["queued", "running", "waiting", "done", "failed", "cancelled"]; // what ?status= accepts

// ---- schema fields -------------------------------------------------------------------------------
/** The type a field is drawn for: the schema's type (the first non-null of a list), else "json". */
export function schemaType(schema) {
  let type = schema?.type;
  if (Array.isArray(type)) type = type.find((t) => t !== "null") ?? type[0];
  return ["string", "integer", "number", "boolean", "array", "object"].includes(type) ? type : "json";
}

let fieldSeq = 0;

/**
 * A labelled control for one property: string -> text input (a select when it has an enum),
 * integer/number -> number input, boolean -> checkbox, array/object/anything else -> a JSON
 * textarea. The default is filled in; required ones are marked in words and in the control.
 */
export function schemaField(name, schema = {}, required = false) {
  const type = schemaType(schema);
  const id = `field-${++fieldSeq}`;
  const hasDefault = schema.default !== undefined;
  const common = { id, name, dataset: { type }, "aria-required": required ? "true" : null };
  let control;
  if (type === "boolean") {
    control = el("input", { ...common, type: "checkbox", checked: hasDefault && schema.default === true });
  } else if (type === "string" && Array.isArray(schema.enum)) {
    control = el("select", { ...common, required },
      schema.enum.map((v) => el("option", { value: v, selected: hasDefault && v === schema.default }, String(v))));
  } else if (type === "string") {
    control = el("input", { ...common, type: "text", required, value: hasDefault ? schema.default : null,
                            maxlength: schema.maxLength ?? null });
  } else if (type === "integer" || type === "number") {
    control = el("input", { ...common, type: "number", required, step: type === "integer" ? 1 : "any",
                            min: schema.minimum ?? null, max: schema.maximum ?? null,
                            value: hasDefault ? schema.default : null });
  } else {
    control = el("textarea", { ...common, rows: 3, required, spellcheck: "false",
                               placeholder: type === "array" ? "[ … ] (JSON)" : type === "object" ? "{ … } (JSON)" : "JSON" });
    if (hasDefault) control.value = JSON.stringify(schema.default, null, 2);
  }
  const label = el("label", { for: id }, name,
    required ? el("span", { class: "required" }, " (required)") : null,
    el("span", { class: "type" }, ` ${type === "json" ? "JSON" : type}`));
  const hint = schema.description ? el("p", { class: "hint" }, schema.description) : null;
  return type === "boolean"
    ? el("div", { class: "field check" }, control, label, hint)
    : el("div", { class: "field" }, label, control, hint);
}

/** The fields of an object schema's properties (required ones first is not done: schema order is the author's). */
export function schemaFields(schema) {
  const required = new Set(schema?.required || []);
  return Object.entries(schema?.properties || {}).map(([name, prop]) => schemaField(name, prop, required.has(name)));
}

export class FieldError extends Error {
  constructor(name, message) { super(`${name}: ${message}`); this.field = name; }
}

/** The value a control holds, by its data-type; undefined for an empty optional field (omitted). */
export function fieldValue(control) {
  const type = control.dataset.type;
  const required = control.getAttribute("aria-required") === "true";
  if (type === "boolean") return control.checked;
  const raw = control.value;
  if (raw.trim() === "") {
    if (required) throw new FieldError(control.name, "a value is required");
    return undefined;
  }
  if (type === "string") return raw;
  if (type === "integer" || type === "number") {
    const n = Number(raw);
    if (!Number.isFinite(n) || (type === "integer" && !Number.isInteger(n))) throw new FieldError(control.name, `not ${type === "integer" ? "an integer" : "a number"}`);
    return n;
  }
  try {
    return JSON.parse(raw);
  } catch (e) {
    throw new FieldError(control.name, `not valid JSON (${e.message})`);
  }
}

/** {name: value} of every schema field in form (data-type marks them); empty optional ones left out. */
export function readFields(form) {
  const out = {};
  for (const control of form.querySelectorAll("[data-type]")) {
    const value = fieldValue(control);
    if (value !== undefined) out[control.name] = value;
  }
  return out;
}

/** Put an error next to a form (and on the field it names, when there is one). */
export function showFormError(form, box, error) {
  for (const c of form.querySelectorAll("[aria-invalid]")) c.removeAttribute("aria-invalid");
  box.textContent = error ? error.message : "";
  box.hidden = !error;
  const name = error?.field ?? String(error?.param ?? "").split(".").pop();
  const control = name ? form.querySelector(`[data-type][name="${CSS.escape(name)}"]`) : null;
  if (control) { control.setAttribute("aria-invalid", "true"); control.focus(); }
}

// ---- the page --------------------------------------------------------------------------------------
export function showRunsPage(main, query, signal) {
  const filters = { program: query.get("program") || "", status: query.get("status") || "" };
  const engineBox = el("div", { class: "engine-box" });
  const programFilter = el("select", { name: "program-filter", id: "program-filter" }, el("option", { value: "" }, "all programs"));
  const statusFilter = el("select", { name: "status-filter", id: "status-filter" }, el("option", { value: "" }, "any status"),
    STATUSES.map((s) => el("option", { value: s, selected: s === filters.status }, s)));
  const tbody = el("tbody");
  const empty = el("p", { class: "empty", hidden: true }, "No runs yet: start one with the form.");
  const listError = el("p", { class: "form-error", role: "alert", hidden: true });
  const more = el("button", { type: "button", id: "load-more", hidden: true }, "Load more");
  const startBox = el("section", { class: "card start-card", "aria-labelledby": "start-title" },
    el("h2", { id: "start-title" }, "Start a run"), el("p", { class: "muted" }, "Loading programs…"));

  main.replaceChildren(el("div", { class: "runs-page" },
    engineBox,
    el("div", { class: "runs-grid" },
      el("section", { class: "card runs-card", "aria-labelledby": "runs-title" },
        el("div", { class: "card-head" },
          el("h1", { id: "runs-title" }, "Runs"),
          el("div", { class: "filters" },
            el("label", { for: "program-filter" }, "Program "), programFilter,
            el("label", { for: "status-filter" }, "Status "), statusFilter)),
        listError,
        el("div", { class: "table-scroll" },
          el("table", { id: "runs-table", class: "runs-table" },
            el("caption", { class: "visually-hidden" }, "Runs, newest first"),
            el("thead", {}, el("tr", {},
              el("th", { scope: "col" }, "Run"), el("th", { scope: "col" }, "Program"), el("th", { scope: "col" }, "Status"),
              el("th", { scope: "col" }, "Started"), el("th", { scope: "col", class: "num" }, "Duration"),
              el("th", { scope: "col" }, "Time split ", splitLegend()),
              el("th", { scope: "col", class: "num", title: "accepted / drafted tokens over the run's LLM nodes" }, "α"))),
            tbody)),
        empty, more),
      startBox)));

  const unmountEngine = mountEnginePanel(engineBox);
  signal.addEventListener("abort", unmountEngine);

  let nextCursor = null;
  let loading = null; // the page load in flight; run events meanwhile wait in `held`
  let held = [];
  let loadedRows = 0; // rows the loaded pages brought
  let gap = false; // old rows were trimmed: "load more" no longer follows on from the table's end
  const matches = (info) => (!filters.program || info.program === filters.program)
                          && (!filters.status || info.status === filters.status);

  const upsert = (info, { append = false } = {}) => {
    const old = tbody.querySelector(`tr[data-run-id="${CSS.escape(info.run_id)}"]`);
    if (!matches(info)) { old?.remove(); return; }
    const row = runRow(info);
    if (old) { old.replaceWith(row); return; }
    if (append) { tbody.append(row); return; }
    // newest first: before the first row created earlier; past the loaded page it is for "load more"
    const later = [...tbody.rows].find((r) => Number(r.dataset.created) < info.created_at);
    if (later) tbody.insertBefore(row, later);
    else if (!nextCursor) tbody.append(row);
    trim();
  };
  // A page left open on a busy server: the oldest rows go, so the table stays a few hundred rows.
  const trim = () => {
    let extra = tbody.rows.length - (loadedRows + KEEP_NEW);
    if (extra <= 0) return;
    while (extra-- > 0) tbody.lastElementChild.remove();
    gap = true;
    more.textContent = "Reload the list";
    more.hidden = loading !== null;
  };
  const refreshEmpty = () => { empty.hidden = tbody.rows.length > 0 || loading !== null; };

  const load = async (cursor = null) => {
    const params = new URLSearchParams({ limit: PAGE });
    if (filters.program) params.set("program", filters.program);
    if (filters.status) params.set("status", filters.status);
    if (cursor) params.set("cursor", cursor);
    const request = api(`/v1/runs?${params}`, { signal });
    loading = request;
    more.disabled = true;
    try {
      const page = await request;
      if (loading !== request) return; // a newer load (the filters changed) replaced this one
      if (!cursor) { tbody.replaceChildren(); loadedRows = 0; gap = false; more.textContent = "Load more"; }
      loadedRows += page.data.length;
      nextCursor = page.next_cursor;
      for (const info of page.data) upsert(info, { append: true });
      listError.hidden = true;
    } catch (e) {
      if (signal.aborted || loading !== request) return;
      listError.textContent = `Could not list the runs: ${e.message}`;
      listError.hidden = false;
    } finally {
      if (loading === request) {
        loading = null;
        for (const info of held.splice(0)) upsert(info);
        more.hidden = !nextCursor && !gap;
        more.disabled = false;
        refreshEmpty();
      }
    }
  };

  const setFilters = () => {
    filters.program = programFilter.value;
    filters.status = statusFilter.value;
    const q = new URLSearchParams(Object.entries(filters).filter(([, v]) => v)).toString();
    history.replaceState(null, "", q ? `#/?${q}` : "#/"); // shareable, without a hashchange re-render
    nextCursor = null;
    load();
  };
  programFilter.addEventListener("change", setFilters);
  statusFilter.addEventListener("change", setFilters);
  more.addEventListener("click", () => (gap ? load() : load(nextCursor)));

  let helloSeen = false;
  const unsubscribe = onServerEvents((type, data) => {
    if (type === "run" && data?.run_id) {
      if (loading) held.push(data);
      else { upsert(data); refreshEmpty(); }
    } else if (type === "hello") {
      // a second hello is a reconnect: run events may have been missed meanwhile, list again
      if (helloSeen && !loading) load();
      helloSeen = true;
    }
  });
  signal.addEventListener("abort", unsubscribe);

  // The durations of running runs tick, like a clock (cheap: only those rows).
  const ticker = setInterval(() => {
    for (const cell of tbody.querySelectorAll("td[data-started]")) {
      cell.textContent = fmtDuration(Date.now() / 1000 - Number(cell.dataset.started));
    }
  }, 1000);
  signal.addEventListener("abort", () => clearInterval(ticker));

  load();
  loadPrograms(startBox, programFilter, filters, signal);
}

// ---- one row -----------------------------------------------------------------------------------------
function runRow(info) {
  const run = info.summary?.runs?.[0];
  const ended = ENDED.has(info.status);
  const started = info.started_at ?? null;
  const link = el("a", { href: `#/runs/${encodeURIComponent(info.run_id)}`, class: "run-link" }, info.run_id);
  const duration = ended || !started
    ? el("td", { class: "num" }, fmtDuration(info.duration_s))
    : el("td", { class: "num", "data-started": started }, fmtDuration(Date.now() / 1000 - started));
  const alpha = runAlpha(run);
  const row = el("tr", { dataset: { runId: info.run_id, status: info.status, created: info.created_at } },
    el("th", { scope: "row", class: "run-id" }, link),
    el("td", {}, info.program),
    el("td", {}, statusBadge(info.status, info.error)),
    el("td", { title: started ? new Date(started * 1000).toISOString() : "not started yet" },
       started ? fmtTime(started) : el("span", { class: "muted" }, `queued ${fmtTime(info.created_at)}`)),
    duration,
    el("td", {}, splitBar(run?.stalls)),
    el("td", { class: "num", "data-alpha": alpha ?? "" }, fmtNum(alpha, 2)));
  // the whole row opens the run (the link stays for keyboards and "open in new tab")
  row.addEventListener("click", (event) => {
    if (event.target.closest("a, button") || getSelection()?.toString()) return;
    location.hash = link.getAttribute("href");
  });
  return row;
}

/** The status as a word, with a mark that repeats it (colour is never the only signal). */
export function statusBadge(status, error = null) {
  const marks = RUN_STATUS_ICONS || {}; // the renderer's, so a status looks the same everywhere
  return el("span", { class: `status status-${status}`, title: error?.message ? `${status}: ${error.message}` : status },
    el("span", { class: "status-mark", "aria-hidden": "true" }, marks[status] ?? "•"), status);
}

/** α of a run: accepted / drafted summed over its LLM nodes; null when nothing was drafted. */
function runAlpha(run) {
  let drafted = 0;
  let accepted = 0;
  for (const node of run?.nodes || []) {
    if (node.kind !== "llm" || !node.spec) continue;
    drafted += Number(node.spec.drafted) || 0;
    accepted += Number(node.spec.accepted) || 0;
  }
  return drafted ? accepted / drafted : null;
}

const SPLIT = [["llm_active_s", "LLM", "decode"], ["tool_only_s", "tool", "tool_running"],
  ["waiting_for_input_s", "input", "input_wait"], ["neither_s", "neither", "waiting"]];

// The run's wall time split: an LLM call active / only tools running / only waiting for outside
// input (a wait_for node: a person's or a system's time, not the machine's) / neither. A bar with the
// LLM share in words beside it; the numbers are in the title and the label.
function splitBar(stalls) {
  if (!stalls) return el("span", { class: "muted" }, "—");
  const parts = SPLIT.map(([key, name, phase]) => [name, Number(stalls[key]) || 0, phase]);
  const total = parts.reduce((sum, [, s]) => sum + s, 0);
  if (!total) return el("span", { class: "muted" }, "—");
  const words = parts.map(([name, s]) => `${name} ${fmtDuration(s)}`).join(" · ");
  return el("span", { class: "split", title: words },
    el("span", { class: "split-bar", role: "img", "aria-label": words },
      parts.map(([name, s, phase]) => el("span", { class: `split-${name}`, style: `width:${(100 * s / total).toFixed(2)}%;background:${PHASE_COLORS?.[phase] ?? ""}` }))),
    el("span", { class: "split-text" }, `${Math.round(100 * parts[0][1] / total)}% LLM`));
}

function splitLegend() {
  return el("span", { class: "split-legend" },
    SPLIT.map(([, name, phase]) => el("span", { class: "swatch-item" },
      el("span", { class: "swatch", style: `background:${PHASE_COLORS?.[phase] ?? ""}`, "aria-hidden": "true" }), name)));
}

// ---- the start form ------------------------------------------------------------------------------------
async function loadPrograms(box, programFilter, filters, signal) {
  let programs;
  try {
    programs = (await api("/v1/programs", { signal })).data;
  } catch (e) {
    if (signal.aborted) return;
    box.replaceChildren(el("h2", { id: "start-title" }, "Start a run"),
      el("p", { class: "form-error", role: "alert" }, `Could not load the programs: ${e.message}`));
    return;
  }
  for (const p of programs) programFilter.append(el("option", { value: p.name, selected: p.name === filters.program }, p.name));
  if (!programs.length) {
    box.replaceChildren(el("h2", { id: "start-title" }, "Start a run"), el("p", { class: "muted" }, "The server serves no programs."));
    return;
  }
  box.replaceChildren(el("h2", { id: "start-title" }, "Start a run"), startForm(programs, filters.program, signal));
}

function startForm(programs, preferred, signal) {
  const byName = new Map(programs.map((p) => [p.name, p]));
  const select = el("select", { name: "program", id: "start-program", required: true },
    programs.map((p) => el("option", { value: p.name, selected: p.name === preferred }, p.name)));
  const description = el("div", { class: "hint program-description" });
  const fields = el("fieldset", { class: "fields" });
  const error = el("p", { class: "form-error", role: "alert", hidden: true });
  const submit = el("button", { type: "submit", class: "primary" }, "Start run");
  const form = el("form", { id: "start-form", novalidate: true },
    el("div", { class: "field" }, el("label", { for: "start-program" }, "Program"), select),
    description, fields, error, el("div", { class: "buttons" }, submit));

  const showProgram = () => {
    const program = byName.get(select.value);
    description.replaceChildren(...[docstringView(program?.description)].filter(Boolean));
    const schema = program?.input_schema || {};
    const controls = schemaFields(schema);
    fields.replaceChildren(el("legend", {}, "Inputs"),
      ...(controls.length ? controls : [el("p", { class: "muted" }, "This program takes no inputs.")]));
    showFormError(form, error, null);
  };
  select.addEventListener("change", showProgram);
  showProgram();

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    let inputs;
    try {
      inputs = readFields(fields);
    } catch (e) {
      showFormError(form, error, e);
      return;
    }
    submit.disabled = true;
    submit.textContent = "Starting…";
    try {
      const created = await api(`/v1/programs/${encodeURIComponent(select.value)}/runs`,
                                { method: "POST", body: { inputs }, signal });
      location.hash = `#/runs/${encodeURIComponent(created.run_id)}`;
    } catch (e) {
      if (signal.aborted) return;
      showFormError(form, error, e instanceof ApiError ? e : new Error(String(e.message || e)));
    } finally {
      submit.disabled = false;
      submit.textContent = "Start run";
    }
  });
  return form;
}

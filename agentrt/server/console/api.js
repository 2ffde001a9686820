// Talking to the agentrt server: JSON requests that carry the API key, the key dialog, an
// event-stream reader, and one shared connection to the server-wide stream /v1/events.
// The small DOM and formatting helpers every page uses live here too: this is the one module
// all the others already import, and the contract fixes the console's file list.

const KEY_STORAGE = "agentrt.apiKey";

// ---- errors -------------------------------------------------------------------------------------
export class ApiError extends Error {
  constructor(status, message, body = null) {
    super(message);
    this.status = status; // HTTP status, 0 when the server could not be reached
    this.body = body;
    this.param = body?.error?.param ?? null; // which field the server blames, when it says
    this.code = body?.error?.code ?? null;
  }
}

// The server answers errors as {"error": {"message", ...}}; anything else (a proxy's HTML page)
// still becomes a readable message.
async function errorOf(response) {
  const text = await response.text().catch(() => "");
  let body = null;
  try { body = JSON.parse(text); } catch { /* not JSON */ }
  const message = body?.error?.message || text.slice(0, 200) || `${response.status} ${response.statusText}`;
  return new ApiError(response.status, message, body);
}

// ---- the API key ---------------------------------------------------------------------------------
// sessionStorage, not localStorage: the key goes when the tab closes, and never into the URL.
export function getKey() {
  try { return sessionStorage.getItem(KEY_STORAGE) || null; } catch { return null; }
}

function setKey(key) {
  try { sessionStorage.setItem(KEY_STORAGE, key); } catch { /* storage off: the key lasts this page */ }
  memoryKey = key;
  window.dispatchEvent(new CustomEvent("agentrt:key"));
}

export function forgetKey() {
  try { sessionStorage.removeItem(KEY_STORAGE); } catch { /* nothing stored */ }
  memoryKey = null;
  window.dispatchEvent(new CustomEvent("agentrt:key"));
}

let memoryKey = null; // where sessionStorage is unavailable (some private modes)
const currentKey = () => getKey() ?? memoryKey;

function authHeaders(extra = {}) {
  const key = currentKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// Several requests failing with 401 at once (the runs list, the programs, the event stream)
// share one dialog and one answer.
let pendingKey = null;

// Why the dialog opens, in words for a person (the server's message is for API clients).
const keyReason = (usedKey, error) => usedKey ? `The key was not accepted (${error.message}).` : "This server needs an API key.";

/** Show #key-dialog; resolves to the key entered, or null when the user cancels. */
export function askForKey(reason = "This server needs an API key.") {
  if (!pendingKey) pendingKey = showKeyDialog(reason).finally(() => { pendingKey = null; });
  return pendingKey;
}

function showKeyDialog(reason) {
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  const input = form.elements.key;
  dialog.querySelector(".key-reason").textContent = reason;
  const forget = dialog.querySelector(".key-forget");
  const cancel = dialog.querySelector(".key-cancel");
  forget.hidden = !currentKey();
  input.value = "";
  return new Promise((resolve) => {
    const finish = (key) => {
      form.removeEventListener("submit", onSubmit);
      dialog.removeEventListener("close", onClose);
      forget.removeEventListener("click", onForget);
      cancel.removeEventListener("click", onClose);
      if (dialog.open) dialog.close();
      resolve(key);
    };
    const onSubmit = (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) { input.focus(); return; }
      setKey(key);
      finish(key);
    };
    const onForget = () => { forgetKey(); finish(null); };
    const onClose = () => finish(null); // Escape, or the Cancel button
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("close", onClose);
    forget.addEventListener("click", onForget);
    cancel.addEventListener("click", onClose);
    dialog.showModal();
    input.focus();
  });
}

// ---- requests ------------------------------------------------------------------------------------
/**
 * fetch() a /v1 path. body (any JSON value) is sent as JSON; `as: "text"` returns the body as text
 * (the trace is JSONL). A 401 asks for the key and tries again; other errors throw ApiError.
 */
export async function api(path, { method = "GET", body, signal, as = "json" } = {}) {
  for (;;) {
    const usedKey = currentKey();
    const headers = authHeaders(body === undefined ? {} : { "Content-Type": "application/json" });
    let response;
    try {
      response = await fetch(path, { method, headers, signal, cache: "no-store",
                                     body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (e) {
      if (signal?.aborted) throw e;
      throw new ApiError(0, `the server could not be reached (${e.message})`);
    }
    if (response.status === 401) {
      const error = await errorOf(response);
      // another request may have got a new key meanwhile: try that before asking again
      if (currentKey() !== usedKey || await askForKey(keyReason(usedKey, error))) continue;
      error.message = `${error.message} (the API key button at the top asks for it)`;
      throw error;
    }
    if (!response.ok) throw await errorOf(response);
    if (as === "text") return response.text();
    return response.status === 204 ? null : response.json();
  }
}

// ---- event streams -------------------------------------------------------------------------------
/**
 * Read a text/event-stream over fetch (EventSource cannot send the Authorization header).
 * Calls onEvent(type, data, id) per event, data parsed as JSON (the raw text if it is not).
 * After a drop, or when the server ends the stream, it connects again with Last-Event-ID after a
 * growing pause (0.5 s doubling to 15 s, back to 0.5 s once events flow) until signal aborts; so
 * a caller whose stream ends for good (a run's events after run_finished) aborts it.
 * onState("open" | "reconnecting" | "error", error?) tells the connection's state; "error" is
 * final (a 4xx such as 404, or no key given).
 */
export async function streamEvents(path, onEvent, { signal, onState = () => {} } = {}) {
  let lastId = null;
  let delay = 500;
  while (!signal?.aborted) {
    try {
      const usedKey = currentKey();
      const headers = authHeaders({ Accept: "text/event-stream" });
      if (lastId !== null) headers["Last-Event-ID"] = lastId;
      const response = await fetch(path, { headers, signal, cache: "no-store" });
      if (response.status === 401) {
        const error = await errorOf(response);
        if (currentKey() !== usedKey || await askForKey(keyReason(usedKey, error))) continue;
        onState("error", error);
        return;
      }
      if (!response.ok) {
        const error = await errorOf(response);
        // a 4xx will not change by asking again, except "too many streams" and timeouts
        if (response.status < 500 && response.status !== 408 && response.status !== 429) {
          onState("error", error);
          return;
        }
        throw error;
      }
      onState("open");
      await readStream(response.body, (type, data, id) => {
        delay = 500;
        if (id !== null) lastId = id;
        try {
          onEvent(type, data, id);
        } catch (e) {
          console.error(`handling the ${type} event of ${path} failed`, e); // one bad event must not stop the stream
        }
      }, (ms) => { delay = ms; });
    } catch (e) {
      if (signal?.aborted) return;
      console.warn(`event stream ${path} dropped`, e);
    }
    if (signal?.aborted) return;
    onState("reconnecting");
    await sleep(delay * (0.8 + 0.4 * Math.random()), signal); // jitter: many tabs do not come back in step
    delay = Math.min(delay * 2, 15000);
  }
}

// The event-stream format (html.spec.whatwg.org "Interpreting an event stream"): lines end in
// \n, \r\n or \r; "field: value" lines (one space after the colon dropped); ":" starts a comment;
// an event ends at a blank line; its data lines join with "\n"; the id stays until changed.
async function readStream(body, dispatch, setRetry) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let type = "";
  let data = [];
  let id = null;
  const line = (text) => {
    if (text === "") {
      if (data.length) {
        const raw = data.join("\n");
        let value = raw;
        try { value = JSON.parse(raw); } catch { /* plain text data */ }
        dispatch(type || "message", value, id);
      }
      type = "";
      data = [];
      return;
    }
    if (text[0] === ":") return;
    const colon = text.indexOf(":");
    const field = colon < 0 ? text : text.slice(0, colon);
    let value = colon < 0 ? "" : text.slice(colon + 1);
    if (value[0] === " ") value = value.slice(1);
    if (field === "data") data.push(value);
    else if (field === "event") type = value;
    else if (field === "id" && !value.includes("\0")) id = value;
    else if (field === "retry" && /^\d+$/.test(value)) setRetry(Number(value));
  };
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return; // an event not ended by a blank line is dropped, as the spec says
      buffer += decoder.decode(value, { stream: true });
      const eol = /\r\n|\n|\r/g;
      let start = 0;
      let m;
      while ((m = eol.exec(buffer))) {
        if (m[0] === "\r" && m.index === buffer.length - 1) break; // maybe the first half of \r\n
        line(buffer.slice(start, m.index));
        start = eol.lastIndex;
      }
      buffer = buffer.slice(start);
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// A pause that an abort ends early; the abort listener goes when the pause ends either way (a
// page's signal lives long, and a stream that keeps reconnecting would pile them up).
function sleep(ms, signal) {
  return new Promise((resolve) => {
    const done = () => { clearTimeout(timer); signal?.removeEventListener("abort", done); resolve(); };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}

// ---- the server-wide stream, shared ----------------------------------------------------------------
// One connection to /v1/events for the whole page (the runs table, the engine panel and a run page
// all listen): browsers allow few connections per host, and the server limits open streams.
// hello and engine are kept, so a view that subscribes later starts with the current numbers.
const hub = { listeners: new Set(), controller: null, closeTimer: null, last: new Map(), state: "closed" };

/** listener(type, data) for every /v1/events event; returns the unsubscribe function. */
export function onServerEvents(listener) {
  hub.listeners.add(listener);
  clearTimeout(hub.closeTimer);
  for (const [type, data] of hub.last) listener(type, data);
  if (!hub.controller) openHub();
  return () => {
    hub.listeners.delete(listener);
    // a page change unsubscribes and subscribes again at once: keep the connection meanwhile
    if (!hub.listeners.size) hub.closeTimer = setTimeout(closeHub, 3000);
  };
}

/** "open" | "reconnecting" | "error" | "closed": the state of the shared /v1/events connection. */
export const serverEventsState = () => hub.state;

function setHubState(state) {
  hub.state = state;
  window.dispatchEvent(new CustomEvent("agentrt:connection", { detail: state }));
}

function openHub() {
  hub.controller = new AbortController();
  streamEvents("/v1/events", (type, data) => {
    if (type === "hello" || type === "engine") hub.last.set(type, data);
    for (const listener of [...hub.listeners]) {
      try { listener(type, data); } catch (e) { console.error(`a /v1/events listener failed on ${type}`, e); }
    }
  }, { signal: hub.controller.signal, onState: setHubState });
}

function closeHub() {
  hub.controller?.abort();
  hub.controller = null;
  hub.last.clear();
  setHubState("closed");
}

/** After the key changed: connect again with it. */
export function reconnectServerEvents() {
  if (!hub.controller) return;
  hub.controller.abort();
  hub.last.clear();
  openHub();
}

// ---- DOM and format helpers ------------------------------------------------------------------------
/** el("a", {href: "#/", class: "x", dataset: {k: v}, onclick: f}, "text", child, [more]) */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k.startsWith("on") && typeof v === "function") node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

export const ENDED = new Set(["done", "failed", "cancelled"]);

/** 0.85 -> "850 ms", 12.34 -> "12.3 s", 245 -> "4m 05s", 7300 -> "2h 01m"; "—" when unknown */
export function fmtDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "—";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(m / 60)}h ${String(m % 60).padStart(2, "0")}m`;
}

/** unix seconds -> local time: the time only for today, else date and time */
export function fmtTime(unix) {
  if (!unix) return "—";
  const d = new Date(unix * 1000);
  const today = new Date().toDateString() === d.toDateString();
  return today ? d.toLocaleTimeString() : d.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

/** a number with `digits` decimals, "—" when null */
export function fmtNum(x, digits = 0) {
  return x === null || x === undefined || !Number.isFinite(Number(x)) ? "—" : Number(x).toFixed(digits);
}

// The console's entry: the hash router (#/ runs, #/runs/<id> a run, #/trace a trace file), the top
// bar (connection state, API key) and the trace-file page. Hash routes need nothing from the
// server: it serves this one page at / and every route is drawn here.

import { askForKey, el, getKey, reconnectServerEvents, serverEventsState } from "./api.js";
import { showRunsPage, statusBadge } from "./runs.js";
import { RunDisplay, showRunPage } from "./run.js";
import { parseJsonl, viewsFromTrace } from "/view/model.js";

const main = document.getElementById("main");
let current = null; // the AbortController of the page shown: aborting it stops its streams and timers

function route() {
  current?.abort();
  current = new AbortController();
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = hash.split("?");
  const query = new URLSearchParams(search);
  const runMatch = path.match(/^\/runs\/([^/]+)\/?$/);
  let section = "runs";
  document.title = "agentrt console";
  let runId = null, badLink = null;
  try {
    runId = runMatch ? decodeURIComponent(runMatch[1]) : null;
  } catch (e) { // a hand-edited or cut link ("%E0%A4%A"): say so instead of leaving a dead page
    badLink = `this is a bad link: "${hash}" is not a valid run address (${e.message}). The runs are below.`;
  }
  if (runId !== null) {
    showRunPage(main, runId, current.signal);
    section = "run";
  } else if (path === "/trace") {
    showTracePage(main, current.signal);
    section = "trace";
  } else {
    showRunsPage(main, badLink ? new URLSearchParams() : query, current.signal);
    if (badLink) main.prepend(el("p", { id: "bad-link", class: "form-error", role: "alert" }, badLink));
  }
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === section) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  // a page change moves focus to the content, as a page load would (screen readers announce it)
  if (document.activeElement && document.activeElement !== document.body && !main.contains(document.activeElement)) main.focus({ preventScroll: true });
  window.scrollTo(0, 0);
}

// ---- top bar -------------------------------------------------------------------------------------
const connection = document.getElementById("connection");
const CONNECTION_WORDS = { open: "live", reconnecting: "reconnecting…", error: "disconnected", closed: "not live" };

function showConnection(state) {
  connection.dataset.state = state;
  connection.textContent = CONNECTION_WORDS[state] ?? state;
  connection.title = state === "open" ? "receiving live events from the server" : "no live events: the numbers may be old";
}

const keyButton = document.getElementById("key-button");
function showKeyState() {
  keyButton.textContent = getKey() ? "API key ✓" : "API key";
  keyButton.title = getKey() ? "a key is stored for this tab: change or forget it" : "enter the server's API key";
}

keyButton.addEventListener("click", async () => {
  const before = getKey();
  await askForKey(before ? "Enter a new key, or forget the stored one." : "Enter the server's API key.");
  if (getKey() !== before) { reconnectServerEvents(); route(); }
});

window.addEventListener("agentrt:connection", (e) => showConnection(e.detail));
window.addEventListener("agentrt:key", showKeyState);
window.addEventListener("hashchange", route);
showConnection(serverEventsState());
showKeyState();
route();

// ---- the trace-file page ---------------------------------------------------------------------------
// A saved trace (`agentrt run --trace`, or Download trace on a run page) read in the browser: nothing
// goes to the server. Several runs in one file get a picker.
function showTracePage(main, signal) {
  const input = el("input", { type: "file", id: "trace-file", name: "trace", accept: ".jsonl,.json,.ndjson,.txt,application/jsonl" });
  const note = el("p", { class: "form-error", role: "alert", hidden: true });
  const picker = el("div", { class: "trace-picker", hidden: true });
  const shown = el("div", { id: "trace-view" });
  const drop = el("div", { class: "card drop-zone" },
    el("h1", {}, "Open a trace file"),
    el("p", { class: "muted" }, "A JSON-lines trace of one or more runs. It is read here, in the browser; nothing is uploaded."),
    el("label", { for: "trace-file" }, "Trace file "), input,
    el("p", { class: "hint" }, "Or drop the file on this box."),
    note);
  main.replaceChildren(el("section", { id: "trace-page", class: "trace-page", "aria-label": "Trace file" }, drop, picker, shown));

  const open = async (file) => {
    note.hidden = true;
    picker.hidden = true;
    shown.replaceChildren();
    let views;
    try {
      const records = parseJsonl(await file.text());
      views = viewsFromTrace(records);
    } catch (e) {
      note.textContent = `${file.name} could not be read as a trace: ${e.message}`;
      note.hidden = false;
      return;
    }
    if (signal.aborted) return;
    if (!views.length) {
      note.textContent = `${file.name} holds no run.`;
      note.hidden = false;
      return;
    }
    const show = (i) => {
      const display = new RunDisplay();
      shown.replaceChildren(display.root);
      display.render(views[i]);
      for (const b of picker.querySelectorAll("button")) b.setAttribute("aria-pressed", String(Number(b.dataset.index) === i));
    };
    if (views.length > 1) {
      picker.replaceChildren(el("h2", {}, `${views.length} runs in ${file.name}`),
        el("div", { class: "table-scroll" }, el("table", { class: "runs-table" },
          el("thead", {}, el("tr", {}, ["", "Run", "Program", "Status"].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody", {}, views.map((v, i) => el("tr", { dataset: { runId: v.run?.run_id ?? "" } },
            el("td", {}, el("button", { type: "button", dataset: { index: i }, onclick: () => show(i) }, "Show")),
            el("th", { scope: "row" }, el("code", {}, v.run?.run_id ?? `run ${i + 1}`)),
            el("td", {}, v.run?.program ?? ""),
            el("td", {}, statusBadge(v.run?.status ?? "unknown"))))))));
      picker.hidden = false;
    }
    show(0);
  };

  input.addEventListener("change", () => { if (input.files[0]) open(input.files[0]); });
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("dragging"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("dragging"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("dragging");
    const file = e.dataTransfer?.files?.[0];
    if (file) open(file);
  });
}

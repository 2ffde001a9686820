// The engine panel: what the shared engine is doing right now, from the `hello` and `engine`
// events of /v1/events (a snapshot a second; no polling). Big on the runs page, a compact strip
// on a run page. Every number sits alone in an element with data-metric=<name>, so tests and
// people read the same text.

import { el, fmtNum, onServerEvents } from "./api.js";

const STALE_MS = 3500; // snapshots come every second: three missed means the numbers are old

// The KV cache's block counts as the engine reports them ({total, free, used, cached, pinned}),
// with what each means: cached blocks may be held by a running sequence too (then also used),
// or free for reuse; so the four do not add up to the total, and only `used` is drawn in the bar.
const KV_PARTS = [
  ["used", "used", "blocks held by running sequences (total − free)"],
  ["cached", "cached", "blocks holding prefix-cache content (may overlap used; when free, reused on a prefix hit or given away when needed)"],
  ["pinned", "pinned", "cached blocks kept for a program waiting on a tool (given away last)"],
  ["free", "free", "blocks not held by a running sequence, cached ones included"],
];

/**
 * Build the panel into container; returns a function that takes it down (stops listening).
 * compact: one line of numbers and a small histogram (the run page).
 */
export function mountEnginePanel(container, { compact = false } = {}) {
  const metric = (name, digits = 0) => el("span", { class: "metric-value", dataset: { metric: name, digits } }, "—");
  const item = (label, ...values) => el("div", { class: "metric" }, el("dt", {}, label), el("dd", {}, ...values));

  const model = el("span", { class: "engine-model" });
  const freshness = el("span", { class: "engine-freshness", role: "status" }, "waiting for data");
  const kvBar = el("span", { class: "kv-bar", role: "img", "aria-label": "KV blocks: no data" });
  const hist = el("div", { class: "k-hist", dataset: { metric: "k_hist_60s" }, role: "img",
                           "aria-label": "k per step over the last minute: no steps" });

  const panel = el("section", { id: "engine-panel", class: compact ? "engine-panel compact" : "engine-panel",
                                "aria-labelledby": "engine-title", dataset: { state: "waiting" } },
    el("h2", { id: "engine-title" }, "Engine ", model, freshness),
    el("dl", { class: "metrics" },
      item("Batch", metric("batch_size")),
      item("Tokens/s", metric("tokens_per_s", 1)),
      item("Steps/s", metric("steps_per_s", 1)),
      item(el("span", { title: "accepted drafts / drafted tokens over the last 60 s" }, "α (60 s)"), metric("alpha_60s", 2)),
      item("KV blocks",
        el("span", { class: "triple" },
          ...KV_PARTS.flatMap(([key, word, title], i) => [
            el("span", { title }, metric(`kv_${key}`), el("span", { class: "unit" }, ` ${word}${i < KV_PARTS.length - 1 ? " · " : ""}`))])),
        kvBar),
      item("Runs",
        el("span", { class: "triple" },
          metric("runs_running"), el("span", { class: "unit" }, " running · "),
          metric("runs_queued"), el("span", { class: "unit" }, " queued · "),
          metric("runs_waiting"), el("span", { class: "unit" }, " waiting"))),
      el("div", { class: "metric k-metric" },
        el("dt", { title: "how many steps drafted k tokens (the step's largest k), over the last 60 s" }, "k per step (60 s)"),
        el("dd", {}, hist))));
  container.replaceChildren(panel);

  const set = (name, value) => {
    const node = panel.querySelector(`[data-metric="${name}"]`);
    node.textContent = fmtNum(value, Number(node.dataset.digits));
  };

  let lastSnapshot = 0;
  const show = (snap) => {
    if (!snap || typeof snap !== "object") return;
    lastSnapshot = Date.now();
    panel.dataset.state = "live";
    freshness.textContent = "live";
    set("batch_size", snap.batch_size);
    set("tokens_per_s", snap.tokens_per_s);
    set("steps_per_s", snap.steps_per_s);
    set("alpha_60s", snap.alpha_60s);
    const kv = snap.kv || {};
    for (const [key] of KV_PARTS) set(`kv_${key}`, kv[key]);
    drawKv(kvBar, kv);
    const runs = snap.runs || {};
    set("runs_running", runs.running);
    set("runs_queued", runs.queued);
    set("runs_waiting", runs.waiting);
    drawHistogram(hist, snap.k_hist_60s || {});
  };

  const unsubscribe = onServerEvents((type, data) => {
    if (type === "hello") {
      model.textContent = data.model ? `· ${data.model}${data.precision ? ` (${data.precision})` : ""}` : "";
      show(data.engine);
    } else if (type === "engine") {
      show(data);
    } else if (type === "engine_steps" && data.steps?.length) {
      // the batch size moves faster than the one-second snapshot: take it from the newest step
      set("batch_size", data.steps[data.steps.length - 1].batch_size);
    }
  });

  // Say so when the numbers stop coming (a dropped connection), rather than showing old ones as live.
  const timer = setInterval(() => {
    if (lastSnapshot && Date.now() - lastSnapshot > STALE_MS && panel.dataset.state !== "stale") {
      panel.dataset.state = "stale";
      freshness.textContent = "no updates";
    }
  }, 1000);

  return () => { unsubscribe(); clearInterval(timer); };
}

// KV: the bar is the blocks used by running sequences out of the total; cached and pinned (which
// may sit in used or in free) are in the numbers beside it and in the bar's title, not drawn.
function drawKv(bar, kv) {
  const num = (x) => (Number.isFinite(Number(x)) ? Number(x) : null);
  const used = num(kv.used) ?? 0, free = num(kv.free), cached = num(kv.cached), pinned = num(kv.pinned);
  const total = num(kv.total) ?? used + (free ?? 0);
  bar.replaceChildren();
  if (!total) {
    bar.setAttribute("aria-label", "KV blocks: no data");
    bar.removeAttribute("title");
    return;
  }
  const share = Math.min(100, (100 * used) / total);
  bar.append(el("span", { class: "kv-used", style: `width:${share.toFixed(2)}%` }),
             el("span", { class: "kv-free", style: `width:${(100 - share).toFixed(2)}%` }));
  const words = `${used} of ${total} blocks used by running sequences (${share.toFixed(0)}%)` +
    (free !== null ? `, ${free} free` : "") + (cached !== null ? `, ${cached} cached (prefix cache)` : "") +
    (pinned !== null ? `, ${pinned} of them pinned for programs waiting on a tool` : "");
  bar.setAttribute("aria-label", `KV blocks: ${words}`);
  bar.title = words;
}

// k histogram: one bar per k from 0 to the largest seen, height by its share of steps; each
// bar's title and the figure's label give the counts.
function drawHistogram(container, counts) {
  const entries = Object.entries(counts).map(([k, n]) => [Number(k), Number(n) || 0]).filter(([k]) => Number.isFinite(k));
  container.replaceChildren();
  if (!entries.length) {
    container.setAttribute("aria-label", "k per step over the last minute: no steps");
    container.append(el("span", { class: "muted" }, "no steps"));
    return;
  }
  const byK = new Map(entries);
  const maxK = Math.max(...byK.keys());
  const maxN = Math.max(1, ...byK.values());
  const words = [];
  for (let k = 0; k <= maxK; k++) {
    const n = byK.get(k) || 0;
    words.push(`k=${k}: ${n}`);
    container.append(el("span", { class: "k-bar", title: `k=${k}: ${n} step${n === 1 ? "" : "s"}`, dataset: { k, count: n } },
      el("span", { class: "k-fill", style: `height:${(100 * n / maxN).toFixed(1)}%` }),
      el("span", { class: "k-label", "aria-hidden": "true" }, String(k))));
  }
  container.setAttribute("aria-label", `steps by k over the last minute: ${words.join(", ")}`);
}

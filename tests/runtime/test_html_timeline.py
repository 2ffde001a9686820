"""`agentrt inspect --html`: one self-contained page built from the web console's renderer
(agentrt/runtime/webview): nothing fetched from elsewhere, the trace embedded so that it parses
back to the same records, every renderer module inlined without import/export statements, and
a `</script>` inside a value (a model's output, a tool's error) kept from ending the script.

No browser here (tests/server/test_console_browser.py opens the pages in Chromium). Where node
is installed, two checks also run the JavaScript: the inlined module parses, and the view model
(model.js and live.js, no DOM) builds from a saved trace, from an old trace without graph, and from a run's
live events the same lanes."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from agentrt.dag import Program
from agentrt.runtime import Runtime, read_trace
from agentrt.runtime.html_timeline import MODULES, STYLESHEET, WEBVIEW, embed_json, inline_modules, render_html
from agentrt.runtime.summary import summarize
from agentrt.tools import tool

PAYLOAD = "</script><script>alert(1)</script>"
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (the JavaScript checks need it)")


@tool(retries=1, backoff_s=0.01, retry_on=LookupError)
def lookup(city: str) -> str:
    """Weather of a city (fails for 'nowhere', with markup in its error)."""
    if city == "nowhere":
        raise LookupError(f"no city {PAYLOAD}")
    return f"sunny in {city}"


@pytest.fixture
async def traced(scripted, tmp_path):
    """(records, live events) of one run: two tools (one failing, with a fallback) and an LLM
    node whose output holds a </script>."""
    p = Program("trip", inputs={"city": str}, tools=[lookup])
    weather = p.tool("weather", "lookup", args={"city": p.input("city")})
    alt = p.tool("alt", "lookup", args={"city": "nowhere"}, fallback="none")
    p.output(p.llm("plan", prompt="Plan around {weather} and {alt}"))
    rt = Runtime(scripted({"plan": "Go north. " + PAYLOAD}, k=3, accepted=1), tools=[lookup])
    events: list[dict] = []
    rt.subscribe_events(lambda e: events.append({"run_id": e.run_id, "type": e.type, "data": {**e.data, "time": e.time}}))
    run = await rt.submit(p, {"city": "Oslo"})
    assert run.status == "done"
    return read_trace(rt.trace.write(tmp_path / "trip.jsonl")), events


class _Scripts(HTMLParser):
    """The page as an HTML tokenizer splits it: each <script>'s attributes and raw text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.scripts: list[tuple[dict, str]] = []
        self._open: list | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open = [dict(attrs), ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag):
        if tag == "script" and self._open is not None:
            self.scripts.append((self._open[0], self._open[1]))
            self._open = None


def scripts_of(page: str) -> dict[str, str]:
    parser = _Scripts()
    parser.feed(page)
    parser.close()
    by_kind = {}
    for attrs, text in parser.scripts:
        assert "src" not in attrs
        by_kind[attrs.get("id") or attrs.get("type")] = text
    assert len(parser.scripts) == len(by_kind) == 2, [a for a, _ in parser.scripts]
    return by_kind


def page_of(records: list[dict]) -> str:
    return render_html(summarize(records), records)


def test_the_page_is_one_file_with_nothing_from_elsewhere(traced):
    page = page_of(traced[0])
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:)?//""", page)
    assert not re.search(r"""url\(\s*["']?\s*(https?:)?//|@import""", page)  # nor from the stylesheet
    assert "<link" not in page and "<iframe" not in page
    assert set(scripts_of(page)) == {"agentrt-trace", "module"}
    assert (WEBVIEW / STYLESHEET).read_text(encoding="utf-8").strip() in page  # the renderer's styles, inline


def test_the_embedded_trace_parses_back_to_the_same_records(traced):
    records = traced[0]
    summary = summarize(records)
    data = json.loads(scripts_of(render_html(summary, records))["agentrt-trace"])
    assert data["records"] == records
    assert data["summary"] == json.loads(json.dumps(summary))


def test_every_renderer_module_is_inlined_without_import_or_export(traced):
    script = scripts_of(page_of(traced[0]))["module"]
    assert not re.search(r"^\s*(import|export)\b", script, re.M)
    at = [script.index(f"// ---- {name} ----") for name in MODULES]
    assert at == sorted(at)  # in dependency order, standalone.js (which draws the page) last
    for name in MODULES:
        for kind, top in re.findall(r"^export (function|const|class) (\w+)", (WEBVIEW / name).read_text(), re.M):
            assert re.search(rf"^{kind} {top}\b", script, re.M), (name, top)
    assert script.strip() == inline_modules().strip()


def test_a_script_end_inside_values_keeps_the_page_intact(traced):
    records = traced[0]
    page = page_of(records)
    assert page.lower().count("</script") == 2  # only the two scripts' own ends
    data = json.loads(scripts_of(page)["agentrt-trace"])
    (run,) = data["summary"]["runs"]
    assert run["output"] == "Go north. " + PAYLOAD
    assert PAYLOAD in next(n["error"] for n in run["nodes"] if n["node"] == "alt")
    # "<!--" would put the HTML parser in a state where the real </script> does not end the script
    odd = [dict(r, meta={"note": f"<!--<script>{PAYLOAD}"}) if r["type"] == "trace" else r for r in records]
    page = page_of(odd)
    text = scripts_of(page)["agentrt-trace"]
    assert "<!--" not in text and json.loads(text)["records"][0]["meta"]["note"] == f"<!--<script>{PAYLOAD}"
    assert page.lower().count("</script") == 2


def test_values_json_cannot_hold_are_written_as_null():
    text = embed_json({"records": [{"predicted_s": math.nan, "kv": math.inf, "ok": 1.5}]})
    assert json.loads(text) == {"records": [{"predicted_s": None, "kv": None, "ok": 1.5}]}


def test_the_webview_modules_follow_the_inlining_rules():
    names: dict[str, str] = {}
    for path in sorted(WEBVIEW.glob("*.js")):
        text = path.read_text(encoding="utf-8")
        lines = text.split("\n")
        assert len(lines) < 500, path.name
        assert "</" not in text and "<!--" not in text, path.name  # safe inside an inline <script> as is
        assert not re.search(r"^export\s+(default|\{|\*)", text, re.M), path.name
        imports = [i for i, line in enumerate(lines) if line.startswith("import")]
        for i in imports:
            assert re.fullmatch(r'import \{ [\w, ]+ \} from "\./\w+\.js";', lines[i]), lines[i]
        code = [i for i, line in enumerate(lines) if line.strip() and not line.startswith(("//", "import"))]
        assert not imports or max(imports) < min(code), f"{path.name}: imports go at the top"
        for top in re.findall(r"^(?:export )?(?:async )?(?:function|const|let|var|class) (\w+)", text, re.M):
            assert top not in names, f"{top} is defined in {names.get(top)} and {path.name}"
            names[top] = path.name
    assert {p.name for p in WEBVIEW.glob("*.js")} == set(MODULES)
    assert len((WEBVIEW / STYLESHEET).read_text(encoding="utf-8").split("\n")) < 500


@needs_node
def test_the_inlined_module_parses(tmp_path):
    script = tmp_path / "page.mjs"
    script.write_text(inline_modules(), encoding="utf-8")
    done = subprocess.run([NODE, "--check", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# Runs model.js and live.js (no DOM in them) under node: the views a saved trace, the same trace
# without the fields old traces lack, and the run's live events give.
_RUNNER = """
import { readFileSync } from "node:fs";
import { viewsFromTrace } from "./model.mjs";
import { LiveView } from "./live.mjs";
const input = JSON.parse(readFileSync(process.argv[2], "utf8"));
const brief = (v) => ({ run: v.run, keys: Object.keys(v).sort(), graph: v.graph ? v.graph.nodes.map((n) => n.id) : null,
  lanes: v.nodes.map((n) => [n.id, n.kind, n.status]), nodeKeys: v.nodes.map((n) => Object.keys(n).sort()),
  phases: v.nodes.map((n) => n.phases.map((p) => p.phase)), critical: v.critical, steps: v.engine.steps.length,
  llm: v.nodes.filter((n) => n.llm).map((n) => n.llm), hasSummary: v.summary !== null });
const saved = viewsFromTrace(input.records, input.summary);
const old = viewsFromTrace(input.old);
const live = new LiveView({ run_id: saved[0].run.run_id, program: saved[0].run.program, status: "queued" });
for (const e of input.events) live.apply(e.type, e.data);
live.addEngineSteps(input.records.filter((r) => r.type === "engine_step"));
const during = brief(live.view);
live.finish(input.records, input.summary);
console.log(JSON.stringify({ saved: saved.map(brief), old: old.map(brief), live: during, finished: brief(live.view) }));
"""


@needs_node
def test_the_view_model_gives_the_same_lanes_from_a_trace_an_old_trace_and_live_events(traced, tmp_path):
    records, events = traced
    summary = summarize(records)
    old = [{k: v for k, v in r.items() if k not in ("graph", "ks", "accepted_ks")} for r in records]
    shutil.copy(WEBVIEW / "model.js", tmp_path / "model.mjs")
    (tmp_path / "live.mjs").write_text((WEBVIEW / "live.js").read_text().replace('"./model.js"', '"./model.mjs"'))
    (tmp_path / "run.mjs").write_text(_RUNNER, encoding="utf-8")
    (tmp_path / "input.json").write_text(json.dumps({"records": records, "summary": summary, "old": old, "events": events},
                                                    default=repr), encoding="utf-8")
    done = subprocess.run([NODE, str(tmp_path / "run.mjs"), str(tmp_path / "input.json")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    (saved,), (old_view,) = out["saved"], out["old"]
    (run,) = summary["runs"]
    assert saved["run"]["status"] == "done" and saved["run"]["output"] == run["output"] and saved["hasSummary"]
    assert sorted(saved["lanes"]) == sorted([n["node"], n["kind"], n["status"]] for n in run["nodes"])
    assert saved["critical"][-1] == "plan"  # the node that ended last, then back along waited_on
    assert saved["steps"] == len([r for r in records if r["type"] == "engine_step"
                                  and r["end"] >= run["start"] and r["start"] <= run["end"]]) > 0
    plan = next(n for n in run["nodes"] if n["node"] == "plan")
    (llm,) = saved["llm"]
    assert llm["drafted"] == plan["spec"]["drafted"] > 0 and llm["alpha"] == plan["spec"]["alpha"]
    assert sum(llm["run_hist"].values()) > 0  # the accepted-run histogram of its verifying steps
    assert "tool_retried" in saved["phases"][[lane[0] for lane in saved["lanes"]].index("alt")]
    # an old trace (no graph, no ks): the same lanes, and no graph to draw (the DAG rebuilds one)
    assert old_view["graph"] is None and old_view["lanes"] == saved["lanes"] and not old_view["hasSummary"]
    # live: the same shape, the same lanes in the same order, then the trace's view once finished
    live = out["live"]
    assert live["keys"] == saved["keys"] and live["nodeKeys"][0] == saved["nodeKeys"][0]
    assert live["run"]["status"] == "done" and live["run"]["output"] == run["output"]
    assert live["lanes"] == saved["lanes"]
    assert out["finished"] == saved

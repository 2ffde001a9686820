"""The web console in a real browser: Debian's headless Chromium driven by Playwright, against
`agentrt serve` as a real process on the embedded model, with an API key (so the page asks for it).

A screenshot of each page state is written to artifacts/console/ (AGENTRT_ARTIFACTS overrides
artifacts/)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from agentrt.server.process import start_server
from agentrt.tools.mosquitto import free_port

ROOT = Path(__file__).parents[2]
HERE = Path(__file__).parent
KEY = "console-key-42"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("AGENTRT_ARTIFACTS", ROOT / "artifacts")) / "console"
RUN_TIMEOUT_MS = 300_000  # a whole example on 2 CPU cores
PRECISION = "GGUF Q4_1/Q8_0, int8 kernels, float32 activations, bfloat16 K/V"  # the embedded model's LoadedModel.precision

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, runs = free_port(), tmp_path_factory.mktemp("console")
    (runs / "keys").write_text(KEY + "\n")
    programs = [ROOT / "examples" / "trip_planner.py", HERE / "lookup_program.py", HERE / "approval_program.py",
                ROOT / "examples" / "refund_desk.py"]
    proc, url = start_server([*map(str, programs), "--program-max-tokens", "96", "--runs-dir", str(runs / "runs"),
                              "--api-key-file", str(runs / "keys"), "--shutdown-grace", "5"], runs, port, ROOT)
    yield url, runs
    proc.terminate()
    assert proc.wait(timeout=30) == 0, (runs / "server.log").read_text()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("the console tests need Debian's chromium: run `make install` (it installs it with apt-get)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: m.type == "error" and "401" not in m.text and errors.append(m.text))
    yield pg
    context.close()
    assert not errors, errors  # no script errors on any page state


def shot(pg, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def api(server, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(server[0] + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def log_in(pg, server) -> None:
    """The server has a key: the console asks for it (kept in sessionStorage, not in the URL)."""
    pg.goto(server[0] + "/")
    pg.locator("#key-dialog input[name=key]").fill(KEY)
    pg.locator("#key-dialog input[name=key]").press("Enter")
    pg.locator("#runs-table").wait_for()
    assert KEY not in pg.url
    assert pg.evaluate("sessionStorage.getItem('agentrt.apiKey')") == KEY


def start_from_form(pg, program: str, fields: dict[str, object]) -> str:
    form = pg.locator("#start-form")
    form.locator("select[name=program]").select_option(program)
    for name, value in fields.items():
        field = form.locator(f"[name={name}]")
        if isinstance(value, bool):
            field.set_checked(value)
        else:
            field.fill(str(value))
    form.locator("button[type=submit]").click()
    pg.locator("#run-page[data-run-id]").wait_for()
    return pg.locator("#run-page").get_attribute("data-run-id")


def wait_status(pg, status: str, timeout_ms: int = RUN_TIMEOUT_MS) -> None:
    pg.locator(f"#run-page[data-status={status}]").wait_for(timeout=timeout_ms)


def node_lanes(pg) -> list[str]:
    return pg.eval_on_selector_all("#timeline [data-lane=node]", "els => els.map(e => e.dataset.node)")


def test_runs_page_asks_for_the_key_then_lists_programs_and_engine(page, server):
    page.goto(server[0] + "/")
    page.locator("#key-dialog input[name=key]").wait_for()
    shot(page, "01-key-dialog")
    log_in(page, server)
    options = page.eval_on_selector_all("#start-form select[name=program] option", "os => os.map(o => o.value)")
    assert {"trip_planner", "lookup", "approve"} <= set(options)
    page.locator("#engine-panel [data-metric=batch_size]").wait_for()
    # what runs, in the words of the serve banner and /v1/models
    assert page.locator("#engine-panel .engine-model").inner_text() == f"· smollm2-135m-instruct ({PRECISION})"
    shot(page, "02-runs-page")


def test_a_run_started_from_the_form_is_watched_live_to_its_end(page, server):
    log_in(page, server)
    run_id = start_from_form(page, "trip_planner", {})
    page.locator("#dag .dag-node").first.wait_for()
    shot(page, "03-run-live")
    wait_status(page, "done")
    info = api(server, f"/v1/runs/{run_id}")
    nodes = info["summary"]["runs"][0]["nodes"]
    page.locator("#dag .dag-node.critical").first.wait_for()
    # the DAG shows every LLM and tool node done
    states = dict(page.eval_on_selector_all("#dag .dag-node", "els => els.map(e => [e.dataset.node, e.dataset.state])"))
    assert {n["node"] for n in nodes} <= set(states)
    assert all(states[n["node"]] == "ok" for n in nodes), states
    # the timeline: a lane per node, and the engine lanes
    assert sorted(node_lanes(page)) == sorted(n["node"] for n in nodes)
    for lane in ("engine-batch", "engine-k", "engine-accepted"):
        assert page.locator(f"#timeline [data-lane={lane}]").count() == 1
    # the α table matches the run's summary from the API
    shown = dict(page.eval_on_selector_all("#alpha-table tr[data-node]",
                                           "rows => rows.map(r => [r.dataset.node, r.querySelector('[data-alpha]')"
                                           "?.dataset.alpha ?? null])"))
    for n in nodes:
        if n["kind"] == "llm":
            alpha = n["spec"]["alpha"]
            assert (shown[n["node"]] in (None, "", "null")) if alpha is None else abs(float(shown[n["node"]]) - alpha) < 1e-6
    assert page.locator("#run-output").inner_text().strip()
    assert f"precision {PRECISION}" in page.locator(".av-meta").inner_text()  # from the run's trace
    shot(page, "04-run-done")
    # the runs page lists it, done, with its α
    page.goto(server[0] + "/#/")
    page.locator(f"#runs-table tr[data-run-id='{run_id}'][data-status=done]").wait_for()
    shot(page, "05-runs-page-after")


def test_a_failing_tool_shows_red_with_its_error(page, server):
    log_in(page, server)
    start_from_form(page, "lookup", {"city": "Bergen", "fail": True})
    wait_status(page, "failed")
    page.locator("#dag .dag-node[data-node=info][data-state=error]").wait_for()
    error = page.locator("#run-error").inner_text()
    assert "info" in error and "the weather service is down for Bergen" in error
    assert page.locator("#tool-table").inner_text().count("the weather service is down") >= 1
    shot(page, "06-run-failed")


def test_cancel_from_the_page(page, server):
    log_in(page, server)
    run_id = start_from_form(page, "approve", {"sql": "DROP TABLE orders"})
    wait_status(page, "waiting", 60_000)
    shot(page, "07-run-waiting")
    page.locator("#cancel-button").click()
    wait_status(page, "cancelled", 60_000)
    assert api(server, f"/v1/runs/{run_id}")["status"] == "cancelled"
    shot(page, "08-run-cancelled")


def test_a_narrow_window_does_not_scroll_sideways(browser, server):
    context = browser.new_context(viewport={"width": 420, "height": 800})
    pg = context.new_page()
    try:
        log_in(pg, server)
        done = api(server, "/v1/runs?status=done&limit=1")["data"]
        pg.goto(server[0] + (f"/#/runs/{done[0]['run_id']}" if done else "/#/"))
        pg.locator("#run-page[data-status=done] #timeline [data-lane=node]" if done else "#runs-table").first.wait_for()
        assert pg.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        shot(pg, "09-narrow")
    finally:
        context.close()


def test_a_saved_trace_renders_the_same_lanes_in_the_console_and_inspect_html(page, server, tmp_path):
    trace, html = tmp_path / "trip.jsonl", tmp_path / "trip.html"
    subprocess.run([sys.executable, "-m", "agentrt.cli", "run", "examples/trip_planner.py", "--trace", str(trace),
                    "--max-tokens", "96"], cwd=ROOT, check=True, capture_output=True, timeout=600)
    subprocess.run([sys.executable, "-m", "agentrt.cli", "inspect", str(trace), "--html", str(html)], cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    summary = json.loads(subprocess.run([sys.executable, "-m", "agentrt.cli", "inspect", str(trace), "--json"],
                                        cwd=ROOT, check=True, capture_output=True, timeout=120).stdout)
    expected = sorted(n["node"] for n in summary["runs"][0]["nodes"])
    log_in(page, server)
    page.goto(server[0] + "/#/trace")
    page.locator("input[type=file]").set_input_files(str(trace))
    page.locator("#timeline [data-lane=node]").first.wait_for()
    console_lanes = node_lanes(page)
    shot(page, "10-trace-in-console")
    page.goto(html.as_uri())
    page.locator("[data-lane=node]").first.wait_for()
    html_lanes = page.eval_on_selector_all("[data-lane=node]", "els => els.map(e => e.dataset.node)")
    shot(page, "11-inspect-html")
    assert sorted(console_lanes) == sorted(html_lanes) == expected
    assert console_lanes == html_lanes  # the same order too: one renderer


def test_a_program_docstring_keeps_its_lines_and_folds_all_but_its_first_paragraph(page, server):
    log_in(page, server)
    form = page.locator("#start-form")
    form.locator("select[name=program]").select_option("refund_desk")
    box = form.locator(".program-description")
    first = box.locator(".docstring > p").first
    assert first.inner_text().startswith("Refund desk: a customer asks for a refund;")
    assert "\n" not in first.inner_text()  # prose reflowed: the docstring's wrapping is not kept
    more = box.locator("details.docstring-more")
    assert more.count() == 1 and more.get_attribute("open") is None
    drawings = box.locator("pre.docstring-pre")
    assert drawings.count() == 2 and not drawings.first.is_visible()  # folded
    shot(page, "12-docstring-folded")
    more.locator("summary").click()
    graph = drawings.nth(1).inner_text()
    assert drawings.nth(1).is_visible()
    lines = graph.splitlines()
    assert lines[0].startswith("order (lookup_order) ── policy") and lines[1].startswith("    ── approval (wait_for)")
    assert lines[2].strip() == "└ no: decline" and lines[2].index("└") > lines[1].index("approved?")
    assert box.locator("code", has_text="wait_for").count() == 1  # `wait_for` in the prose is code
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    shot(page, "13-docstring-open")
    form.locator("select[name=program]").select_option("approve")
    assert box.locator("details").count() == 0 and "waits for a person's approval" in box.inner_text()


def test_a_wait_for_node_is_shown_as_input_and_the_answer_keeps_who_gave_it(page, server):
    log_in(page, server)
    run_id = start_from_form(page, "approve", {"sql": "DELETE FROM orders WHERE id = 7"})
    wait_status(page, "waiting", 60_000)
    node = page.locator("#dag .dag-node[data-node=approval]")
    drawn = node.text_content()  # an SVG group: its text, title included
    assert node.get_attribute("data-kind") == "wait_for" and "waits for input" in drawn and "tool" not in drawn
    assert "asks: Run DELETE FROM orders WHERE id = 7?" in drawn
    page.locator("#timeline [data-lane=node][data-node=approval][data-kind=wait_for]").wait_for()
    form = page.locator(".input-form[data-node=approval]")
    assert "Run DELETE FROM orders WHERE id = 7?" in form.inner_text()
    form.locator("[name=approved]").set_checked(True)
    form.locator("[name=answered-by]").fill("Maria")
    shot(page, "14-input-form")
    form.locator("button[type=submit]").click()
    wait_status(page, "done")
    answer = page.locator(".av-answer[data-node=approval]")
    assert "answered by Maria via http" in answer.inner_text() and answer.inner_text().endswith('{"approved": true}')
    assert page.locator(".av-split-legend li[data-part=input]").count() == 1
    approval = next(n for n in api(server, f"/v1/runs/{run_id}")["summary"]["runs"][0]["nodes"] if n["node"] == "approval")
    assert approval["kind"] == "wait_for" and approval["answered_by"] == "Maria" and approval["via"] == "http"
    shot(page, "15-run-answered")

"""`agentrt bench serve --soak`: a soak of a few seconds against a real `agentrt serve` process
reports every figure, with nothing left over once its work has ended (the soak's bookkeeping;
memory figures are not judged here)."""
from __future__ import annotations

import json

import pytest
from rich.console import Console

from agentrt.bench.common import finish
from agentrt.bench.serve_soak import LINE_KEYS, PROGRAMS, SoakLoad, chat_body, run_request, soak
from agentrt.errors import RunConfigError


def test_the_load_mixes_programs_streaming_and_formats():
    runs = [run_request(i) for i in range(8)]
    assert [p for p, _, _ in runs[:4]] == list(PROGRAMS)
    assert {followed for _, _, followed in runs} == {True, False}
    assert all(followed for p, _, followed in runs if p == "refund_desk")  # its approval is posted when asked
    bodies = [chat_body(i, [[{"role": "user", "content": "hi"}]], 8, "m") for i in range(6)]
    assert [b["stream"] for b in bodies] == [False, True] * 3
    assert ["response_format" in b for b in bodies] == [False, False, True, True, False, False]
    assert ["tools" in b for b in bodies] == [False] * 4 + [True, True]


def test_a_short_soak_reports_every_figure_and_leaves_nothing(tmp_path, capsys):
    load = SoakLoad(seconds=5.0, runs_per_min=24.0, chats_per_run=2, max_inflight=2, warmup_fraction=0.5,
                    max_tokens=32)
    result = soak(load, "smollm2-135m-instruct", "auto", Console(file=open(tmp_path / "console.txt", "w")),
                  workdir=tmp_path, extra_server_args=["--kv-cache-tokens", "4096", "--no-db"])
    s = result.summary
    assert set(LINE_KEYS) <= set(s)
    assert s["runs"] == 2 and s["runs_after_warmup"] == 1 and s["chats"] == 4
    assert s["runs_failed"] == 0 and s["chats_failed"] == 0 and s["timed_out"] == 0, result.notes
    assert (s["leftover_kv"], s["leftover_runs"], s["leftover_threads"]) == (0, 0, 0)
    assert s["server_exit"] == 0
    assert min(s["rss_ready_mb"], s["rss_warm_mb"], s["rss_end_mb"]) > 0  # (a heap trim may take RSS below ready)
    assert s["growth_mb_per_1000_runs"] is not None
    assert result.rows and {"elapsed_s", "runs", "rss_mb", "threads"} <= set(result.rows[-1])
    finish("serve", result, str(tmp_path / "soak.json"))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("serve-soak: rss_ready_mb=")
    assert [kv.split("=")[0] for kv in last.removeprefix("serve-soak: ").split()] == list(LINE_KEYS)
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["bench"] == "serve-soak" and saved["summary"]["leftover_runs"] == 0


def test_a_load_that_cannot_run_is_refused_naming_the_option():
    for kwargs, option in [({"seconds": 0}, "--soak"), ({"seconds": 60, "runs_per_min": 0}, "--soak-rate"),
                           ({"seconds": 60, "warmup_fraction": 1.0}, "--soak-warmup")]:
        with pytest.raises(RunConfigError, match=option):
            SoakLoad(**kwargs)


def test_growth_is_the_fitted_slope_not_the_two_ends():
    from agentrt.bench.serve_soak import growth_per_run

    # a saw (trims) over a flat line: no growth, though the last point is above the first
    saw = [(r, 2000.0 + (4.0 if r % 2 else 0.0)) for r in range(40, 80)] + [(80, 2004.0)]
    assert abs(growth_per_run(saw)) < 0.02
    assert growth_per_run([(r, 100.0 + 0.5 * r) for r in range(10)]) == pytest.approx(0.5)
    assert growth_per_run([(5, 100.0), (5, 101.0)]) is None


def test_the_floor_is_each_windows_lowest_reading():
    from agentrt.bench.serve_soak import floor_points, growth_per_run

    # a saw of 20 MB every 10 s over a flat floor, and the same floor rising 1 MB a minute
    flat = [(2.0 * i, i, 2000.0 + (20.0 if i % 5 else 0.0)) for i in range(300)]
    assert floor_points(flat, 60.0) == [(30 * w, 2000.0) for w in range(9)]  # the last, partial window left out
    assert growth_per_run(floor_points(flat, 60.0)) == 0.0
    rising = [(t, r, m + t / 60.0) for t, r, m in flat]
    assert growth_per_run(floor_points(rising, 60.0)) == pytest.approx(1 / 30, rel=0.05)
    assert floor_points([], 60.0) == []

"""bench serve's program figure: one latency bound for both policies, the whole rate grid."""
from agentrt.bench.serve import sustained_rates


def _rows(policy: str, means: dict[float, float], p95: dict[float, float]) -> list[dict]:
    return [{"policy": policy, "rate_per_s": r, "programs": 6, "mean_s": m, "p95_s": p95[r]} for r, m in means.items()]


def test_one_bound_from_fcfs_holds_both_policies_and_a_later_rate_still_counts():
    # FCFS unloaded 3.88 s: the bound is 7.76 s for both. Per-policy bounds would have given the
    # runtime (unloaded 2.37 s) a 4.74 s bound and no sustained rate at all.
    rows = (_rows("a", {0.0: 3.88, 0.1: 6.96, 0.2: 9.5, 0.4: 20.0}, {0.0: 4.0, 0.1: 8.0, 0.2: 12.0, 0.4: 30.0})
            + _rows("c", {0.0: 2.37, 0.1: 5.82, 0.2: 8.1, 0.4: 7.0}, {0.0: 3.0, 0.1: 3.6, 0.2: 9.0, 0.4: 8.0}))
    marked, summary = sustained_rates(rows, "a", "c")
    assert summary["latency_bound_s"] == 7.76
    assert summary["sustained_rate_a"] == 0.1
    # 0.2 misses (8.1 s) but 0.4 is within: the grid is read past the first miss
    assert summary["sustained_rate_c"] == 0.4
    assert summary["sustained_rate_vs_fcfs"] == 4.0
    assert summary["p95_at_fcfs_rate_vs_unloaded"] == 1.2  # 3.6 / 3.0 at FCFS's 0.1
    assert [r["within_bound"] for r in marked] == [True, True, False, False, True, True, False, True]


def test_no_sustained_fcfs_rate_gives_no_ratio():
    rows = _rows("a", {0.0: 1.0, 0.5: 5.0}, {0.0: 1.0, 0.5: 6.0}) + _rows("c", {0.0: 1.0, 0.5: 1.5}, {0.0: 1.0, 0.5: 2.0})
    _, summary = sustained_rates(rows, "a", "c")
    assert summary["sustained_rate_a"] == 0.0 and summary["sustained_rate_c"] == 0.5
    assert summary["sustained_rate_vs_fcfs"] is None and summary["p95_at_fcfs_rate_vs_unloaded"] is None

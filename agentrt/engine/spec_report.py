"""A short α summary for the terminal (`agentrt generate --spec ...`)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def print_spec_summary(result, console: Console | None = None) -> None:
    if console is None:
        console = Console(stderr=True)
        if not console.is_terminal:  # piped: don't wrap the table to 80 columns
            console = Console(stderr=True, width=140)
    spec = result.spec
    table = Table(title="speculation")
    for col in ("drafter", "target passes", "drafted", "accepted", "forced", "α", "tokens/pass", "accepted-run histogram"):
        table.add_column(col)
    rows = list(spec.by_drafter.items())
    if len(rows) != 1:
        rows.append(("total", spec.total))
    for name, st in rows:
        hist = " ".join(f"{k}:{v}" for k, v in sorted(st.run_lengths.items()))
        table.add_row(name, _fmt(st.target_passes), _fmt(st.drafted), _fmt(st.accepted),
                      _fmt(st.forced), _fmt(st.alpha), _fmt(st.tokens_per_pass), hist)
    console.print(table)

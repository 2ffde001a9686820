"""A short α summary for the terminal."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_spec_summary(result, step_log=None, console: Console | None = None) -> None:
    console = console or Console(stderr=True)
    table = Table(title="speculation")
    for col in ("drafter", "drafted", "accepted", "α", "tokens/pass", "passes"):
        table.add_column(col)
    for name, st in (result.spec or {}).items():
        table.add_row(
            name, str(st.get("drafted", 0)), str(st.get("accepted", 0)),
            f"{st.get('alpha', 0.0):.2f}", f"{st.get('tokens_per_pass', 0.0):.2f}", str(st.get("target_passes", 0)),
        )
    console.print(table)

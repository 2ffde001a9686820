"""Rows of dicts as a rich table: what the benchmarks and `agentrt calibrate` print."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def print_table(title: str, rows: list[dict[str, Any]], console: Console | None = None) -> None:
    console = console or Console()
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    table = Table(title=title)
    for c in cols:
        table.add_column(c)
    for r in rows:
        table.add_row(*[fmt(r.get(c, "")) for c in cols])
    console.print(table)

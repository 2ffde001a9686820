"""`agentrt runs list --db PATH` and `agentrt runs prune --db PATH [--older-than 7d] [--keep N]`:
what a run store holds, and deleting ended runs (never a queued, running or waiting one)."""
from __future__ import annotations

import argparse
import datetime as dt
import re

from agentrt.errors import RunConfigError
from agentrt.runtime.store_location import db_argument

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> float:
    """'90s', '30m', '12h', '7d' -> seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text.strip())
    if not m:
        raise RunConfigError(f"duration {text!r}: give a number and a unit, e.g. 90s, 30m, 12h or 7d")
    return float(m.group(1)) * UNITS[m.group(2)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["list", "prune"])
    p.add_argument("--db", required=True, metavar="PATH", type=db_argument,
                   help="the run store: a SQLite file (a path, or sqlite:///PATH) or postgresql://USER@HOST[:PORT]/DB")
    p.add_argument("--status", default=None, help="list: only runs with this status")
    p.add_argument("--older-than", default=None, metavar="DURATION",
                   help="prune: ended runs that ended longer ago than this (90s, 30m, 12h, 7d)")
    p.add_argument("--keep", type=int, default=None, metavar="N", help="prune: keep only the newest N ended runs")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from agentrt.runtime.store import open_store
    from agentrt.tables import print_table

    console = Console()
    store = open_store(args.db)
    try:
        if args.action == "list":
            runs = store.runs([args.status] if args.status else None)
            when = lambda t: dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S") if t else "-"  # noqa: E731
            if not runs:
                console.print(f"no runs in {args.db}" + (f" with status {args.status}" if args.status else ""))
            print_table(f"runs in {args.db}", [{"run": r.run_id, "program": r.program, "status": r.status,
                                                "created": when(r.created_at), "ended": when(r.ended_at),
                                                "origin": r.origin} for r in runs], console)
            return 0
        if args.older_than is None and args.keep is None:
            raise RunConfigError("runs prune: give --older-than DURATION, --keep N or both")
        if args.keep is not None and args.keep < 0:
            raise RunConfigError(f"--keep must be >= 0, got {args.keep}")
        gone = store.prune(older_than_s=duration_s(args.older_than) if args.older_than else None, keep=args.keep)
        console.print(f"deleted {len(gone)} ended run(s) from {args.db}")
        return 0
    finally:
        store.close()

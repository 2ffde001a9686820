"""`agentrt status --db URL`: the replicas serving a PostgreSQL run store (id, host, pid, last
heartbeat, lease) and its unfinished runs with their owner and lease expiry. A SQLite store has
no replicas (one server process owns all its runs): only its unfinished runs are listed."""
from __future__ import annotations

import argparse
import datetime as dt

from agentrt.runtime.store_location import db_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, metavar="PATH|URL", type=db_argument,
                   help="the run store: postgresql://USER@HOST[:PORT]/DB (or a SQLite file)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from agentrt.runtime.store_api import UNFINISHED
    from agentrt.runtime.store import open_store
    from agentrt.tables import print_table

    store = open_store(args.db)
    try:
        if getattr(store, "supports_leases", False):
            now = store.database_time()  # leases are the database's clock, not this machine's
            replicas = [{"replica": r.replica_id, "host": r.host, "pid": r.pid, "lease_s": r.lease_s,
                         "heartbeat_s_ago": round(now - r.heartbeat_at, 3),
                         "alive": now - r.heartbeat_at < r.lease_s} for r in store.replicas()]
            runs = [{"run": r.run_id, "program": r.program, "status": r.status, "owner": r.owner,
                     "lease_left_s": None if r.lease_until is None else round(r.lease_until - now, 3)}
                    for r in store.leases()]
        else:
            replicas = []
            runs = [{"run": r.run_id, "program": r.program, "status": r.status, "owner": None, "lease_left_s": None}
                    for r in store.runs(UNFINISHED)]
        if args.json:
            print(json.dumps({"store": store.location, "replicas": replicas, "runs": runs}))
            return 0
        console = Console()
        stamp = dt.datetime.now().strftime("%H:%M:%S")
        if replicas:
            print_table(f"replicas on {store.location} at {stamp}", replicas, console)
        else:
            console.print(f"no replicas on {store.location}"
                          + ("" if getattr(store, "supports_leases", False) else " (a SQLite store: one server owns it)"))
        if runs:
            print_table(f"unfinished runs ({len(runs)}): a lapsed lease (lease_left_s < 0) is taken over by a live "
                        "replica", runs, console)
        else:
            console.print("no unfinished runs")
        return 0
    finally:
        store.close()

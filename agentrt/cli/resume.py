"""`agentrt resume RUN_ID --db PATH`: go on with a run recorded by `agentrt run --db PATH` that did
not end (the process was killed, the machine restarted). Nodes that finished are taken from the
store; LLM nodes that were generating are generated again (a sampled one with the seed it
recorded); a tool that was running runs again only if it is idempotent, else its node fails
saying it may or may not have run. A program file that changed since the run started is refused
unless --allow-changed-program."""
from __future__ import annotations

import argparse

from agentrt.cli.run import add_engine_arguments, run_on_engine
from agentrt.errors import RunConfigError
from agentrt.runtime.store_location import db_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_id", help="the run's id (printed by `agentrt run --db`; `agentrt runs list --db PATH`)")
    p.add_argument("--db", required=True, metavar="PATH", type=db_argument, help="the run store the run was recorded in")
    p.add_argument("--allow-changed-program", action="store_true",
                   help="resume even if the program file changed since the run started")
    p.add_argument("--program", default=None, metavar="PATH",
                   help="the program file, when it moved since the run started (default: where it was)")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from agentrt.runtime.loader import load_example
    from agentrt.runtime.store import UNFINISHED, file_hash
    from agentrt.runtime.store import open_store

    store = open_store(args.db)
    try:
        stored = store.get_run(args.run_id)
        if stored is None:
            raise RunConfigError(f"run '{args.run_id}' is not in the run store {args.db}")
        if stored.status not in UNFINISHED:
            raise RunConfigError(f"run '{args.run_id}' already ended (status {stored.status}): nothing to resume")
        path = args.program or stored.metadata.get("path")
        if not path:
            raise RunConfigError(f"run '{args.run_id}' does not record its program file; give it with --program")
        from agentrt.tools.mcp.spec import configure_from_flags

        configure_from_flags(args.mcp)  # before the program file's mcp_tools(...) run
        example = load_example(path)
        if file_hash(example.path) != stored.program_hash and not args.allow_changed_program:
            raise RunConfigError(f"run '{args.run_id}': the program file {path} changed since the run started; "
                                 "resuming could mix two versions of the program (--allow-changed-program resumes anyway)")
        return run_on_engine(args, example, stored.inputs, store, run_id=stored.run_id,
                             resume=store.recorded(stored.run_id))
    finally:
        store.close()

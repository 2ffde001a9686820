"""`agentrt` command line: every subcommand is a module of this package (add_arguments(parser) and
run(args) -> int), imported lazily, so `agentrt --help` and the tool worker start without loading
torch. Nothing below the command line imports it."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Each module has add_arguments(parser) and run(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("agentrt.cli.generate", "generate text from a prompt with the engine"),
    "models": ("agentrt.cli.models", "list known models and their cache state"),
    "calibrate": ("agentrt.cli.calibrate", "measure the engine's step-cost model"),
    "run": ("agentrt.cli.run", "run an agent program (examples/*.py)"),
    "resume": ("agentrt.cli.resume", "go on with a stored run that did not end (agentrt run --db)"),
    "runs": ("agentrt.cli.runs", "list or prune the runs in a run store"),
    "status": ("agentrt.cli.status", "the replicas serving a run store and who owns its unfinished runs"),
    "inspect": ("agentrt.cli.inspect_run", "re-render a saved run trace"),
    "worker": ("agentrt.cli.worker", "serve a module's tools over MQTT"),
    "engine-worker": ("agentrt.cli.engine_worker", "serve an engine's LLM calls over MQTT (agentrt serve --engines)"),
    "serve": ("agentrt.cli.serve", "serve agent programs and OpenAI-compatible chat over HTTP"),
    "submit": ("agentrt.cli.submit", "run a program on a server and follow it"),
    "bench": ("agentrt.cli.bench", "run a benchmark: agentrt bench NAME [--quick] [--json PATH]"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrt", description="A runtime for agent programs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # only import the module whose command is being run
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI reports our own errors without a traceback
        from agentrt.errors import AgentRTError

        if isinstance(e, AgentRTError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        import traceback

        traceback.print_exc()
        print(f"agentrt: internal error ({type(e).__name__}): a bug in agentrt, not in what you gave it; "
              "please report it with the traceback above", file=sys.stderr)
        return 1


"""What the commands that talk to a server share (`agentrt submit`, `agentrt inspect URL`): the
key from the command line or the environment, a client made with it, a 401 that says where a
key goes, and the command that answers a waiting wait_for node."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from agentrt.client.errors import Unauthorized
from agentrt.client.keys import CLIENT_KEY_VAR, env_api_key, key_from_file
from agentrt.client.sync import Client
from agentrt.errors import RunConfigError


def add_api_key_arguments(p: argparse.ArgumentParser) -> None:
    """--api-key / --api-key-file for a command that talks to a server."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the server's API key (default: ${CLIENT_KEY_VAR}; on the command line it shows in `ps`: "
                        "prefer the file or the variable)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line that is not blank or a # comment)")


def api_key_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the key to send, a note to show the user) from --api-key, --api-key-file, the environment."""
    if getattr(args, "api_key", None):
        return args.api_key, None
    if getattr(args, "api_key_file", None):
        return key_from_file(args.api_key_file), None
    return env_api_key()


def client_from_args(args: argparse.Namespace, base_url: str) -> Client:
    """A client of base_url with the key of --api-key, --api-key-file or $AGENTRT_API_KEY (a note
    on stderr when only a server's variable is set)."""
    key, note = api_key_from_args(args)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    return Client(base_url, api_key=key or "")


def with_key_hint(e: Unauthorized) -> RunConfigError:
    return RunConfigError(f"{e} (give the server's key with --api-key, --api-key-file or ${CLIENT_KEY_VAR})")


def answer_command(run_url: str, node: str, schema: dict[str, Any]) -> str:
    """The curl command that answers a waiting wait_for node, with a value of the schema's shape."""
    body = json.dumps({"value": sample_value(schema)})
    return (f"curl -X POST {shlex.quote(f'{run_url}/input/{node}')} -H \"Authorization: Bearer ${CLIENT_KEY_VAR}\" "
            f"-H 'Content-Type: application/json' -d {shlex.quote(body)}")


def sample_value(schema: dict[str, Any]) -> Any:
    """A value of the schema's shape to edit (its required properties, an enum's first member)."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type")
    kind = kind[0] if isinstance(kind, list) and kind else kind
    if kind == "object":
        props = schema.get("properties", {})
        return {k: sample_value(props.get(k, {})) for k in schema.get("required", list(props))}
    return {"array": [], "string": "", "integer": 0, "number": 0, "boolean": True}.get(kind)


def waiting_lines(run_url: str, node: str, prompt: str | None, schema: dict[str, Any]) -> list[str]:
    """What to tell a user about a node waiting for input: the question, where to answer, how."""
    return [f"? {node} waits for input: {prompt or ''}".rstrip(),
            f"  POST {run_url}/input/{node} with {{\"value\": ...}}, the value valid against {json.dumps(schema)}",
            f"  {answer_command(run_url, node, schema)}"]

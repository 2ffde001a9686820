"""Where a client's API key comes from, and the command-line options that give it.

The client side reads one key: --api-key, else --api-key-file, else AGENTRT_API_KEY. The server
reads its list of keys from AGENTRT_SERVE_API_KEYS (agentrt/cli/serve.py); the two names
differ in more than a letter, and a client that finds only the server's variable says so rather
than sending no key in silence."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Mapping

from agentrt.errors import RunConfigError

CLIENT_KEY_VAR = "AGENTRT_API_KEY"
SERVER_KEY_VARS = ("AGENTRT_SERVE_API_KEYS", "AGENTRT_API_KEYS")  # the server's, the second deprecated


def add_api_key_arguments(p: argparse.ArgumentParser) -> None:
    """--api-key / --api-key-file for a command that talks to a server."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"the server's API key (default: ${CLIENT_KEY_VAR}; on the command line it shows in `ps`: "
                        "prefer the file or the variable)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line that is not blank or a # comment)")


def key_from_file(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise RunConfigError(f"--api-key-file {path}: cannot read it ({e.strerror})") from None
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            return line.strip()
    raise RunConfigError(f"--api-key-file {path}: no key in it")


def env_api_key(environ: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(the key in AGENTRT_API_KEY, a note when it is unset but a server's variable is set)."""
    env = os.environ if environ is None else environ
    key = env.get(CLIENT_KEY_VAR, "").strip() or None
    if key is None:
        found = [v for v in SERVER_KEY_VARS if env.get(v, "").strip()]
        if found:
            return None, (f"{found[0]} is set, but that is the server's list of keys; a client reads its key from "
                          f"{CLIENT_KEY_VAR} (or --api-key / --api-key-file): sending no key")
    return key, None


def api_key_from_args(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(the key to send, a note to show the user) from --api-key, --api-key-file, the environment."""
    if getattr(args, "api_key", None):
        return args.api_key, None
    if getattr(args, "api_key_file", None):
        return key_from_file(args.api_key_file), None
    return env_api_key()

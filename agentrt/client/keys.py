"""Where a client's API key comes from (the command-line options that give it: cli/client_args.py).

The client side reads one key: --api-key, else --api-key-file, else AGENTRT_API_KEY. The server
reads its list of keys from AGENTRT_SERVE_API_KEYS (agentrt/cli/serve.py); the two names
differ in more than a letter, and a client that finds only the server's variable says so rather
than sending no key in silence."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from agentrt.errors import RunConfigError

CLIENT_KEY_VAR = "AGENTRT_API_KEY"
SERVER_KEY_VARS = ("AGENTRT_SERVE_API_KEYS", "AGENTRT_API_KEYS")  # the server's, the second deprecated


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

"""Where a run store lives, from a `--db` value: a SQLite file, given as a path or as a sqlite URL.

A value that looks like a URL of another database (postgresql://..., mysql://...) is refused
rather than taken as a path: as a path it would make a SQLite file under a folder named
`postgresql:` and the runs would silently not be where the user meant them to be."""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from urllib.parse import unquote

from agentrt.errors import RunConfigError

SUPPORTED_FORMS = ("a file path (runs/agentrt.db), sqlite:///relative/path.db or sqlite:////absolute/path.db "
                   "(SQLAlchemy's form)")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")


def store_path(value: str, flag: str = "--db") -> Path:
    """The SQLite file `value` names; RunConfigError naming the supported forms for anything else."""
    m = _SCHEME.match(value)
    scheme = m.group(1).lower() if m else None
    rest = value[m.end():] if m else value
    if not value.strip():
        raise RunConfigError(f"{flag}: empty; give {SUPPORTED_FORMS}")
    if scheme is None or (scheme != "sqlite" and not rest.startswith("//")):
        return Path(value)  # a plain path (a file named "a:b.db" included)
    if scheme != "sqlite":
        raise RunConfigError(f"{flag} {value!r}: {scheme}:// databases are not supported: the run store is a "
                             f"SQLite file; give {SUPPORTED_FORMS}")
    if not rest.startswith("///"):  # sqlite:x.db, sqlite://host/x.db
        raise RunConfigError(f"{flag} {value!r}: a sqlite URL has three slashes before its path; give {SUPPORTED_FORMS}")
    path = rest[3:]
    if "?" in path or "#" in path:
        raise RunConfigError(f"{flag} {value!r}: sqlite URL options (?...) are not supported; give {SUPPORTED_FORMS}")
    path = unquote(path)
    if not path or path == ":memory:":
        raise RunConfigError(f"{flag} {value!r}: names no file (an in-memory store keeps nothing); "
                             f"give {SUPPORTED_FORMS}")
    return Path(path)


def db_argument(value: str) -> Path:
    """argparse `type=` for --db: a bad value stops the command at once (exit 2) with the reason."""
    try:
        return store_path(value)
    except RunConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--db").lstrip(": ")) from None  # argparse names --db

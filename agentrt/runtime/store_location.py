"""Where a run store lives, from a `--db` value: a SQLite file (a path, or a sqlite URL), or a
PostgreSQL database (a postgresql:// or postgres:// URL, libpq's form).

A value that looks like a URL of another database (mysql://...) is refused rather than taken as a
path: as a path it would make a SQLite file under a folder named `mysql:` and the runs would
silently not be where the user meant them to be. A PostgreSQL URL is checked when the command
starts (its form here, that the database answers when the store opens); messages show it without
its password (`PostgresLocation`)."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from agentrt.errors import RunConfigError

SUPPORTED_FORMS = ("a file path (runs/agentrt.db), sqlite:///relative/path.db or sqlite:////absolute/path.db "
                   "(SQLAlchemy's form), or postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE")
POSTGRES_SCHEMES = ("postgresql", "postgres")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")


@dataclass(frozen=True)
class PostgresLocation:
    """A PostgreSQL database by its URL; str() and repr() show it without its password (a
    logged config or a traceback must not leak it)."""

    url: str

    def __str__(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"PostgresLocation({redact_url(self.url)!r})"


def redact_url(url: str) -> str:
    """The URL without a password, whether in its user part or as a ?password= option."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}@{host}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "password"])
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


StoreLocation = Path | PostgresLocation


def store_location(value: str, flag: str = "--db") -> StoreLocation:
    """The store `value` names; RunConfigError naming the supported forms for anything else."""
    m = _SCHEME.match(value)
    scheme = m.group(1).lower() if m else None
    rest = value[m.end():] if m else value
    if not value.strip():
        raise RunConfigError(f"{flag}: empty; give {SUPPORTED_FORMS}")
    if scheme is None or (scheme != "sqlite" and not rest.startswith("//")):
        return Path(value)  # a plain path (a file named "a:b.db" included)
    if scheme in POSTGRES_SCHEMES:
        return _postgres(value, flag)
    if scheme != "sqlite":
        raise RunConfigError(f"{flag} {value!r}: {scheme}:// databases are not supported: the run store is a "
                             f"SQLite file or a PostgreSQL database; give {SUPPORTED_FORMS}")
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


def _postgres(value: str, flag: str) -> PostgresLocation:
    location = PostgresLocation(value)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number
        from psycopg.conninfo import conninfo_to_dict

        conninfo_to_dict(value)  # libpq's own parse: an unknown ?option is refused here, not at connect
    except Exception as e:  # noqa: BLE001 - ValueError from urllib, psycopg.ProgrammingError from libpq
        raise RunConfigError(f"{flag} {location}: not a valid PostgreSQL URL ({e}); "
                             "give postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE") from None
    if not parts.path.strip("/"):
        raise RunConfigError(f"{flag} {location}: names no database; give postgresql://USER@HOST[:PORT]/DATABASE")
    return location


def store_path(value: str, flag: str = "--db") -> Path:
    """The SQLite file `value` names (a PostgreSQL URL is refused: `open_store` opens those)."""
    location = store_location(value, flag)
    if isinstance(location, PostgresLocation):
        raise RunConfigError(f"{flag} {location}: a PostgreSQL URL names no SQLite file; open it with "
                             "agentrt.runtime.store.open_store or PostgresRunStore")
    return location


def db_argument(value: str) -> StoreLocation:
    """argparse `type=` for --db: a bad value stops the command at once (exit 2) with the reason."""
    try:
        return store_location(value)
    except RunConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--db").lstrip(": ")) from None  # argparse names --db

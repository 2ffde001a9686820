"""--db values: a path or a sqlite URL opens a SQLite run store, a postgresql:// URL a PostgreSQL
one; a URL of another database is refused at start by every command that takes --db, and nothing
is created; a PostgreSQL database that does not answer stops every command at start (exit 2),
named without its password."""
from __future__ import annotations

from pathlib import Path

import pytest

from agentrt.cli import main
from agentrt.errors import RunConfigError
from agentrt.runtime.store import SQLiteRunStore
from agentrt.runtime.store import open_store
from agentrt.runtime.store_location import PostgresLocation, store_location, store_path
from agentrt.tools.mosquitto import free_port

COMMANDS = [["serve"], ["run", "program.py"], ["resume", "run-1"], ["runs", "list"], ["runs", "prune"]]


@pytest.mark.parametrize("value, path", [
    ("runs/agentrt.db", "runs/agentrt.db"), ("a:b.db", "a:b.db"), ("sqlite:///runs/x.db", "runs/x.db"),
    ("sqlite:////srv/x.db", "/srv/x.db"), ("SQLite:///with%20space.db", "with space.db"),
])
def test_paths_and_sqlite_urls_name_a_file(value, path):
    assert store_path(value) == Path(path)


@pytest.mark.parametrize("value, reason", [
    ("mysql+pymysql://db/runs", "mysql+pymysql:// databases are not supported"),
    ("file:///tmp/x.db", "file:// databases are not supported"),
    ("sqlite:x.db", "three slashes"), ("sqlite://host/x.db", "three slashes"),
    ("sqlite:///x.db?mode=ro", "options"), ("sqlite:///:memory:", "names no file"), ("", "empty"),
])
def test_other_forms_are_refused_naming_the_supported_ones(value, reason):
    with pytest.raises(RunConfigError, match="sqlite:///relative/path.db") as e:
        store_path(value)
    assert reason in str(e.value)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_refuses_a_database_url_at_start(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([*command, "--db", "mysql://user@db/runs"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --db" in err and "mysql:// databases are not supported" in err and "sqlite:///" in err
    assert list(tmp_path.iterdir()) == []  # no `mysql:` folder, no SQLite file


@pytest.mark.parametrize("value, shown", [
    ("postgresql://agentrt@127.0.0.1:5432/runs", "postgresql://agentrt@127.0.0.1:5432/runs"),
    ("postgres://u:pw@db.internal/runs?sslmode=require", "postgres://u@db.internal/runs?sslmode=require"),
    ("postgresql://u@db/runs?password=pw&connect_timeout=3", "postgresql://u@db/runs?connect_timeout=3"),
])
def test_postgresql_urls_name_a_database_shown_without_the_password(value, shown):
    location = store_location(value)
    assert location == PostgresLocation(value) and str(location) == shown
    assert repr(location) == f"PostgresLocation({shown!r})"  # a logged config shows no password either


@pytest.mark.parametrize("value, reason", [
    ("postgresql://u:pw@db:port/runs", "not a valid PostgreSQL URL"),
    ("postgresql://u:pw@db/runs?bogus=1", "not a valid PostgreSQL URL"),
    ("postgresql://u:pw@db", "names no database"),
])
def test_a_bad_postgresql_url_is_refused_without_its_password(value, reason):
    with pytest.raises(RunConfigError, match=reason) as e:
        store_location(value)
    assert "pw" not in str(e.value)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_stops_at_start_on_an_unreachable_postgresql(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "program.py").write_text((Path(__file__).parents[1] / "server" / "calc_program.py").read_text())
    url = f"postgresql://agentrt:s3cret@127.0.0.1:{free_port()}/runs"
    code = main([*command, "--db", url, *(["--no-access-log", "--port", str(free_port())] if command == ["serve"] else []),
                 *(["--keep", "1"] if command == ["runs", "prune"] else [])])
    assert code == 2
    err = capsys.readouterr().err
    assert f"run store {url.replace(':s3cret', '')} cannot be reached" in err and "s3cret" not in err


def test_a_postgresql_url_opens_a_postgresql_store(postgres_cluster, capsys):
    url = postgres_cluster.new_database()
    store = open_store(url)
    try:
        assert type(store).__name__ == "PostgresRunStore" and store.location == url
    finally:
        store.close()
    assert main(["runs", "list", "--db", url]) == 0
    assert f"no runs in {url}" in capsys.readouterr().out


def test_a_path_and_a_sqlite_url_open_the_same_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "list", "--db", "stores/a.db"]) == 0
    assert "no runs in stores/a.db" in capsys.readouterr().out
    assert main(["runs", "list", "--db", "sqlite:///stores/a.db"]) == 0
    assert main(["runs", "list", "--db", f"sqlite:///{tmp_path}/stores/a.db"]) == 0  # sqlite://// + absolute
    assert [p.name for p in (tmp_path / "stores").iterdir() if p.suffix == ".db"] == ["a.db"]


def test_the_python_api_refuses_a_url_string_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunConfigError, match="a PostgreSQL URL names no SQLite file"):
        SQLiteRunStore("postgresql://user@db/runs")
    SQLiteRunStore("sqlite:///s.db").close()
    assert (tmp_path / "s.db").is_file() and not (tmp_path / "postgresql:").exists()

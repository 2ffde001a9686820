"""--db values: a path or a sqlite URL opens a SQLite run store; a URL of another database is
refused at start by every command that takes --db, and nothing is created."""
from __future__ import annotations

from pathlib import Path

import pytest

from agentrt.cli import main
from agentrt.errors import RunConfigError
from agentrt.runtime.store import SQLiteRunStore
from agentrt.runtime.store_location import store_path

COMMANDS = [["serve"], ["run", "program.py"], ["resume", "run-1"], ["runs", "list"], ["runs", "prune"]]


@pytest.mark.parametrize("value, path", [
    ("runs/agentrt.db", "runs/agentrt.db"), ("a:b.db", "a:b.db"), ("sqlite:///runs/x.db", "runs/x.db"),
    ("sqlite:////srv/x.db", "/srv/x.db"), ("SQLite:///with%20space.db", "with space.db"),
])
def test_paths_and_sqlite_urls_name_a_file(value, path):
    assert store_path(value) == Path(path)


@pytest.mark.parametrize("value, reason", [
    ("postgresql://user@db/runs", "postgresql:// databases are not supported"),
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
        main([*command, "--db", "postgresql://user@db/runs"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --db" in err and "postgresql:// databases are not supported" in err and "sqlite:///" in err
    assert list(tmp_path.iterdir()) == []  # no `postgresql:` folder, no SQLite file


def test_a_path_and_a_sqlite_url_open_the_same_store(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "list", "--db", "stores/a.db"]) == 0
    assert "no runs in stores/a.db" in capsys.readouterr().out
    assert main(["runs", "list", "--db", "sqlite:///stores/a.db"]) == 0
    assert main(["runs", "list", "--db", f"sqlite:///{tmp_path}/stores/a.db"]) == 0  # sqlite://// + absolute
    assert [p.name for p in (tmp_path / "stores").iterdir() if p.suffix == ".db"] == ["a.db"]


def test_the_python_api_refuses_a_url_string_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunConfigError, match="postgresql:// databases are not supported"):
        SQLiteRunStore("postgresql://user@db/runs")
    SQLiteRunStore("sqlite:///s.db").close()
    assert (tmp_path / "s.db").is_file() and not (tmp_path / "postgresql:").exists()

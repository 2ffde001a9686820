"""A throwaway PostgreSQL cluster for the run store's tests and `agentrt bench scale`: initdb into a temporary folder, the
server on a free 127.0.0.1 port with its unix socket in that folder, trust authentication for
one user (agentrt), fsync off (the tests and benches kill agentrt, not PostgreSQL's machine).

PostgreSQL refuses to run as root: when the tests run as root, initdb, pg_ctl and postgres run
as the `postgres` user (or `nobody` where there is none), through runuser, and the folder is
theirs; as any other user they run directly."""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from agentrt.tools.mosquitto import free_port

USER = "agentrt"


def bin_dir() -> Path | None:
    """The folder of initdb (Debian keeps it off PATH, under /usr/lib/postgresql/VERSION/bin)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


class PostgresCluster:
    def __init__(self, bin_path: Path) -> None:
        self.bin = bin_path
        self.os_user = None
        if os.geteuid() == 0:
            self.os_user = "postgres" if _has_user("postgres") else "nobody"
        self.dir = Path(tempfile.mkdtemp(prefix="agentrt-pg-"))
        if self.os_user is not None:
            entry = pwd.getpwnam(self.os_user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        self.data = self.dir / "data"
        self.port = free_port()
        self._names = itertools.count()
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--no-instructions", "-N")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self.os_user is not None:
            command = ["runuser", "-u", self.os_user, "--", *command]
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=self.dir)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stdout}{out.stderr}")

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c max_connections=300")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "60",
                  "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """fast: disconnect every client and stop cleanly; immediate: as if killed."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass  # already stopped
        shutil.rmtree(self.dir, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False

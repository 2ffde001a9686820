"""Start and stop a local mosquitto broker (for tests and benchmarks, not for production).

Listens on a free loopback port with a config in a temporary folder; optional password file
and TLS listener. `restart()` keeps the port, so connected clients see the broker go away and
come back.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrt.errors import AgentRTError
from agentrt.tools.mqtt_protocol import MqttConfig


class BrokerStartError(AgentRTError):
    """mosquitto is missing or did not start."""


def mosquitto_path() -> str:
    for candidate in (shutil.which("mosquitto"), "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BrokerStartError("mosquitto is not installed: install it with `apt-get install -y mosquitto` (Debian/Ubuntu)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class BrokerTls:
    """Server certificate files for a TLS listener (PEM)."""

    ca_file: str
    cert_file: str
    key_file: str


class MosquittoBroker:
    """users: username -> password; when given, anonymous clients are refused."""

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1", users: dict[str, str] | None = None,
                 tls: BrokerTls | None = None, extra_config: tuple[str, ...] = ()) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.users = dict(users or {})
        self.tls = tls
        self.extra_config = extra_config
        self._dir = Path(tempfile.mkdtemp(prefix="agentrt-mosquitto-"))
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    def config(self, **overrides: Any) -> MqttConfig:
        """Client settings for this broker (TLS CA filled in when it has a TLS listener)."""
        base: dict[str, Any] = {"host": self.host, "port": self.port}
        if self.tls:
            base.update(tls=True, tls_ca=self.tls.ca_file)
        base.update(overrides)
        return MqttConfig(**base)

    @property
    def log_path(self) -> Path:
        return self._dir / "mosquitto.log"

    def _write_config(self) -> Path:
        lines = [f"listener {self.port} {self.host}", "persistence false", "set_tcp_nodelay true",
                 "log_dest stderr", "log_type error", "log_type warning", "log_type notice"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            lines.append("user root")  # else mosquitto switches to user `mosquitto`, who cannot read our temp dir
        if self.users:
            pw = self._dir / "passwords"
            pw.write_text("".join(f"{u}:{p}\n" for u, p in self.users.items()))
            subprocess.run(["mosquitto_passwd", "-U", str(pw)], check=True, capture_output=True)
            lines += ["allow_anonymous false", f"password_file {pw}"]
        else:
            lines.append("allow_anonymous true")
        if self.tls:
            lines += [f"cafile {self.tls.ca_file}", f"certfile {self.tls.cert_file}", f"keyfile {self.tls.key_file}"]
        lines += list(self.extra_config)
        path = self._dir / "mosquitto.conf"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self, timeout_s: float = 10.0) -> MosquittoBroker:
        if self.running:
            return self
        conf = self._write_config()
        log = open(self.log_path, "ab")
        self._proc = subprocess.Popen([mosquitto_path(), "-c", str(conf)], stdout=log, stderr=log,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerStartError(f"mosquitto exited with code {self._proc.returncode} on port {self.port}: "
                                       f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise BrokerStartError(f"mosquitto did not listen on {self.host}:{self.port} within {timeout_s:g}s")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    async def arestart(self) -> None:
        """restart() off the event loop, so clients in this process notice the broker leaving."""
        await asyncio.to_thread(self.stop)
        await asyncio.to_thread(self.start)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> MosquittoBroker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""A bench peer in a process of its own, so that a crash in its native code ends that process and
not the bench: llama.cpp built for a CPU with AMX dies by SIGILL in its batched matmuls, which
in-process took the whole bench down with it (no table, no JSON).

`PeerProcess("module:Factory", *args)` makes the object in a spawned child (never forked: the
bench's torch and OpenMP threads do not survive a fork) and `call(method, *args)` runs one of its
methods there, arguments and results pickled over a pipe. When the child dies (a signal, an exit)
or the call raises, `call` raises PeerFailed saying so ("died by SIGILL", "raised RuntimeError:
..."); after a death every later call raises the same, at once. The caller waits on the pipe,
idle, while the child measures: the timings are taken in the child.

For tests, AGENTRT_TEST_PEER_SIGNAL=SIGNAL[@STAGE] makes the child send itself SIGNAL (a name,
e.g. SIGILL) at STAGE: "start" (before the factory runs; the default) or the name of a method (on
its first call): a real death by a real signal, where the caller cannot tell it from a crash.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
from typing import Any

TEST_SIGNAL_ENV = "AGENTRT_TEST_PEER_SIGNAL"


class PeerFailed(RuntimeError):
    """A peer that died or raised; `how` says which ("died by SIGILL", "exited with status 3",
    "raised ValueError: ...") and `stage` where ("start" or the method)."""

    def __init__(self, name: str, how: str, stage: str):
        super().__init__(f"{name} {how} in {stage}")
        self.name, self.how, self.stage = name, how, stage


def exit_description(exitcode: int | None) -> str:
    """How a child process ended, from multiprocessing's exit code (-N: killed by signal N)."""
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"died by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"died by signal {-exitcode}"
    return f"exited with status {exitcode}"


class PeerProcess:
    """One object (factory(*args)) in a child process; see the module docstring."""

    def __init__(self, factory: str, *args: Any, name: str = "peer"):
        self.name = name
        self._gone: PeerFailed | None = None  # why the child no longer answers
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, factory, args), name=name, daemon=True)
        self._proc.start()
        child_conn.close()  # the child's end lives in the child only: its death ends the pipe here
        self._receive("start")

    @property
    def gone(self) -> PeerFailed | None:
        """Why the child no longer answers (it died, or its object could not be made), or None."""
        return self._gone

    def call(self, method: str, *args: Any) -> Any:
        if self._gone is not None:
            raise self._gone
        try:
            self._conn.send((method, args))
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._died(method)
        return self._receive(method)

    def _receive(self, stage: str) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            self._died(stage)
        if status == "raised":
            failed = PeerFailed(self.name, f"raised {value}", stage)
            if stage == "start":  # the child has ended: nothing to call
                self._gone = failed
            raise failed
        return value

    def _died(self, stage: str) -> None:
        self._proc.join(timeout=10)
        self._gone = PeerFailed(self.name, exit_description(self._proc.exitcode), stage)
        raise self._gone

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _test_signal(stage: str) -> None:
    spec = os.environ.get(TEST_SIGNAL_ENV)
    if not spec:
        return
    name, _, at = spec.partition("@")
    if (at or "start") == stage:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a test's SIGILL or SIGSEGV leaves no core file
        os.kill(os.getpid(), signal.Signals[name])


def _raised(e: BaseException) -> tuple[str, str]:
    return "raised", f"{type(e).__name__}: {e}"


def _serve(conn, factory: str, args: tuple) -> None:
    """The child: make the object, then answer (method, args) until None or the pipe closes."""
    _test_signal("start")
    try:
        module, _, attr = factory.partition(":")
        obj = getattr(importlib.import_module(module), attr)(*args)
    except Exception as e:  # noqa: BLE001 - whatever it was, the caller is told and reports it
        conn.send(_raised(e))
        return
    conn.send(("ok", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:  # the caller went away
            return
        if request is None:
            return
        method, call_args = request
        _test_signal(method)
        try:
            conn.send(("ok", getattr(obj, method)(*call_args)))
        except Exception as e:  # noqa: BLE001 - as above
            conn.send(_raised(e))

"""A bench peer in a process of its own, so that a crash in its native code ends that process and
not the bench: llama.cpp built for a CPU with AMX dies by SIGILL in its batched matmuls, which
in-process took the whole bench down with it (no table, no JSON).

`PeerProcess("module:Factory", *args)` starts `python -m agentrt.bench.peer_process` (a fresh
interpreter: no fork of the bench's torch and OpenMP threads, and, unlike multiprocessing's
spawn, no re-import of the caller's main script), makes the object there, and `call(method,
*args)` runs one of its methods there, arguments and results pickled over two pipes of their own
(the child's stdout and stderr stay the caller's, for the peer's own messages). When the child
dies (a signal, an exit) or the call raises, `call` raises PeerFailed saying so ("died by
SIGILL", "raised RuntimeError: ..."); after a death every later call raises the same, at once.
The caller waits on the pipe, idle, while the child measures: the timings are taken in the child.
A child whose caller goes away reads the end of its pipe and exits.

For tests, AGENTRT_TEST_PEER_SIGNAL=SIGNAL[@STAGE] makes the child send itself SIGNAL (a name,
e.g. SIGILL) at STAGE: "start" (before the factory runs; the default) or the name of a method (on
its first call): a real death by a real signal, where the caller cannot tell it from a crash.
"""
from __future__ import annotations

import importlib
import os
import pickle
import signal
import struct
import subprocess
import sys
from typing import IO, Any

TEST_SIGNAL_ENV = "AGENTRT_TEST_PEER_SIGNAL"
_LENGTH = struct.Struct("<Q")


def _send(stream: IO[bytes], obj: Any) -> None:
    _write(stream, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _write(stream: IO[bytes], data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _read_exactly(stream: IO[bytes], n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) < n:  # the other end closed: the process ended
        raise EOFError
    return data


def _recv(stream: IO[bytes]) -> Any:
    (n,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    return pickle.loads(_read_exactly(stream, n))


class PeerFailed(RuntimeError):
    """A peer that died or raised; `how` says which ("died by SIGILL", "exited with status 3",
    "raised ValueError: ...") and `stage` where ("start" or the method)."""

    def __init__(self, name: str, how: str, stage: str):
        super().__init__(f"{name} {how} in {stage}")
        self.name, self.how, self.stage = name, how, stage


def exit_description(returncode: int | None) -> str:
    """How a child process ended, from its return code (-N: killed by signal N)."""
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            return f"died by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died by signal {-returncode}"
    return f"exited with status {returncode}"


class PeerProcess:
    """One object (factory(*args)) in a child process; see the module docstring."""

    def __init__(self, factory: str, *args: Any, name: str = "peer"):
        self.name = name
        self._gone: PeerFailed | None = None  # why the child no longer answers
        to_child, from_caller = os.pipe()[::-1]
        from_child, to_caller = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(from_caller), str(to_caller)],
                                          pass_fds=(from_caller, to_caller), stdin=subprocess.DEVNULL)
        finally:
            os.close(from_caller)  # the child's ends live in the child only: its death ends the pipes here
            os.close(to_caller)
        self._out = os.fdopen(to_child, "wb")
        self._in = os.fdopen(from_child, "rb")
        self._request(("start", (factory, args)), "start")

    @property
    def gone(self) -> PeerFailed | None:
        """Why the child no longer answers (it died, or its object could not be made), or None."""
        return self._gone

    def call(self, method: str, *args: Any) -> Any:
        if self._gone is not None:
            raise self._gone
        return self._request((method, args), method)

    def _request(self, request: tuple[str, tuple], stage: str) -> Any:
        try:
            _send(self._out, request)
            status, value = _recv(self._in)
        except (EOFError, OSError):  # OSError: BrokenPipeError on a send to a dead child
            self._proc.wait()
            self._gone = PeerFailed(self.name, exit_description(self._proc.returncode), stage)
            raise self._gone from None
        if status == "raised":
            failed = PeerFailed(self.name, f"raised {value}", stage)
            if stage == "start":  # the child has ended: nothing to call
                self._gone = failed
            raise failed
        return value

    def close(self) -> None:
        for stream in (self._out, self._in):  # the end of its pipe ends the child's loop
            try:
                stream.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

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


def _serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child: make the object, then answer (method, args) until the caller's pipe ends."""
    _, (factory, args) = _recv(requests)
    _test_signal("start")
    try:
        module, _, attr = factory.partition(":")
        obj = getattr(importlib.import_module(module), attr)(*args)
    except Exception as e:  # noqa: BLE001 - whatever it was, the caller is told and reports it
        _send(answers, _raised(e))
        return
    _send(answers, ("ok", None))
    while True:
        try:
            method, call_args = _recv(requests)
        except EOFError:  # the caller closed the peer, or went away
            return
        _test_signal(method)
        try:
            answer = ("ok", getattr(obj, method)(*call_args))
            data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)  # a result that cannot be sent is raised
        except Exception as e:  # noqa: BLE001 - as above
            data = pickle.dumps(_raised(e), protocol=pickle.HIGHEST_PROTOCOL)
        _write(answers, data)


if __name__ == "__main__":
    _serve(os.fdopen(int(sys.argv[1]), "rb"), os.fdopen(int(sys.argv[2]), "wb"))

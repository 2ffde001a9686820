"""The embedded executor: async and sync tools, timeouts, retries, cancellation, failures."""
from __future__ import annotations

import asyncio
import sys
import threading

from agentrt.tools import ToolRegistry, tool


async def test_async_and_sync_tools():
    loop_thread = threading.get_ident()

    @tool
    async def where_async() -> int:
        """Thread id of an async tool."""
        return threading.get_ident()

    @tool
    def where_sync() -> int:
        """Thread id of a sync tool."""
        return threading.get_ident()

    registry = ToolRegistry([where_async, where_sync])
    assert (await registry.call("where_async")).value == loop_thread
    assert (await registry.call("where_sync")).value != loop_thread  # off the event loop


async def test_blocking_sync_tool_does_not_stall_the_loop():
    started, release = threading.Event(), threading.Event()

    @tool
    def blocker() -> str:
        """Blocks its thread until released."""
        started.set()
        assert release.wait(10), "never released"
        return "done"

    registry = ToolRegistry([blocker])
    call = asyncio.create_task(registry.call("blocker"))
    assert await asyncio.to_thread(started.wait, 10)
    release.set()  # runs only because the loop is free while the tool blocks its thread
    result = await call
    assert result.ok, result.error
    assert result.value == "done"


async def test_timeout_is_an_error_result():
    @tool(timeout_s=0.05)
    async def forever() -> None:
        """Never returns."""
        await asyncio.Event().wait()

    result = await ToolRegistry([forever]).call("forever")
    assert result.error.kind == "timeout"
    assert "tool 'forever' timed out after 0.05s" in result.error.message
    assert len(result.attempts) == 1  # retries=0


async def test_retries_with_backoff_then_success():
    failures = []

    @tool(retries=3, backoff_s=0.001, retry_on=ConnectionError)
    def flaky(n: int) -> int:
        """Fails twice, then works."""
        if len(failures) < 2:
            failures.append(n)
            raise ConnectionError("try again")
        return n

    result = await ToolRegistry([flaky]).call("flaky", {"n": 7})
    assert result.ok and result.value == 7
    assert [a.ok for a in result.attempts] == [False, False, True]
    assert [a.error_kind for a in result.attempts] == ["tool_raised", "tool_raised", None]
    assert all(a.finished <= b.started for a, b in zip(result.attempts, result.attempts[1:]))


async def test_retries_exhausted_and_timeouts_retried():
    runs = []

    @tool(retries=2, backoff_s=0.001, timeout_s=0.02, idempotent=True)
    async def stuck() -> None:
        """Always too slow."""
        runs.append(1)
        await asyncio.sleep(10)

    result = await ToolRegistry([stuck]).call("stuck")
    assert result.error.kind == "timeout" and len(result.attempts) == 3 and len(runs) == 3


async def test_failing_tool_fails_its_call_only():
    @tool
    def broken(x: int) -> int:
        """Divides by zero."""
        return x // 0

    @tool
    def quitter() -> None:
        """Tries to end the process."""
        sys.exit(3)

    @tool
    def unjsonable() -> object:
        """Returns something JSON cannot hold."""
        return object()

    registry = ToolRegistry([broken, quitter, unjsonable])
    result = await registry.call("broken", {"x": 1})
    assert result.error.kind == "tool_raised"
    assert "tool 'broken' raised ZeroDivisionError: integer division or modulo by zero" in result.error.message
    assert "test_tools_inprocess.py" in result.error.message  # where it raised
    assert (await registry.call("quitter")).error.kind == "tool_raised"
    bad = await registry.call("unjsonable")
    assert bad.error.kind == "invalid_output" and "cannot be turned into JSON" in bad.error.message


async def test_cancelling_the_call_cancels_an_async_tool():
    started, cancelled = asyncio.Event(), asyncio.Event()

    @tool
    async def long_job() -> None:
        """Waits until cancelled."""
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    call = asyncio.create_task(ToolRegistry([long_job]).call("long_job"))
    await started.wait()
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert call.cancelled() and cancelled.is_set()


async def test_per_call_overrides():
    attempts = []

    @tool(retries=5, backoff_s=0.001, idempotent=True)
    def always_fails() -> None:
        """Raises."""
        attempts.append(1)
        raise RuntimeError("no")

    result = await ToolRegistry([always_fails]).call("always_fails", retries=0)
    assert len(result.attempts) == 1 and len(attempts) == 1


async def test_sync_tool_past_its_timeout_is_abandoned_and_frees_its_slot():
    """max_threads=2: a sync tool blocking past its timeout fails its call and the next call runs
    at once on a new thread; with 2 abandoned threads still running, sync calls fail (retryable)
    instead of making more threads, until those end."""
    from agentrt.tools.inprocess import InProcessExecutor

    release = threading.Event()

    @tool(timeout_s=0.2)
    def stuck() -> str:
        """Blocks until released."""
        release.wait(30)
        return "late"

    @tool
    def quick() -> str:
        """Returns at once."""
        return "ok"

    executor = InProcessExecutor(max_threads=2)
    registry = ToolRegistry([stuck, quick], executors={"inprocess": executor})
    try:
        assert (await registry.call("stuck")).error.kind == "timeout"
        assert executor.abandoned == executor.abandoned_running == 1
        assert (await asyncio.wait_for(registry.call("quick"), 5)).value == "ok"
        assert (await registry.call("stuck")).error.kind == "timeout"
        refused = await registry.call("quick")
        assert not refused.ok and "2 sync calls outlived their timeouts" in refused.error.message
        release.set()
        for _ in range(100):
            if executor.abandoned_running == 0:
                break
            await asyncio.sleep(0.02)
        assert executor.abandoned_running == 0 and executor.abandoned == 2
        assert (await registry.call("quick")).value == "ok"
    finally:
        release.set()


async def test_a_sync_tool_ending_its_thread_with_a_base_exception_fails_its_call():
    @tool
    def interrupted() -> None:
        """Raises KeyboardInterrupt on its thread."""
        raise KeyboardInterrupt

    result = await asyncio.wait_for(ToolRegistry([interrupted]).call("interrupted"), 5)
    assert not result.ok and "KeyboardInterrupt" in result.error.message


def test_an_abandoned_sync_tool_does_not_keep_the_process_alive(tmp_path):
    """A sync tool sleeping 60 s with a 0.3 s timeout: the process ends right after the call
    fails (a thread pool's worker would be joined at exit, for the whole minute)."""
    import subprocess
    import time

    script = tmp_path / "abandon.py"
    script.write_text(
        "import asyncio, time\n"
        "from agentrt.tools import ToolRegistry, tool\n"
        "@tool(timeout_s=0.3)\n"
        "def sleepy() -> None:\n"
        "    'Sleeps a minute.'\n"
        "    time.sleep(60)\n"
        "r = asyncio.run(ToolRegistry([sleepy]).call('sleepy'))\n"
        "print(r.error.kind, flush=True)\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timeout"
    assert time.monotonic() - t0 < 30

"""MQTT tools end to end: a real mosquitto, real worker processes, the runtime-side registry."""
from __future__ import annotations

import asyncio
import collections
import os
import signal
from pathlib import Path

import pytest
from tool_test_helpers import WORKER_TOOLS, wait_for_file, wait_until

from agentrt.tools import NoWorkerError, ToolArgumentsError, ToolRegistry
from agentrt.tools.loader import load_tools
from agentrt.tools.mqtt_client import MqttDispatcher


def remote_registry(dispatcher: MqttDispatcher, **kwargs) -> ToolRegistry:
    """The runtime's view: the workers' tools, discovered from their availability messages."""
    registry = ToolRegistry(**kwargs)
    registry.add_executor("mqtt", dispatcher)
    for t in dispatcher.remote_tools():
        registry.register(t)
    return registry


async def test_round_trip_and_discovery(start_workers, dispatcher):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    local = {t.name: t for t in load_tools(WORKER_TOOLS)}
    assert sorted(registry.names()) == sorted(local)
    for name, t in local.items():  # the declarations crossed the wire intact
        assert registry.get(name).openai_schema() == t.openai_schema()
        assert registry.get(name).idempotent == t.idempotent
    result = await registry.call("echo", {"x": 7, "text": "héllo"})
    assert result.ok, result.error
    assert result.value == {"x": 7, "text": "héllo"}
    (attempt,) = result.attempts
    assert attempt.executor == "mqtt" and attempt.worker == "w1"
    assert attempt.remote_started is not None and attempt.remote_finished >= attempt.remote_started


async def test_retry_on_of_a_worker_tool_is_matched_by_name_on_the_callers_side(start_workers, dispatcher, tmp_path):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    assert registry.get("charge").retry_on == ("builtins.ConnectionRefusedError",)
    marker = tmp_path / "calls"
    result = await registry.call("charge", {"marker": str(marker)})
    assert [a.error_kind for a in result.attempts] == ["tool_raised", "tool_raised"] and marker.read_text() == "2"
    assert "gateway down" in result.attempts[0].error and result.attempts[0].backoff_s == 0.01
    assert "card declined" in result.error.message
    assert result.attempts[1].not_retried == \
        "retry_on (builtins.ConnectionRefusedError) does not cover ToolRaisedError (raised ValueError)"


async def test_bind_local_declaration_to_mqtt(start_workers, dispatcher):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = ToolRegistry()
    registry.add_executor("mqtt", dispatcher)
    (echo,) = [t for t in load_tools(WORKER_TOOLS) if t.name == "echo"]
    registry.register(echo, executor="mqtt")
    result = await registry.call("echo", '{"x": 1}')  # the model's JSON text
    assert result.ok and result.value == {"x": 1, "text": ""} and result.attempts[0].worker == "w1"


async def test_invalid_arguments_are_not_executed(start_workers, dispatcher, tmp_path):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    marker = tmp_path / "ran"
    result = await registry.call("record", {"text": 5, "marker": str(marker)})
    assert not result.ok and result.error.kind == "invalid_arguments"
    assert "'text'" in result.error.message and "record" in result.error.message
    assert result.attempts == ()  # never dispatched
    # Sent straight to the worker (no runtime-side check): the worker validates too.
    with pytest.raises(ToolArgumentsError, match="text"):
        await dispatcher.execute(registry.get("record"), {"text": 5, "marker": str(marker)}, timeout=10)
    assert not marker.exists()
    ok = await registry.call("record", {"text": "yes", "marker": str(marker)})
    assert ok.ok and marker.read_text() == "yes"


async def test_unknown_tool(start_workers, broker):
    start_workers(1)
    async with MqttDispatcher(broker.config(), worker_wait_s=0.5) as d:
        await d.wait_for_workers(1)
        registry = remote_registry(d)
        result = await registry.call("no_such_tool", {})
        assert result.error.kind == "unknown_tool" and "echo" in result.error.message
        (echo,) = [t for t in d.remote_tools() if t.name == "echo"]
        ghost = echo.bind("mqtt", name="ghost")  # declared here, served by no worker
        registry.register(ghost)
        result = await registry.call("ghost", {"x": 1})
        assert not result.ok and isinstance(result.error, NoWorkerError)
        assert "ghost" in result.error.message and "w1" in result.error.message


async def test_oversized_payloads(start_workers, dispatcher):
    start_workers(1, "--max-payload-bytes", "2000")
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher, max_args_bytes=1000)
    too_big = await registry.call("echo", {"x": 1, "text": "y" * 5000})
    assert too_big.error.kind == "payload_too_large" and "arguments" in too_big.error.message
    assert too_big.attempts == ()
    result = await registry.call("big", {"n": 10_000})  # over the worker's result limit
    assert result.error.kind == "payload_too_large" and "2000" in result.error.message
    assert result.attempts[0].worker == "w1"
    assert (await registry.call("big", {"n": 100})).value == "x" * 100


async def test_tool_exception_fails_only_its_call(start_workers, dispatcher):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    result = await registry.call("boom", {"message": "bad input 42"})
    assert result.error.kind == "tool_raised"
    assert "boom" in result.error.message and "ValueError" in result.error.message and "bad input 42" in result.error.message
    assert (await registry.call("echo", {"x": 2})).ok  # the worker is still serving


async def test_load_spreads_over_three_workers(start_workers, dispatcher):
    start_workers(3, "--concurrency", "1")
    await dispatcher.wait_for_workers(3, tool="nap")
    registry = remote_registry(dispatcher)
    results = await asyncio.gather(*(registry.call("nap", {"seconds": 0.05}) for _ in range(30)))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    served = collections.Counter(r.attempts[-1].worker for r in results)
    # mosquitto hands shared-subscription messages round robin (10 each); >= 5 each leaves
    # room for any fair distribution while still failing if one worker takes the load.
    assert set(served) == {"w1", "w2", "w3"} and min(served.values()) >= 5, served
    assert len({r.value for r in results}) == 3  # three distinct processes did the work


async def _kill_mid_call(start_workers, dispatcher, tmp_path, tool: str):
    """Start a call, SIGKILL the worker running it; returns (call task, victim, survivor, files)."""
    workers = {w.pid: w for w in start_workers(2)}
    await dispatcher.wait_for_workers(2)
    registry = remote_registry(dispatcher)
    marker, release = tmp_path / "started", tmp_path / "release"
    call = asyncio.create_task(registry.call(tool, {"marker": str(marker), "release": str(release)}))
    victim = workers.pop(int(await wait_for_file(marker)))
    marker.unlink()
    # Killed once its acknowledgement is in: the dispatcher then knows whom it lost. (A worker
    # dying before acknowledging is test_frozen_worker_* below: the accept timeout.)
    await wait_until(lambda: [w for _, w in dispatcher.in_flight().values()] == [victim.worker_id], what="ack")
    victim.kill()  # SIGKILL: no goodbye, only the last will the broker publishes for it
    (survivor,) = workers.values()
    return call, victim, survivor, marker, release


async def test_worker_killed_mid_call_idempotent_is_redispatched(start_workers, dispatcher, tmp_path):
    call, victim, survivor, marker, release = await _kill_mid_call(start_workers, dispatcher, tmp_path, "slow_idempotent")
    assert int(await wait_for_file(marker)) == survivor.pid  # re-dispatched to the other worker
    release.touch()
    result = await asyncio.wait_for(call, 30)
    assert result.ok, result.error
    assert result.value == survivor.pid
    first, second = result.attempts
    assert first.error_kind == "worker_lost" and first.worker == victim.worker_id
    assert "slow_idempotent" in first.error and "re-dispatched" in first.error
    assert second.ok and second.worker == survivor.worker_id


async def test_worker_killed_mid_call_not_idempotent_fails(start_workers, dispatcher, tmp_path):
    call, victim, survivor, marker, release = await _kill_mid_call(start_workers, dispatcher, tmp_path, "slow_once")
    result = await asyncio.wait_for(call, 30)
    assert not result.ok and result.error.kind == "worker_lost"
    assert len(result.attempts) == 1
    msg = result.error.message
    assert "slow_once" in msg and victim.worker_id in msg and "not declared idempotent" in msg
    assert not marker.exists()  # never sent again


async def test_frozen_worker_hits_the_accept_timeout(broker, start_workers, tmp_path):
    """A worker that stops answering (SIGSTOP: still connected, no last will) never acknowledges
    its calls: after accept_timeout_s they are re-dispatched (idempotent) or fail."""
    frozen, _live = start_workers(2)
    async with MqttDispatcher(broker.config(), accept_timeout_s=1.0) as d:
        await d.wait_for_workers(2)
        registry = remote_registry(d)
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            # mosquitto hands a group's messages out round robin: of two calls, one lands on the frozen worker.
            echoes = await asyncio.gather(*(registry.call("echo", {"x": i}) for i in range(2)))
            assert all(r.ok for r in echoes), [r.error for r in echoes]
            redispatched = [r for r in echoes if len(r.attempts) > 1]
            assert len(redispatched) == 1
            first = redispatched[0].attempts[0]
            assert first.error_kind == "worker_lost" and "no worker acknowledged" in first.error
            markers = [tmp_path / f"r{i}" for i in range(2)]
            records = await asyncio.gather(*(registry.call("record", {"text": "t", "marker": str(m)}) for m in markers))
            failed = [r for r in records if not r.ok]
            assert len(failed) == 1 and failed[0].error.kind == "worker_lost"
            assert "record" in failed[0].error.message and "not declared idempotent" in failed[0].error.message
            assert sum(m.exists() for m in markers) == 1  # the frozen worker has run nothing
        finally:
            os.kill(frozen.pid, signal.SIGCONT)


async def test_broker_restart_mid_run(broker, start_workers, dispatcher, tmp_path):
    start_workers(1, "--concurrency", "4")
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    files = {name: (tmp_path / f"{name}.started", tmp_path / f"{name}.release") for name in ("slow_idempotent", "slow_once")}
    calls = {
        name: asyncio.create_task(registry.call(name, {"marker": str(m), "release": str(r)}))
        for name, (m, r) in files.items()
    }
    for m, _ in files.values():
        await wait_for_file(m)
        m.unlink()
    await broker.arestart()  # same port; retained messages and sessions are gone
    # The idempotent call is sent again once both sides are back; the other one fails. Which
    # loss is seen first depends on the broker: it may publish the worker's last will as it
    # shuts down (worker_lost) before closing our own connection (broker_lost).
    lost = {"broker_lost", "worker_lost"}
    once = await asyncio.wait_for(calls["slow_once"], 30)
    assert not once.ok and once.error.kind in lost
    assert "slow_once" in once.error.message and "not declared idempotent" in once.error.message
    marker, release = files["slow_idempotent"]
    await wait_for_file(marker)
    release.touch()
    again = await asyncio.wait_for(calls["slow_idempotent"], 30)
    assert again.ok, again.error
    # Sent again after each loss (a re-dispatch may land just before the broker closes our
    # connection and be lost too); the last attempt succeeds.
    *lost_attempts, last = again.attempts
    assert lost_attempts and all(a.error_kind in lost for a in lost_attempts), again.attempts
    assert last.ok
    assert dispatcher.reconnects >= 1
    after = await registry.call("echo", {"x": 3})  # business as usual after the restart
    assert after.ok and after.value["x"] == 3
    files["slow_once"][1].touch()  # let the orphaned first run finish so the worker stops promptly


async def test_timeout_cancels_the_remote_call(start_workers, dispatcher, tmp_path):
    start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    marker = tmp_path / "c"
    result = await registry.call("cancellable", {"seconds": 60, "marker": str(marker)}, timeout_s=0.5)
    assert result.error.kind == "timeout" and "cancellable" in result.error.message
    await wait_for_file(Path(str(marker) + ".cancelled"))  # the worker cancelled the coroutine


async def test_clean_worker_shutdown_drains_and_leaves(start_workers, dispatcher, tmp_path):
    (worker,) = start_workers(1)
    await dispatcher.wait_for_workers(1)
    registry = remote_registry(dispatcher)
    marker, release = tmp_path / "m", tmp_path / "r"
    call = asyncio.create_task(registry.call("slow_once", {"marker": str(marker), "release": str(release)}))
    await wait_for_file(marker)
    worker.proc.send_signal(signal.SIGTERM)
    await wait_until(lambda: "stopping: finishing 1 running call" in worker.log(), what="worker stopping")
    release.touch()  # the running call must still finish
    result = await asyncio.wait_for(call, 30)
    assert result.ok, result.error
    assert await asyncio.to_thread(worker.proc.wait, 10) == 0
    await wait_until(lambda: not dispatcher.workers(), what="availability cleared")


async def test_username_password_and_tls(tls_files, tmp_path):
    from tool_test_helpers import WorkerProcess

    from agentrt.tools import BrokerConnectionError
    from agentrt.tools.mosquitto import MosquittoBroker

    with MosquittoBroker(users={"agent": "s3cret"}, tls=tls_files) as secure:
        worker = WorkerProcess(secure.url, "tls1", tmp_path, "--username", "agent", "--tls-ca", tls_files.ca_file,
                               env={"AGENTRT_MQTT_PASSWORD": "s3cret"})
        try:
            async with MqttDispatcher(secure.config(username="agent", password="s3cret")) as d:
                await d.wait_for_workers(1, timeout=20)
                result = await remote_registry(d).call("echo", {"x": 9})
                assert result.ok and result.value["x"] == 9 and result.attempts[0].worker == "tls1"
            with pytest.raises(BrokerConnectionError, match=rf"{secure.port}: .*(?i:not authori|bad user)"):
                await MqttDispatcher(secure.config(username="agent", password="wrong"), connect_timeout_s=30).start()
        finally:
            worker.stop()
        intruder = WorkerProcess(secure.url, "bad", tmp_path, "--username", "agent", "--password", "wrong",
                                 "--tls-ca", tls_files.ca_file)
        assert await asyncio.to_thread(intruder.proc.wait, 30) == 2  # refused for good: exits, no retry loop
        assert "refused worker bad" in intruder.log()

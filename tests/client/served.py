"""The real `agentrt serve` application (create_app) on a real port, served from an event loop
on a thread of its own so blocking clients can call it from the test, over a ScriptedBackend
runtime (no model): the calc program (tests/server/calc_program.py) and the approval program,
whose wait_for node waits for a person."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from aiohttp import web

from agentrt.runtime.loader import load_example
from agentrt.runtime.runtime import Runtime
from agentrt.runtime.scripted import ScriptedBackend
from agentrt.server.app import create_app
from agentrt.server.config import ServerConfig
from agentrt.tools.mosquitto import free_port

PROGRAMS = Path(__file__).parents[1] / "server"
REPLIES = {"plan": {"a": 2, "b": 3}, "answer": "The sum is five."}


class ServedApp:
    def __init__(self, tmp: Path, api_keys: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="served-app", daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.call(self._start(tmp, api_keys))

    def call(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self, tmp: Path, api_keys: tuple[str, ...]) -> None:
        examples = [load_example(PROGRAMS / "calc_program.py"), load_example(PROGRAMS / "approval_program.py")]
        self.runtime = Runtime(ScriptedBackend(REPLIES, step_s=0.002), tools=[t for ex in examples for t in ex.tools])
        config = ServerConfig(runs_dir=tmp / "runs", access_log=False, db=None, api_keys=api_keys)
        app = create_app(config, "scripted", {ex.name: ex for ex in examples}, self.runtime)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.runtime.aclose()

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

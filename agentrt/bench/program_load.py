"""Programs submitted over HTTP at given arrival times to a fresh in-process server (the engine
behind it in process, or a backend given): their completion times. The load of the serve bench's
program part, its durability part and the scale bench."""
from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from agentrt.tools.mosquitto import free_port


async def program_load(policy: Any, loaded: Any, cost_model: Any, examples: dict, arrivals: list[float] | None,
                       load: list[tuple[str, dict]], latency: Any, max_tokens: int | None,
                       store: Any = None, backend: Any = None) -> list[float]:
    """Completion times (submit to end, over HTTP) of programs submitted at these arrival times to a
    fresh in-process server whose runtime follows `policy` (and records runs in `store`), on a fresh
    in-process engine, or on `backend` where given (the caller's to close). Arrivals None: each
    program alone, submitted when the one before it ended. Program i draws its tool latencies as
    program i either way, so a program's time alone and under load differ by the load only."""
    import aiohttp
    from aiohttp import web

    from agentrt.bench.workload import new_engine
    from agentrt.bench.workload_load import _PROGRAM, delayed_tools
    from agentrt.engine import AsyncEngine
    from agentrt.runtime import EngineBackend, Runtime
    from agentrt.server.app import create_app
    from agentrt.server.config import Limits, ServerConfig

    engine = None
    if backend is None:
        engine = AsyncEngine(new_engine(loaded, policy, 32768, cost_model))
        backend = EngineBackend(engine, model_name=loaded.name)
    tools, _ = delayed_tools([t for ex in examples.values() for t in ex.tools], latency)
    runtime = Runtime(backend, tools=tools, policy=policy.scheduling, kv_hold=policy.kv_hold, max_tokens=max_tokens,
                      stream_outputs=policy.stream_outputs, store=store)
    config = ServerConfig(access_log=False, runs_dir=Path(os.environ.get("TMPDIR", "/tmp")) / "agentrt-bench-serve-runs",
                          limits=Limits(max_running_runs=256, max_queued_runs=1024))

    @web.middleware
    async def program_index(request: web.Request, handler: Any) -> Any:
        # the run's tasks copy this context: its tool calls draw the latencies of this program
        _PROGRAM.set(int(request.headers.get("X-Bench-Program", "-1")))
        return await handler(request)

    app = create_app(config, loaded.name, examples, runtime)
    app.middlewares.append(program_index)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()

            async def one(i: int, name: str, inputs: dict) -> float:
                if arrivals is not None:
                    await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
                start = time.monotonic()
                async with http.post(f"{url}/v1/programs/{name}/runs", json={"inputs": inputs},
                                     headers={"X-Bench-Program": str(i)}) as r:
                    run_id = (await r.json())["run_id"]
                async with http.get(f"{url}/v1/runs/{run_id}/wait", params={"timeout": "3600"}) as r:
                    status = (await r.json())["status"]
                if status != "done":
                    raise RuntimeError(f"program {i} ({name}) ended {status}")
                return time.monotonic() - start

            if arrivals is None:
                return [await one(i, n, inp) for i, (n, inp) in enumerate(load)]
            return list(await asyncio.gather(*(one(i, n, inp) for i, (n, inp) in enumerate(load))))
    finally:
        await runner.cleanup()
        await runtime.aclose()
        await runtime.tools.aclose()
        if engine is not None:
            backend.close()
            engine.close()

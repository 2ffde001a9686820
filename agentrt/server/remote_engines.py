"""`agentrt serve --engines mqtt://HOST:PORT`: the server's runtime on remote engine workers.

No model is loaded in the server: its LLM calls go to the `agentrt engine-worker`s of the broker
(RemoteEngineBackend). The server waits for the first worker before it says it is ready (and
keeps waiting, so workers may start after it); more may join or leave at any time.
"""
from __future__ import annotations

import argparse

from agentrt.runtime.remote_backend import NoEngineWorkerError, RemoteEngineBackend
from agentrt.tools.mqtt_protocol import MqttConfig


async def start_remote_engines(args: argparse.Namespace, model: str) -> RemoteEngineBackend:
    """A RemoteEngineBackend on --engines, once an engine worker is online."""
    backend = await RemoteEngineBackend(MqttConfig.from_url(args.engines), model_name=model,
                                        routing=getattr(args, "engine_routing", "affinity")).start()
    try:
        print(f"agentrt serve: waiting for an engine worker at {backend.config.url} "
              f"(agentrt engine-worker --broker {backend.config.url})", flush=True)
        while True:
            try:
                workers = await backend.wait_for_workers(1, timeout=30.0)
                break
            except NoEngineWorkerError as e:  # workers may start after the server: keep waiting, say so
                print(f"agentrt serve: {e}; still waiting", flush=True)
        print(f"agentrt serve: engine workers online: {', '.join(workers)} ({backend.precision})", flush=True)
        return backend
    except BaseException:
        await backend.aclose()
        raise

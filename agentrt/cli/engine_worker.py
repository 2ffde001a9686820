"""`agentrt engine-worker --broker mqtt://HOST:PORT [--model ...]`: serve an engine's LLM calls over MQTT.

Loads one engine (as `agentrt serve` does) and serves it to `agentrt serve --engines mqtt://...`
(RemoteEngineBackend) through the broker until SIGTERM or SIGINT. Run one per machine (or per
accelerator); the broker and the servers spread calls over all workers of a group. The password
may come from $AGENTRT_MQTT_PASSWORD.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from agentrt.cli.engine_args import add_model_arguments, add_tool_format_argument, engine_config
from agentrt.cli.memory_args import add_memory_arguments, engine_memory, kv_cache_line
from agentrt.cli.worker import add_broker_arguments, broker_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_broker_arguments(p)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name, a .gguf file or a local HF directory")
    p.add_argument("--served-model-name", default=None, help="the model id callers see (default: --model)")
    add_model_arguments(p)
    add_tool_format_argument(p)
    p.add_argument("--spec", default="template", help="drafter: none | suffix | template | layerskip:N | draft:PATH")
    add_memory_arguments(p)
    p.add_argument("--status-interval", type=float, default=1.0, metavar="S",
                   help="seconds between status (load) messages; callers count a worker silent for 3x this as lost")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve this worker's Prometheus metrics (engine steps, requests, KV blocks; labelled "
                        "replica and engine = the worker's id) at http://HOST:PORT/metrics")
    p.add_argument("--metrics-host", default="127.0.0.1", help="the address --metrics-port listens on")
    p.add_argument("--no-warm-up", action="store_true", help="take calls before the engine's warm-up pass")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = broker_config(args)  # a bad URL fails before the model loads
    if args.status_interval <= 0:
        from agentrt.errors import RunConfigError

        raise RunConfigError(f"--status-interval {args.status_interval}: give a positive number of seconds")
    return asyncio.run(_serve(args, config))


async def _serve(args: argparse.Namespace, config) -> int:
    from agentrt.engine import AsyncEngine, LLMEngine
    from agentrt.runtime.engine_backend import EngineBackend
    from agentrt.runtime.engine_worker import EngineWorker

    engine_kw, spec_kw = engine_memory(args)
    engine = AsyncEngine(await asyncio.to_thread(LLMEngine, engine_config(args, spec_kw, **engine_kw)))
    backend = EngineBackend(engine, model_name=args.served_model_name or args.model)
    try:
        print(f"agentrt engine-worker: {kv_cache_line(engine.engine)}", flush=True)
        if not args.no_warm_up:
            print(f"agentrt engine-worker: warmed up in {await engine.warm_up():.1f} s", flush=True)
        worker = EngineWorker(backend, config, worker_id=args.worker_id, status_interval_s=args.status_interval)
        if args.metrics_port is not None:
            _serve_metrics(worker, args.metrics_host, args.metrics_port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        print(f"agentrt engine-worker {worker.worker_id}: serving {backend.model_name} at {config.url} "
              f"(group '{config.group}')", flush=True)
        await worker.run(stop)
    finally:
        backend.close()
        engine.close()
    print("agentrt engine-worker: stopped", flush=True)
    return 0


def _serve_metrics(worker, host: str, port: int) -> None:
    """The worker's Prometheus metrics on host:port (prometheus-client's HTTP server, a thread of
    its own, so a long engine step never delays a scrape), filled from the engine's steps, the
    worker's responses and its status messages' KV blocks."""
    from prometheus_client import start_http_server

    from agentrt.server.metrics import EngineMetrics

    metrics = EngineMetrics(replica=worker.worker_id, engine=worker.worker_id)
    worker.backend.subscribe_steps(metrics.on_step)
    worker.on_response = metrics.on_response
    worker.on_status = lambda status: metrics.set_kv_blocks({worker.worker_id: status.get("kv") or {}})
    start_http_server(port, host, registry=metrics.exposed)
    print(f"agentrt engine-worker {worker.worker_id}: metrics at http://{host}:{port}/metrics", flush=True)

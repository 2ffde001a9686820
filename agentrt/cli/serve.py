"""`agentrt serve [PROGRAM_FILES...]`: agent programs and OpenAI-compatible chat over HTTP.

Loads the program files (as `agentrt run` does), one engine and one runtime, and serves until
SIGTERM or SIGINT: then it stops accepting work, lets what is in flight finish for up to
--shutdown-grace seconds, and stops the rest. Runs are recorded in a run store (--db: a SQLite
file, default runs/serve/agentrt.db, or a PostgreSQL database by its postgresql:// URL; --no-db
keeps them in memory): runs that had not ended when the server stopped, or died, are resumed when
it starts again. A store that cannot be opened (unreachable, corrupt, newer) stops it at start. The
HTTP port opens at once; /ready and the API answer 503 until the model is loaded. API keys come
from --api-key-file (one per line) or the AGENTRT_SERVE_API_KEYS variable (comma-separated;
AGENTRT_API_KEYS, the old name, still works with a warning); without a key the server binds only to
loopback. Clients send their key from AGENTRT_API_KEY (one key, no S): the server does not read
that one.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any, Mapping

from agentrt.cli.engine_args import add_model_arguments, add_tool_format_argument, engine_config
from agentrt.cli.memory_args import add_memory_arguments, engine_memory, kv_cache_line, trim_heap_every
from agentrt.errors import RunConfigError
from agentrt.runtime.remote_routing import ROUTING_MODES
from agentrt.runtime.store_location import db_argument
from agentrt.server.config import Limits, ServerConfig, is_loopback

log = logging.getLogger("agentrt.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("programs", nargs="*", metavar="PROGRAM_FILE", help="Python files defining `program` (examples/*.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a known model name, a .gguf file or a local HF directory")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    add_model_arguments(p)
    add_tool_format_argument(p)
    p.add_argument("--spec", default="template",
                   help="drafter: none | suffix | template | layerskip:N | draft:PATH")
    p.add_argument("--policy", default="las", choices=["las", "fcfs"])
    add_memory_arguments(p)
    p.add_argument("--tools", action="append", default=[], metavar="MODULE",
                   help="a module (dotted name or .py file) whose TOOLS (or @tool functions) programs may call")
    from agentrt.tools.mcp.spec import add_mcp_argument

    add_mcp_argument(p)  # started with the server: its tools are in the registry from the start
    p.add_argument("--broker", default=None, metavar="URL",
                   help="an MQTT broker (mqtt://HOST:PORT) for tools bound to the mqtt executor")
    p.add_argument("--engines", default=None, metavar="URL",
                   help="run LLM calls on `agentrt engine-worker`s at this MQTT broker (mqtt://HOST:PORT) instead "
                        "of loading a model here (--model then only names it)")
    p.add_argument("--engine-routing", default="affinity", choices=ROUTING_MODES,
                   help="with --engines: where each LLM call goes: the worker holding its KV while it has room, "
                        "else the least loaded (affinity); the workers in turn (round-robin); or the worker the "
                        "broker picks on the group's shared subscription (broker)")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help=f"API keys clients must send, one per line (also: ${SERVE_KEYS_VAR}, comma-separated; "
                        f"the clients' own ${CLIENT_KEY_VAR} is not read here)")
    p.add_argument("--runs-dir", default="runs/serve", help="where each finished run's trace is written")
    p.add_argument("--keep-runs", type=int, default=ServerConfig.keep_runs,
                   help="finished runs kept in memory (~130 KB each for the examples); older ones are read back "
                        "from the run store or their trace file")
    p.add_argument("--db", default=None, metavar="PATH|URL", type=db_argument,
                   help="the run store: a SQLite file, a path or sqlite:///PATH (default: RUNS_DIR/agentrt.db), or "
                        "postgresql://USER[:PASSWORD]@HOST[:PORT]/DB; unfinished runs in it resume on start")
    p.add_argument("--no-db", action="store_true", help="keep runs in memory only (nothing survives a restart)")
    p.add_argument("--lease-s", type=float, default=ServerConfig.lease_s, metavar="S",
                   help="with a PostgreSQL --db (several replicas on one database): how long this server's hold on "
                        "its runs lasts unless renewed (renewed every S/3); runs of a replica silent this long are "
                        "taken over by another")
    p.add_argument("--allow-changed-programs", action="store_true",
                   help="resume stored runs even when their program file changed since they started")
    p.add_argument("--prune-after", default=None, metavar="DURATION",
                   help="delete ended runs (store rows and traces) this long after they end: 90s, 30m, 12h, 7d")
    p.add_argument("--prune-keep", type=int, default=None, metavar="N", help="keep only the newest N ended runs")
    p.add_argument("--max-running-runs", type=int, default=Limits.max_running_runs)
    p.add_argument("--max-queued-runs", type=int, default=Limits.max_queued_runs)
    p.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    p.add_argument("--max-messages", type=int, default=Limits.max_messages)
    p.add_argument("--max-tokens", type=int, default=Limits.max_tokens, help="the most a chat request may ask for")
    p.add_argument("--program-max-tokens", type=int, default=None, metavar="N",
                   help="a cap on every program LLM call's max_tokens (as `agentrt run --max-tokens`)")
    p.add_argument("--max-tool-schema-bytes", type=int, default=Limits.max_tool_schema_bytes)
    p.add_argument("--max-sse-connections", type=int, default=Limits.max_sse_connections)
    p.add_argument("--max-inflight-chats", type=int, default=Limits.max_inflight_chats)
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", help="allow CORS from ORIGIN ('*': any)")
    p.add_argument("--shutdown-grace", type=float, default=30.0, metavar="S")
    p.add_argument("--no-access-log", action="store_true")
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send each run's spans to this OTLP/HTTP endpoint (e.g. http://localhost:4318/v1/traces)")


SERVE_KEYS_VAR = "AGENTRT_SERVE_API_KEYS"
OLD_SERVE_KEYS_VAR = "AGENTRT_API_KEYS"  # deprecated: one letter from the client's AGENTRT_API_KEY
CLIENT_KEY_VAR = "AGENTRT_API_KEY"


def load_api_keys(path: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The keys from --api-key-file (one per line) and AGENTRT_SERVE_API_KEYS (comma-separated);
    the old AGENTRT_API_KEYS still counts, with a deprecation warning. A client's AGENTRT_API_KEY
    set where the server finds no key of its own is logged: it is not read here."""
    env = os.environ if environ is None else environ
    keys: list[str] = []
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise RunConfigError(f"--api-key-file {path}: cannot read it ({e.strerror})") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise RunConfigError(f"--api-key-file {path}: no keys in it (one per line)")
    keys += _env_keys(env, SERVE_KEYS_VAR)
    old = _env_keys(env, OLD_SERVE_KEYS_VAR)
    if old:
        log.warning("%s is deprecated (it is one letter from the client's %s): name the server's keys %s",
                    OLD_SERVE_KEYS_VAR, CLIENT_KEY_VAR, SERVE_KEYS_VAR)
        keys += old
    if not keys and env.get(CLIENT_KEY_VAR, "").strip():
        log.warning("%s is set, but that is a client's key: the server reads its keys from --api-key-file or %s "
                    "(comma-separated), and has none, so it asks for no key", CLIENT_KEY_VAR, SERVE_KEYS_VAR)
    return tuple(keys)


def _env_keys(env: Mapping[str, str], name: str) -> list[str]:
    return [k.strip() for k in env.get(name, "").split(",") if k.strip()]


def server_config(args: argparse.Namespace) -> ServerConfig:
    limits = Limits(max_body_bytes=args.max_body_bytes, max_messages=args.max_messages, max_tokens=args.max_tokens,
                    default_max_tokens=min(Limits.default_max_tokens, args.max_tokens),
                    max_tool_schema_bytes=args.max_tool_schema_bytes, max_sse_connections=args.max_sse_connections,
                    max_running_runs=args.max_running_runs, max_queued_runs=args.max_queued_runs,
                    max_inflight_chats=args.max_inflight_chats)
    keys = load_api_keys(args.api_key_file)
    if not keys and not is_loopback(args.host):
        raise RunConfigError(f"--host {args.host} is not a loopback address and no API key is set: anyone who can "
                             f"reach it could run programs. Give --api-key-file PATH (or {SERVE_KEYS_VAR}), or bind "
                             f"to 127.0.0.1")
    from agentrt.cli.runs import duration_s

    if args.lease_s <= 0:
        raise RunConfigError(f"--lease-s must be positive, got {args.lease_s:g}")
    runs_dir = Path(args.runs_dir)
    db = None if args.no_db else args.db or runs_dir / "agentrt.db"
    return ServerConfig(host=args.host, port=args.port, api_keys=keys, limits=limits, runs_dir=runs_dir,
                        keep_runs=args.keep_runs, db=db, allow_changed_programs=args.allow_changed_programs,
                        prune_after_s=duration_s(args.prune_after) if args.prune_after else None,
                        prune_keep=args.prune_keep, cors_origins=tuple(args.cors_origin), lease_s=args.lease_s,
                        shutdown_grace_s=args.shutdown_grace, access_log=not args.no_access_log)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from agentrt.runtime.loader import load_example

    config = server_config(args)
    from agentrt.tools.mcp.spec import configure_from_flags

    args.mcp_servers = configure_from_flags(args.mcp)  # before the program files' mcp_tools(...) run
    examples = [load_example(p) for p in args.programs]
    programs = {}
    for ex in examples:
        if ex.name in programs:
            raise RunConfigError(f"two program files define a program named '{ex.name}': {programs[ex.name].path}, {ex.path}")
        programs[ex.name] = ex
    from agentrt.tools.loader import load_tools

    tools = [t for ex in examples for t in ex.tools] + [t for m in args.tools for t in load_tools(m)]
    from agentrt.runtime.store import NullRunStore, open_store

    # a corrupt or newer store stops the server here, before the port opens
    store = open_store(config.db) if config.db is not None else NullRunStore()
    try:
        return asyncio.run(serve(args, config, programs, tools, store))
    finally:
        store.close()


async def serve(args: argparse.Namespace, config: ServerConfig, programs: dict, tools: list, store: Any = None) -> int:
    from aiohttp import web

    from agentrt.server.app import STATE, create_app

    model = args.served_model_name or args.model
    provider = None
    if args.otlp_endpoint:
        from agentrt.runtime.otel import otlp_provider

        provider = otlp_provider(args.otlp_endpoint)
    app = create_app(config, model, programs, tracer_provider=provider)
    # a client that goes away cancels its handler, so its engine requests are aborted, not finished
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = f"http://{config.host}:{config.port}"
    print(f"agentrt serve: {url}  (loading {args.model} ...)", flush=True)
    engine = backend = runtime = None
    state = app[STATE]
    try:
        engine, backend, runtime = await _start_runtime(args, tools, model, store)
        state.precision = engine.info.precision if engine is not None else backend.precision
        state.attach(runtime)
        resumed = state.resumed
        print(f"agentrt serve: ready at {url}\n  model: {model} ({state.precision}; {args.device}, spec {args.spec}, "
              f"policy {args.policy})\n  programs: {', '.join(sorted(programs)) or 'none'} (as MCP tools at {url}/mcp)\n"
              f"  runs stored in: {config.db or 'memory only'} (traces in {config.runs_dir}/)"
              + (f", {len(resumed)} resumed" if resumed else "")
              + f"\n  API keys: {len(config.api_keys) or 'none (loopback only)'}", flush=True)
        trimmer = asyncio.get_running_loop().create_task(trim_heap_every(args.heap_trim_interval))
        await stop.wait()
        trimmer.cancel()
        print("agentrt serve: stopping: no new work; waiting for runs in flight "
              f"(up to {config.shutdown_grace_s:g} s)", flush=True)
        state.stopping = True
        if state.runs is not None:
            await state.runs.shutdown(config.shutdown_grace_s)
        if state.feed is not None:
            state.feed.close()  # ends the console's /v1/events streams
    finally:
        await runner.cleanup()
        if runtime is not None:
            await runtime.aclose()
            await runtime.tools.aclose()
        if hasattr(backend, "aclose"):  # remote engines: a connection to close
            await backend.aclose()
        elif backend is not None:
            backend.close()
        if engine is not None:
            engine.close()
        if provider is not None:
            provider.shutdown()  # flushes the spans still batched
    print("agentrt serve: stopped", flush=True)
    return 0


async def _start_runtime(args: argparse.Namespace, tools: list, model: str, store: Any = None) -> tuple[Any, Any, Any]:
    """Load the engine on a thread (the event loop keeps answering /health), then the runtime."""
    from agentrt.engine import AsyncEngine, LLMEngine
    from agentrt.runtime.engine_backend import EngineBackend

    if getattr(args, "engines", None):
        from agentrt.server.remote_engines import start_remote_engines

        backend = await start_remote_engines(args, model)
        return None, backend, await _runtime(args, tools, model, store, backend, backend.precision)
    engine_kw, spec_kw = engine_memory(args)
    engine = AsyncEngine(await asyncio.to_thread(LLMEngine, engine_config(args, spec_kw, **engine_kw)))
    print(f"agentrt serve: {kv_cache_line(engine.engine)}", flush=True)
    print(f"agentrt serve: tool calls in the {engine.info.tool_format.name} format", flush=True)
    # before /ready says so, not on a client's request
    print(f"agentrt serve: engine warmed up in {await engine.warm_up():.1f} s", flush=True)
    backend = EngineBackend(engine, model_name=model)
    return engine, backend, await _runtime(args, tools, model, store, backend, engine.info.precision)


async def _runtime(args: argparse.Namespace, tools: list, model: str, store: Any, backend: Any, precision: str) -> Any:
    """The runtime on a backend (an in-process engine or remote engine workers), with its tools."""
    from agentrt.runtime.runtime import Runtime
    from agentrt.runtime.trace import Trace
    from agentrt.tools import ToolRegistry

    registry = ToolRegistry()
    for t in tools:
        if t.name not in registry:
            registry.register(t)
    if args.broker:
        from agentrt.tools.mqtt_client import MqttDispatcher
        from agentrt.tools.mqtt_protocol import MqttConfig

        registry.add_executor("mqtt", await MqttDispatcher(MqttConfig.from_url(args.broker)).start())
    await _start_mcp_servers(registry, getattr(args, "mcp_servers", []))
    trace = Trace(name="serve", meta={"model": model, "precision": precision, "device": args.device,
                                      "drafter": args.spec, "policy": args.policy})
    return Runtime(backend, tools=registry, trace=trace, policy=args.policy,
                   max_tokens=args.program_max_tokens, store=store)


async def _start_mcp_servers(registry: Any, specs: list) -> None:
    """--mcp servers start with the server, their tools registered. One that cannot start is
    reported and started again on first use; the server comes up without it."""
    for spec in specs:
        try:
            started = await registry.executor("mcp").start(spec)
        except Exception as e:  # noqa: BLE001 - a ToolCallError naming the server
            print(f"agentrt serve: MCP server '{spec.name}' did not start: {e}", flush=True)
            continue
        print(f"agentrt serve: MCP server '{spec.name}': {', '.join(t.name for t in started) or 'no tools'}", flush=True)

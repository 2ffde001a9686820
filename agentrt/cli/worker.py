"""`agentrt worker MODULE.py --broker mqtt://HOST:PORT`: serve a module's tools over MQTT.

The module's tools are its `TOOLS` list if it has one, else every module-level Tool with a
Python function (what `@tool` makes). Run as many workers as you like, on any machines: the
broker spreads calls over the workers of a group (`python -m agentrt.cli worker ...` is the
same). The password may come from $AGENTRT_MQTT_PASSWORD.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from typing import Any

from agentrt.tools.errors import ToolDefinitionError
from agentrt.tools.loader import load_tools


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("module", help="a Python file (tools.py) or module (pkg.tools) whose @tool functions to serve")
    add_broker_arguments(p)
    p.add_argument("--concurrency", type=int, default=8, help="calls run at once by this worker")
    p.add_argument("--tools", help="comma-separated subset of the module's tools to serve")
    p.add_argument("--max-payload-bytes", type=int, default=1 << 20)
    p.add_argument("--log-level", default="INFO")


def add_broker_arguments(p: argparse.ArgumentParser) -> None:
    """The broker, topic and credential flags of a worker (tool or engine)."""
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    p.add_argument("--group", default="default", help="worker group: calls are spread over a group's workers")
    p.add_argument("--prefix", default="agentrt", help="topic prefix")
    p.add_argument("--id", dest="worker_id", help="worker id (default: HOST-PID-random)")
    p.add_argument("--username")
    p.add_argument("--password", help="or set AGENTRT_MQTT_PASSWORD (keeps it out of the process list)")
    p.add_argument("--tls", action="store_true", help="use TLS (implied by mqtts://)")
    p.add_argument("--tls-ca", help="CA certificate file that signed the broker's certificate")
    p.add_argument("--tls-cert", help="client certificate file (mutual TLS)")
    p.add_argument("--tls-key", help="client private key file (mutual TLS)")
    p.add_argument("--tls-insecure", action="store_true", help="do not check the broker's host name")
    p.add_argument("--keepalive", type=int, default=10, help="seconds; a vanished worker is declared offline after 1.5x this")


def broker_config(args: argparse.Namespace) -> Any:
    """The MqttConfig of add_broker_arguments' flags (the password may come from $AGENTRT_MQTT_PASSWORD)."""
    from agentrt.tools.mqtt_protocol import MqttConfig

    return MqttConfig.from_url(
        args.broker, group=args.group, prefix=args.prefix, username=args.username,
        password=args.password or os.environ.get("AGENTRT_MQTT_PASSWORD"),
        tls=True if args.tls else None, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_insecure=True if args.tls_insecure else None, keepalive_s=args.keepalive,
    )


def run(args: argparse.Namespace) -> int:
    from agentrt.tools.mqtt_worker import MqttWorker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tools = load_tools(args.module)
    if args.tools:
        wanted = [n.strip() for n in args.tools.split(",") if n.strip()]
        by_name = {t.name: t for t in tools}
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise ToolDefinitionError(f"{args.module!r} has no tool(s) {missing} (it has {sorted(by_name)})")
        tools = [by_name[n] for n in wanted]
    worker = MqttWorker(tools, broker_config(args), worker_id=args.worker_id, concurrency=args.concurrency,
                        max_payload_bytes=args.max_payload_bytes)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await worker.run(stop)

    asyncio.run(serve())
    return 0

"""The load of `agentrt bench workload`: which programs run with which inputs, when they are
submitted, and how long each tool call takes. Seeded, so every policy sees the same load."""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_NAMES = ("trip_planner", "research", "sql_agent")

# Varied inputs per example; program i runs EXAMPLE_NAMES[i % 3] with the (i // 3)-th of them: 33
# programs before any repeats its inputs (a repeat would find its prompts in c's prefix cache).
INPUTS: dict[str, list[dict[str, Any]]] = {
    "trip_planner": [
        {"request": "Four days in Lisbon in May, budget 900 dollars.", "home_currency": "USD"},
        {"request": "A week in Kyoto in April with 2000 pounds.", "home_currency": "GBP"},
        {"request": "Three days in Prague in December, 600 euros.", "home_currency": "EUR"},
        {"request": "Five days in Reykjavik in July, budget 1500 dollars.", "home_currency": "USD"},
        {"request": "A weekend in Vienna in October for 400 francs.", "home_currency": "CHF"},
        {"request": "Six days in Marrakech in March, 1000 euros.", "home_currency": "EUR"},
        {"request": "Two days in Porto in June, budget 500 euros.", "home_currency": "EUR"},
        {"request": "Ten days in Sydney in January with 3000 dollars.", "home_currency": "USD"},
        {"request": "Four days in Edinburgh in August, 800 pounds.", "home_currency": "GBP"},
        {"request": "A week in Athens in September, budget 1200 euros.", "home_currency": "EUR"},
        {"request": "Three days in Montreal in February, 700 dollars.", "home_currency": "USD"},
    ],
    "research": [
        {"question": "How do honey bee colonies survive the winter, and what threatens them?"},
        {"question": "How do bees decide where to swarm?"},
        {"question": "What does the varroa mite do to a colony?"},
        {"question": "How do bees tell each other where flowers are?"},
        {"question": "How is honey made from nectar?"},
        {"question": "Which crops depend on bee pollination?"},
        {"question": "What do drones do in a honey bee colony?"},
        {"question": "How do bees keep the hive warm in winter?"},
        {"question": "Which viruses do varroa mites spread?"},
        {"question": "What is the waggle dance?"},
        {"question": "Why do colonies swarm in spring?"},
    ],
    "sql_agent": [
        {"question": "How many orders were placed in March 2025?"},
        {"question": "Which city has the most customers?"},
        {"question": "What is the most expensive product?"},
        {"question": "How many products are in the tea category?"},
        {"question": "Which customer placed the most orders?"},
        {"question": "What was the total quantity ordered in January 2025?"},
        {"question": "How many customers live in Porto?"},
        {"question": "What is the cheapest product?"},
        {"question": "How many orders included a teapot?"},
        {"question": "Which category has the most products?"},
        {"question": "How many customers joined in 2024?"},
    ],
}


def workload(n: int) -> list[tuple[str, dict[str, Any]]]:
    """The n programs of a run, as (example name, inputs): the examples in turn."""
    return [(EXAMPLE_NAMES[i % 3], INPUTS[EXAMPLE_NAMES[i % 3]][(i // 3) % len(INPUTS[EXAMPLE_NAMES[i % 3]])])
            for i in range(n)]



# ---- tool latencies ---------------------------------------------------------------------------

_PROGRAM: contextvars.ContextVar[int] = contextvars.ContextVar("agentrt_bench_program", default=-1)


@dataclass(frozen=True)
class ToolLatency:
    """Log-normal latency with the given median and p90 (sigma = ln(p90/median) / z_0.9), capped."""

    median_s: float = 0.3
    p90_s: float = 3.0
    cap_s: float = 15.0
    seed: int = 0

    @property
    def sigma(self) -> float:
        return math.log(self.p90_s / self.median_s) / 1.2815515655446004

    def draw(self, program: int, tool: str, n: int) -> float:
        rng = random.Random(f"{self.seed}:{program}:{tool}:{n}")
        return min(self.cap_s, self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0)))


def delayed_tools(tools: list[Any], latency: ToolLatency) -> tuple[list[Any], list[tuple[int, str, float]]]:
    """The tools, each waiting its drawn latency before running (the program comes from a context
    variable the submitting code sets, so every call knows its program). Returns the wrapped tools
    and the log of (program, tool, seconds) they fill as they are called."""
    from agentrt.tools.tool import is_coroutine_tool

    counts: dict[tuple[int, str], int] = defaultdict(int)
    log: list[tuple[int, str, float]] = []

    def wrap(t):
        fn, is_async = t.fn, is_coroutine_tool(t)

        async def call(*args: Any, **kwargs: Any) -> Any:
            program = _PROGRAM.get()
            n = counts[program, t.name]
            counts[program, t.name] += 1
            seconds = latency.draw(program, t.name, n)
            log.append((program, t.name, seconds))
            await asyncio.sleep(seconds)
            return await fn(*args, **kwargs) if is_async else await asyncio.to_thread(fn, *args, **kwargs)

        # no timeout: the drawn latency is the tool's latency (the cap bounds it)
        return dataclasses.replace(t, fn=call, timeout_s=None)

    return [wrap(t) for t in tools], log


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Seconds after the first submit at which each program is submitted: all at once (rate None),
    or a seeded Poisson process of `rate` programs per second (the first at 0)."""
    if rate is None:
        return [0.0] * n
    if not (rate > 0.0) or math.isinf(rate):
        raise ValueError(f"--rate must be a positive number of programs per second, got {rate!r}")
    rng, t, times = random.Random(f"{seed}:arrivals"), 0.0, []
    for i in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times

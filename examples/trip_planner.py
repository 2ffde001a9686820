"""Trip planner: the model turns a request into a structured plan; tools then work on it
(climate normals and exchange rates from data files shipped with the example, and the
traveller's calendar), and the model writes the itinerary from their results.

    agentrt run examples/trip_planner.py
    agentrt run examples/trip_planner.py --input request="Five days in Kyoto in April" --input home_currency=GBP

    plan (LLM, JSON) ─┬─ weather (get_weather) ── money (convert_currency) ─┬─ itinerary (LLM)
                      └─ days (find_free_days) ────────────────────────────────┘
    (money converts the budget into the currency of the city found by get_weather)

Each tool has a fallback, so a city or currency the data does not know degrades the itinerary
instead of failing the run (the trace shows the failed call).
"""
from __future__ import annotations

import datetime as dt
import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field

from agentrt.dag import JsonSchema, Program
from agentrt.tools import tool

DATA = Path(__file__).parent / "data"
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


@lru_cache(maxsize=None)
def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def _city(name: str) -> tuple[str, dict]:
    cities = _load("weather.json")["cities"]
    key = name.split(",")[0].strip().lower()
    for city, info in cities.items():
        if city.lower() == key:
            return city, info
    close = difflib.get_close_matches(key, [c.lower() for c in cities], n=1, cutoff=0.75)
    if close:
        city = next(c for c in cities if c.lower() == close[0])
        return city, cities[city]
    raise ValueError(f"no climate data for {name!r}; known cities: {', '.join(sorted(cities))}")


def _month(text: str) -> int:
    """1..12 from a month name ("May", "sept") or a YYYY-MM-DD date."""
    text = text.strip()
    try:
        return dt.date.fromisoformat(text[:10]).month
    except ValueError:
        pass
    for i, month in enumerate(MONTHS):
        if len(text) >= 3 and month.lower().startswith(text.lower()[:3]):
            return i + 1
    raise ValueError(f"cannot read the month {text!r}: write a month name such as May")


def _currency(text: str) -> str:
    data = _load("exchange_rates.json")
    code = text.strip().upper()
    if code in data["rates"]:
        return code
    name = data["names"].get(text.strip().lower())
    if name is not None:
        return name
    raise ValueError(f"unknown currency {text!r}; known codes: {', '.join(sorted(data['rates']))}")


@tool(idempotent=True, timeout_s=5)
def get_weather(city: Annotated[str, Field(description="city name, e.g. Lisbon")],
                month: Annotated[str, Field(description="month name, e.g. May")]) -> dict:
    """Typical weather for a city in a month (climate normals)."""
    name, info = _city(city)
    month = _month(month) - 1
    high, low, rain = info["high"][month], info["low"][month], info["rain_days"][month]
    feel = "hot" if high >= 28 else "warm" if high >= 20 else "mild" if high >= 12 else "cold"
    wet = "often rainy" if rain >= 10 else "some rain" if rain >= 5 else "mostly dry"
    return {"city": name, "month": MONTHS[month], "avg_high_c": high, "avg_low_c": low, "rain_days": rain,
            "summary": f"{feel}, {wet}", "currency": info["currency"]}


@tool(idempotent=True, timeout_s=5)
def convert_currency(amount: Annotated[float, Field(ge=0, description="amount to convert")],
                     from_currency: Annotated[str, Field(description="ISO code, e.g. USD")],
                     to_currency: Annotated[str, Field(description="ISO code, e.g. EUR")]) -> dict:
    """Convert an amount between currencies at the reference rates shipped with the example."""
    data = _load("exchange_rates.json")
    src, dst = _currency(from_currency), _currency(to_currency)
    value = amount / data["rates"][src] * data["rates"][dst]
    return {"amount": amount, "from": src, "to": dst, "converted": round(value, 2),
            "rate": round(data["rates"][dst] / data["rates"][src], 6), "rates_date": data["date"]}


@tool(idempotent=True, timeout_s=5)
def find_free_days(month: Annotated[str, Field(description="month name, e.g. May")],
                   days: Annotated[int, Field(ge=1, le=30, description="trip length in days")]) -> dict:
    """The first run of free consecutive days in the traveller's 2025 calendar, from the start of
    `month` on (busy events and public holidays at home block a day)."""
    cal = _load("calendar.json")
    blocked: dict[dt.date, str] = {}
    for ev in cal["busy"]:
        d, end = dt.date.fromisoformat(ev["start"]), dt.date.fromisoformat(ev["end"])
        while d <= end:
            blocked[d] = ev["title"]
            d += dt.timedelta(days=1)
    for h in cal["holidays"]:
        blocked.setdefault(dt.date.fromisoformat(h["date"]), h["title"])
    first = dt.date(2025, _month(month), 1)
    for shift in range(0, 120):
        window = [first + dt.timedelta(days=shift + i) for i in range(days)]
        clashes = sorted({blocked[d] for d in window if d in blocked})
        if not clashes:
            skipped = sorted({blocked[first + dt.timedelta(days=i)] for i in range(shift)
                              if first + dt.timedelta(days=i) in blocked})
            return {"start": window[0].isoformat(), "end": window[-1].isoformat(), "days": days,
                    "moved_by_days": shift, "avoided": skipped}
    raise ValueError(f"no {days} free consecutive days within 120 days of {first.isoformat()}")


PLAN = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "month": {"type": "string", "enum": MONTHS},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "budget": {"type": "number", "minimum": 0},
    },
    "required": ["city", "month", "days", "budget"],
    "additionalProperties": False,
}

tools = [get_weather, convert_currency, find_free_days]

p = Program("trip_planner", inputs={"request": str, "home_currency": str}, tools=tools)
plan = p.llm("plan", system="Reply only with JSON.",
             prompt='Trip request: {request}\nGive the city, the month, the number of days and the budget of '
                    'this trip as JSON.',
             output=JsonSchema(PLAN, name="plan"), max_tokens=64)
weather = p.tool("weather", "get_weather", args={"city": plan["city"], "month": plan["month"]},
                 fallback={"summary": "no climate data"})
money = p.tool("money", "convert_currency", args={"amount": plan["budget"], "from_currency": p.input("home_currency"),
                                                  "to_currency": weather["currency"]},
               fallback={"converted": None, "note": "no exchange rate"})
days = p.tool("days", "find_free_days", args={"month": plan["month"], "days": plan["days"]},
              fallback={"note": "calendar unavailable"})
p.output(p.llm("itinerary", system="You are a concise travel assistant.",
               prompt="In three sentences, suggest what to do on a {plan.days}-day trip to {plan.city} in "
                      "{plan.month}.\nWeather: {weather}\nDates: {days}\nBudget: {money}",
               # a 135M model repeats itself at temperature 0 without a penalty, and after its
               # paragraph it echoes the data it was given: one paragraph is the answer
               max_tokens=160, sampling={"frequency_penalty": 0.5, "presence_penalty": 0.3, "stop": ["\n\n"]}))
program = p.compile()

DEFAULT_INPUTS = {"request": "Four days in Lisbon in May, budget 900 dollars.", "home_currency": "USD"}

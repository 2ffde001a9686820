"""Example tools module for `agentrt worker examples/tools_demo/tools.py --broker mqtt://HOST:PORT`.

The same module works in-process: `ToolRegistry(load_tools("examples/tools_demo/tools.py"))`.
"""
from __future__ import annotations

import asyncio
import math
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from agentrt.tools import tool


class Location(BaseModel):
    city: str
    country: str = Field("FR", description="ISO 3166 country code")


@tool(idempotent=True, timeout_s=5)
async def get_weather(location: Location, unit: Literal["celsius", "fahrenheit"] = "celsius") -> dict:
    """Current weather for a place.

    Args:
        location: where to look
        unit: temperature unit
    """
    await asyncio.sleep(0.01)  # stands for a call to a weather service
    temp_c = 11 + (sum(map(ord, location.city)) % 15)  # deterministic fake reading
    temp = temp_c if unit == "celsius" else temp_c * 9 / 5 + 32
    return {"city": location.city, "country": location.country, "temperature": temp, "unit": unit}


@tool(idempotent=True)
def hypotenuse(a: Annotated[float, Field(gt=0, description="first side")],
               b: Annotated[float, Field(gt=0, description="second side")]) -> float:
    """Length of the hypotenuse of a right triangle (a CPU tool: runs on a worker thread)."""
    return math.hypot(a, b)

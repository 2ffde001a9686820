"""Typed functions -> tool declarations; OpenAI-format schemas; argument validation messages."""
from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from agentrt.tools import Tool, ToolArgumentsError, ToolDefinitionError, tool
from agentrt.tools.schema import parse_arguments, strip_titles, validate_arguments


class Place(BaseModel):
    city: str
    country: str = Field("FR", description="ISO code")


@tool(idempotent=True, timeout_s=5, retries=2)
def forecast(
    place: Place,
    day: dt.date,
    unit: Literal["c", "f"] = "c",
    hours: Annotated[int, Field(ge=1, le=48, description="hours ahead")] = 24,
    note: Optional[str] = None,
) -> list[float]:
    """Hourly temperature forecast.

    Longer explanation that is part of the description.

    Args:
        place: where to forecast
        unit: temperature unit,
            celsius or fahrenheit
        hours: overridden by the Field description
    Returns:
        temperatures
    """
    return [20.0] * hours


def test_openai_schema_from_typed_function():
    spec = forecast.openai_schema()
    assert spec["type"] == "function"
    fn = spec["function"]
    assert fn["name"] == "forecast"
    assert fn["description"] == "Hourly temperature forecast.\n\nLonger explanation that is part of the description."
    params = fn["parameters"]
    assert params["type"] == "object" and params["additionalProperties"] is False
    assert params["required"] == ["place", "day"]
    props = params["properties"]
    assert props["place"] == {"$ref": "#/$defs/Place", "description": "where to forecast"}
    assert params["$defs"]["Place"]["properties"]["country"] == {"default": "FR", "description": "ISO code", "type": "string"}
    assert props["day"] == {"format": "date", "type": "string"}
    assert props["unit"] == {"default": "c", "description": "temperature unit, celsius or fahrenheit", "enum": ["c", "f"], "type": "string"}
    assert props["hours"] == {"default": 24, "description": "hours ahead", "maximum": 48, "minimum": 1, "type": "integer"}
    assert "title" not in str(params)  # pydantic's titles are dropped: they cost prompt tokens
    assert forecast.output_schema == {"items": {"type": "number"}, "type": "array"}
    assert (forecast.idempotent, forecast.timeout_s, forecast.retries) == (True, 5, 2)


def test_decorated_function_stays_callable():
    assert forecast(Place(city="Paris"), dt.date(2025, 1, 1), hours=2) == [20.0, 20.0]


def test_strip_titles_keeps_a_property_named_title():
    schema = {"title": "M", "type": "object", "properties": {"title": {"title": "Title", "type": "string"}}}
    assert strip_titles(schema) == {"type": "object", "properties": {"title": {"type": "string"}}}


def test_validation_errors_name_the_field():
    with pytest.raises(ToolArgumentsError) as info:
        validate_arguments("forecast", forecast.args_validator, {"place": {"country": "DE"}, "day": "2025-01-01", "hours": 99, "x": 1})
    msg = str(info.value)
    assert "tool 'forecast'" in msg
    assert "argument 'place.city': 'city' is a required property" in msg
    assert "argument 'hours': 99 is greater than the maximum of 48" in msg
    assert "argument 'x'" in msg and "unexpected" in msg
    with pytest.raises(ToolArgumentsError, match="argument 'day'"):
        validate_arguments("forecast", forecast.args_validator, {"place": {"city": "Paris"}})


def test_parse_arguments_accepts_model_json_text():
    assert parse_arguments("t", '{"a": 1}') == {"a": 1}
    assert parse_arguments("t", "") == {} and parse_arguments("t", None) == {}
    with pytest.raises(ToolArgumentsError, match="tool 't': arguments are not valid JSON"):
        parse_arguments("t", '{"a": ')
    with pytest.raises(ToolArgumentsError, match="must be a JSON object, got list"):
        parse_arguments("t", "[1, 2]")


def test_from_openai_schema():
    spec = {"type": "function", "function": {"name": "lookup", "description": "Look up a word.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
    t = Tool.from_openai(spec, fn=lambda word: word.upper(), idempotent=True)
    assert t.openai_schema() == spec
    assert t.idempotent and t.executor == "inprocess"
    assert Tool.from_openai(spec["function"]).name == "lookup"  # the inner object works too


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"function": {"description": "no name"}}, "bad OpenAI tool schema"),
        ({"function": {"name": "bad name!", "parameters": {"type": "object"}}}, "tool name 'bad name!'"),
        ({"function": {"name": "t", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}},
         "tool 't': parameters is not a valid JSON schema"),
        ({"function": {"name": "t", "parameters": {"type": "array"}}}, "parameters must be an object schema"),
    ],
)
def test_bad_declarations_are_refused(spec, match):
    with pytest.raises(ToolDefinitionError, match=match):
        Tool.from_openai(spec)


def test_unsupported_signatures_are_refused():
    def star(*items: int) -> int:
        """Sum."""
        return sum(items)

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ToolDefinitionError, match=r"tool 'star': \*items is not supported"):
        tool(star)
    with pytest.raises(ToolDefinitionError, match="tool 'undocumented': give it a docstring"):
        tool(undocumented)
    assert tool(undocumented, description="Identity.").description == "Identity."
    with pytest.raises(ToolDefinitionError, match="timeout_s must be > 0"):
        tool(undocumented, description="x", timeout_s=0)


def test_kwargs_allow_extra_arguments():
    @tool
    def tag(name: str, **labels: str) -> dict:
        """Tag something."""
        return {"name": name, **labels}

    assert "additionalProperties" not in tag.parameters or tag.parameters["additionalProperties"] is not False
    validate_arguments("tag", tag.args_validator, {"name": "a", "color": "red"})

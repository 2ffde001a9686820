"""Schemas no finite JSON value satisfies are found before generation (agentrt.structured.schema_finite)."""
from __future__ import annotations

import pytest

from agentrt.errors import RequestError
from agentrt.structured.output_format import parse_response_format
from agentrt.structured.schema_finite import unfinishable_part


def _tree(child_schema: dict, required: bool = True) -> dict:
    node = {"type": "object", "properties": {"child": child_schema}, "required": ["child"] if required else []}
    return {"$defs": {"n": node}, "$ref": "#/$defs/n"}


@pytest.mark.parametrize("schema,part", [
    (_tree({"$ref": "#/$defs/n"}), "(root)"),  # every object requires another
    (_tree({"$ref": "#/$defs/n"}, required=False), None),
    (_tree({"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}), None),
    (_tree({"type": ["object", "null"], "$ref": "#/$defs/n"}), "(root)"),  # the $ref applies to both branches
    (_tree({"type": "array", "items": {"$ref": "#/$defs/n"}}), None),  # [] ends it
    (_tree({"type": "array", "items": {"$ref": "#/$defs/n"}, "minItems": 1}), "(root)"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"], "additionalProperties": False},
     "(root)"),  # b required, not allowed
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "(root)"),
    ({"type": "object", "properties": {"opt": {"$ref": "#/$defs/bad"}},
      "$defs": {"bad": {"type": "object", "properties": {"b": {"$ref": "#/$defs/bad"}}, "required": ["b"]}}},
     "#/properties/opt"),  # optional, but a generation may enter it and never leave
    ({"type": "object", "properties": {"ok": {"type": "integer"}},
      "$defs": {"unused": {"type": "object", "properties": {"b": {"$ref": "#/$defs/unused"}}, "required": ["b"]}}},
     None),  # unreachable parts do not matter
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "(root)"),
    ({"anyOf": [{"$ref": "#/$defs/l"}, {"type": "string"}],
      "$defs": {"l": {"type": "array", "minItems": 2, "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/l"}]}}},
     "#/anyOf/0"),
])
def test_unfinishable_parts(schema, part):
    assert unfinishable_part(schema) == part


def test_a_recursive_required_schema_is_refused_up_front():
    rf = {"type": "json_schema", "json_schema": {"name": "tree", "schema": _tree({"$ref": "#/$defs/n"})}}
    with pytest.raises(RequestError, match=r"response_format json_schema 'tree': no finite JSON value satisfies"):
        parse_response_format(rf)
    tool = {"type": "function", "function": {"name": "grow", "parameters": _tree({"$ref": "#/$defs/n"})}}
    with pytest.raises(RequestError, match=r"tool 'grow' parameters: no finite JSON value"):
        parse_response_format({"type": "tool_call", "tools": [tool]})

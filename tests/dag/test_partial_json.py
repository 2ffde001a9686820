"""JsonMembers: top-level members of a streamed JSON object/array reported as soon as they are final."""
import json
import random

import pytest

from agentrt.dag.partial_json import JsonMembers


def members(doc):
    value = json.loads(doc)
    return list(value.items()) if isinstance(value, dict) else list(enumerate(value))


def feed_chunks(doc, sizes):
    scanner, got, i = JsonMembers(), [], 0
    for size in sizes:
        got += scanner.feed(doc[i:i + size])
        i += size
    got += scanner.feed(doc[i:])
    return scanner, got


def arrival(doc):
    """Feed one character at a time: {member name: index of the character that made it final}."""
    scanner, seen = JsonMembers(), {}
    for i, ch in enumerate(doc):
        for name, _ in scanner.feed(ch):
            seen[name] = i
    return seen


DOCS = [
    '{"city": "Oslo", "days": 4, "budget": 900}',
    '[1, -2.5e3, true, false, null, "x", [], {}]',
    '{"plan": {"steps": [{"tool": "search", "args": {"q": "a,b}"}}, [1, [2, [3]]]]}, "n": 0}',
    '{"s": "comma, brace } bracket ] colon : quote \\" backslash \\\\ end", "u": "\\u00e9\\ud83d\\ude00\\n\\t"}',
    '[\n  {"a": [1, 2, {"b": "]}"}]},\n  "\\\\",\n  "\\\\\\"",\n  12345678901234567890\n]',
    '\n\t {\n  "k1" :\n  [ 1 ,\n 2 ] ,\r\n  "k2":"v" ,"k3"  :  { "x" : { } }\n}\n',
    '{"é": "ü", "": "", "nested": {"a": {"b": {"c": [[], [[]], {"d": null}]}}}}',
    '[[], {}, "", 0, 0.5, -0, 1E+2, "}", "{", "[", "]", ",", ":"]',
    '{}', '[]', ' { } ', '[ ]',
]


@pytest.mark.parametrize("doc", DOCS)
def test_whole_document_in_one_delta(doc):
    scanner = JsonMembers()
    assert scanner.feed(doc) == members(doc)
    assert scanner.done and scanner.broken is None
    assert scanner.kind == ("object" if doc.strip()[0] == "{" else "array")


@pytest.mark.parametrize("doc", DOCS)
def test_random_chunk_splits_match_json_loads(doc):
    for seed in range(200):
        rng = random.Random(seed)
        sizes = [rng.choice([0, 1, 1, 2, 3, 5, 8, 20]) for _ in range(len(doc))]
        scanner, got = feed_chunks(doc, sizes)
        assert got == members(doc), seed
        assert scanner.done and scanner.broken is None


@pytest.mark.parametrize("doc", DOCS)
def test_one_char_at_a_time_matches_json_loads(doc):
    _, got = feed_chunks(doc, [1] * len(doc))
    assert got == members(doc)


def test_member_reported_exactly_at_its_delimiter():
    doc = '{"city": "Oslo", "days": 4, "budget": 900}'
    assert arrival(doc) == {"city": doc.index(", \"days\""), "days": doc.index(", \"budget\""),
                            "budget": len(doc) - 1}
    doc = '[4, "a,b", [1, 2], {"k": 42}]'
    assert arrival(doc) == {0: 2, 1: doc.index(", [1"), 2: doc.index(", {"), 3: len(doc) - 1}


def test_number_not_final_before_delimiter():
    scanner = JsonMembers()
    assert scanner.feed('{"n": 4') == []
    assert scanner.feed("2") == []
    assert scanner.feed("  ") == []
    assert scanner.feed(", ") == [("n", 42)]
    assert scanner.feed('"t": tru') == []
    assert scanner.feed("e}") == [("t", True)]


def test_closed_string_and_object_wait_for_delimiter():
    scanner = JsonMembers()
    assert scanner.feed('{"a": "done"') == []
    assert scanner.feed(' \n') == []
    assert scanner.feed(',"b": {"x": [1]}') == [("a", "done")]
    assert scanner.feed("}") == [("b", {"x": [1]})]


def test_nested_values_and_tricky_strings():
    doc = '{"args": {"sql": "select \'a}\' , \\"b]\\" from t", "list": [1, {"z": "\\\\"}]}, "q": "\\\\\\"}"}'
    assert feed_chunks(doc, [1] * len(doc))[1] == [
        ("args", {"sql": "select 'a}' , \"b]\" from t", "list": [1, {"z": "\\"}]}), ("q", '\\"}')]
    doc = '["\\u0041\\u00e9\\ud83d\\ude00", "\\/\\b\\f\\r"]'
    assert feed_chunks(doc, [1] * len(doc))[1] == [(0, "Aé😀"), (1, "/\b\f\r")]


def test_kind_and_done():
    scanner = JsonMembers()
    assert scanner.kind is None and not scanner.done
    scanner.feed("  \n ")
    assert scanner.kind is None
    scanner.feed("[")
    assert scanner.kind == "array" and not scanner.done
    assert scanner.feed("1, 2") == [(0, 1)]
    assert not scanner.done
    assert scanner.feed("]") == [(1, 2)]
    assert scanner.done and scanner.broken is None


@pytest.mark.parametrize("doc", ["{}", "[]", "  {\n}", "[ \t]"])
def test_empty_containers(doc):
    scanner, got = feed_chunks(doc, [1] * len(doc))
    assert got == [] and scanner.done and scanner.broken is None


@pytest.mark.parametrize("doc", ['"a string, {not} [an] object"', "42", "true", "null", "  x{}", "}"])
def test_top_level_scalar_reports_nothing(doc):
    scanner, got = feed_chunks(doc, [1] * len(doc))
    assert got == [] and scanner.kind is None and not scanner.done
    assert "not an object or array" in scanner.broken
    assert scanner.feed('{"a": 1}') == []


def test_text_after_the_end_is_ignored():
    scanner = JsonMembers()
    assert scanner.feed('{"a": 1} trailing, "b": 2}') == [("a", 1)]
    assert scanner.done
    assert scanner.feed(', "c": 3}') == [] and scanner.feed("garbage ]}") == []
    assert scanner.broken is None


@pytest.mark.parametrize("doc, why", [
    ('{"a": 1, "b": tru}', "'b'"),
    ('{"a": 1, "b": 2,}', "expected"),
    ('{, "a": 1}', "expected"),
    ('{"a" 1, "b": 2}', "expected"),
    ('{1: 2}', "not a string"),
    ('{["k"]: 2}', "not a string"),
    ('{bad: 2}', "not valid JSON"),
    ('{"a": 1: 2}', "unexpected ':'"),
    ('[1: 2]', "unexpected ':'"),
    ('{"a": [1, 2}', "mismatched"),
    ('[{"a": 1]]', "mismatched"),
    ('{"a": 1]', "mismatched"),
    ('[1, 2,]', "not valid JSON"),
    ('[, 1]', "not valid JSON"),
    ('[1 2]', "not valid JSON"),
    ('["a" "b"]', "not valid JSON"),
])
def test_malformed_sets_broken_without_raising(doc, why):
    for sizes in ([len(doc)], [1] * len(doc)):
        scanner, got = feed_chunks(doc, sizes)
        assert scanner.broken is not None and why in scanner.broken, scanner.broken
        assert not scanner.done
        assert scanner.feed(', "z": 1}]') == []


def test_members_before_the_error_are_still_reported():
    scanner = JsonMembers()
    assert scanner.feed('{"ok": [1], "bad": 1 2, "never": 3}') == [("ok", [1])]
    assert "'bad'" in scanner.broken and "at character" in scanner.broken


def test_long_value_streamed_in_tiny_deltas_is_linear():
    text = "x\\\"," * 25_000
    doc = '{"code": "' + text + '", "n": 1}'
    scanner, got = feed_chunks(doc, [1] * len(doc))
    assert got == members(doc) and scanner.done
    assert scanner._parts == []

"""Prompt sets and tool schemas shared by the speculative-decoding benchmarks (spec, toolcall,
batch-sweep). Chat messages in OpenAI form; the engine renders them with the model's template.

SPEC_PROMPTS: four kinds of text whose continuations differ in how much they repeat the context
(prose: little; code and JSON-like: some; an agent transcript: a lot). TOOLS: realistic tool
schemas (OpenAI tool dicts) written for the benchmarks; TOOLCALL_PROMPTS: user requests that each
call for one of them.
"""
from __future__ import annotations

import json

# ---- tools ------------------------------------------------------------------------------------


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required,
                           "additionalProperties": False},
        },
    }


def _str(max_length: int, **extra) -> dict:
    # Every string is bounded, as a production tool schema would be (a path, a ticker, an email
    # body all have limits): a model that loops inside a string value then still closes the call.
    return {"type": "string", "maxLength": max_length, **extra}


TOOLS: list[dict] = [
    _tool("get_weather", "Current weather for a city.",
          {"city": _str(64), "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("web_search", "Search the web and return the top results.",
          {"query": _str(160), "num_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query", "num_results"]),
    _tool("sql_query", "Run a read-only SQL query against the analytics database.",
          {"database": {"type": "string", "enum": ["sales", "users", "inventory"]}, "query": _str(240)},
          ["database", "query"]),
    _tool("read_file", "Read a text file from the workspace.", {"path": _str(120)}, ["path"]),
    _tool("write_file", "Write text to a file in the workspace, replacing it.",
          {"path": _str(120), "content": _str(240)}, ["path", "content"]),
    _tool("create_calendar_event", "Create an event in the user's calendar.",
          {"title": _str(80), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
           "start_time": {"type": "string", "pattern": "^[0-9]{2}:[0-9]{2}$"},
           "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}},
          ["title", "date", "start_time", "duration_minutes"]),
    _tool("send_email", "Send an email.", {"to": _str(64), "subject": _str(80), "body": _str(240)},
          ["to", "subject", "body"]),
    _tool("convert_units", "Convert a quantity between units.",
          {"value": {"type": "number", "minimum": -1e9, "maximum": 1e9}, "from_unit": _str(24), "to_unit": _str(24)},
          ["value", "from_unit", "to_unit"]),
    _tool("get_stock_price", "Latest price of a stock by ticker symbol.",
          {"ticker": {"type": "string", "pattern": "^[A-Z.]{1,6}$"}}, ["ticker"]),
    _tool("translate_text", "Translate text into another language.",
          {"text": _str(200), "target_language": _str(32)}, ["text", "target_language"]),
]


# (user request, the tool a correct answer calls): the expected tool is reported, not enforced.
TOOLCALL_REQUESTS: list[tuple[str, str]] = [
    ("What's the weather like in Paris right now? Use celsius.", "get_weather"),
    ("Is it cold in Toronto today? I want the temperature in fahrenheit.", "get_weather"),
    ("Search the web for the latest news about fusion energy, 5 results.", "web_search"),
    ("Find me 3 web pages about how to repot a monstera plant.", "web_search"),
    ("How many orders did we have last month? Query the sales database.", "sql_query"),
    ("List the 10 users who signed up most recently, from the users database.", "sql_query"),
    ("Which products in the inventory database have fewer than 5 items in stock?", "sql_query"),
    ("Open the file notes/todo.md and show me what's in it.", "read_file"),
    ("Read the config file at config/settings.yaml.", "read_file"),
    ("Save the text 'Meeting moved to Friday' into the file memo.txt.", "write_file"),
    ("Create a file hello.py containing print('hello world').", "write_file"),
    ("Put a 30 minute meeting called Project sync on 2025-03-14 at 10:00 in my calendar.", "create_calendar_event"),
    ("Book 'Dentist' on 2025-04-02 at 15:30 for 45 minutes.", "create_calendar_event"),
    ("Email alice@example.com with the subject 'Lunch' and ask if she is free on Thursday.", "send_email"),
    ("Send bob@example.com an email titled 'Report' saying the report is attached.", "send_email"),
    ("Convert 5 miles to kilometers.", "convert_units"),
    ("How many pounds is 72 kilograms?", "convert_units"),
    ("What is 350 fahrenheit in celsius?", "convert_units"),
    ("What's the current price of Apple stock (AAPL)?", "get_stock_price"),
    ("Check the stock price for NVDA.", "get_stock_price"),
    ("Translate 'Where is the train station?' into German.", "translate_text"),
    ("How do you say 'thank you very much' in Japanese? Translate it.", "translate_text"),
    ("Look up the weather in Tokyo in celsius.", "get_weather"),
    ("Search the web for 'best hiking trails near Denver', give me 4 results.", "web_search"),
]

TOOLCALL_SYSTEM = "You are a helpful assistant. Answer every request by calling exactly one tool."

# Requests that need several calls in one turn (parallel tool calls: the output is a JSON list).
MULTI_CALL_REQUESTS: list[str] = [
    "What's the weather in Paris, Berlin and Madrid? Use celsius.",
    "Get the stock prices of AAPL, MSFT, NVDA and AMZN.",
    "Search the web for fusion energy news (3 results) and for solar panel prices (5 results).",
    "Translate 'good morning' into French, German, Italian and Spanish.",
    "Read the files notes/a.md, notes/b.md and notes/c.md.",
    "Convert 5 miles to kilometers, 10 pounds to kilograms and 100 fahrenheit to celsius.",
]
MULTI_CALL_SYSTEM = "You are a helpful assistant. Answer with a JSON list of every tool call the request needs."


def multi_call_messages() -> list[list[dict]]:
    return [[{"role": "system", "content": MULTI_CALL_SYSTEM}, {"role": "user", "content": q}] for q in MULTI_CALL_REQUESTS]


def toolcall_messages() -> list[list[dict]]:
    return [[{"role": "system", "content": TOOLCALL_SYSTEM}, {"role": "user", "content": q}] for q, _ in TOOLCALL_REQUESTS]


# ---- the four spec prompt kinds ---------------------------------------------------------------

_PROSE = [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle. "
                                       "Describe the sea, the weather and what the message says."}]

_CODE = [{"role": "user", "content": (
    "Here is a Python class:\n\n"
    "class Stack:\n"
    "    def __init__(self):\n"
    "        self.items = []\n\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n\n"
    "    def pop(self):\n"
    "        if not self.items:\n"
    "            raise IndexError('pop from empty stack')\n"
    "        return self.items.pop()\n\n"
    "Write a Queue class in the same style, with enqueue, dequeue, peek, is_empty and size methods, "
    "and add a docstring to every method."
)}]

_INVENTORY = [
    {"id": 101, "name": "steel bolt", "category": "hardware", "price": 0.25, "in_stock": True},
    {"id": 102, "name": "copper wire", "category": "electrical", "price": 3.5, "in_stock": True},
    {"id": 103, "name": "wood screw", "category": "hardware", "price": 0.1, "in_stock": False},
    {"id": 104, "name": "light switch", "category": "electrical", "price": 4.75, "in_stock": True},
]

_JSONISH = [{"role": "user", "content": (
    "Here are inventory records as JSON, one per line:\n"
    + "\n".join(json.dumps(r) for r in _INVENTORY)
    + "\n\nAdd six more records in exactly the same format (ids 105 to 110, other hardware and "
    "electrical items), one JSON object per line, nothing else."
)}]

_CITIES = [
    ("Paris", 14, "cloudy", 72), ("Berlin", 11, "rain", 81), ("Madrid", 22, "sunny", 35),
    ("Rome", 19, "sunny", 48), ("Vienna", 12, "cloudy", 66),
]


def _agent_transcript() -> list[dict]:
    """A ReAct-style multi-step tool-use transcript: the same call and result shape per city, then a
    request for a report built from the tool results (SmolLM2-135M answers by replaying the steps)."""
    system = (
        "You are a travel assistant agent. You can call tools by writing a line\n"
        'Action: {"name": <tool>, "arguments": {...}}\n'
        "and you will get the result back as JSON. Tools:\n"
        + json.dumps(TOOLS[0]["function"]) + "\n"
        + json.dumps(TOOLS[6]["function"]) + "\n"
        "Think step by step, one city per step, and always use the same format."
    )
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": "Check the weather in Paris, Berlin, Madrid, Rome, Vienna, Prague and Lisbon, "
                                        "then give me a summary with one line per city."}]
    for i, (city, temp, cond, hum) in enumerate(_CITIES, 1):
        call = {"name": "get_weather", "arguments": {"city": city, "unit": "celsius"}}
        msgs.append({"role": "assistant", "content": f"Step {i}: I will check the weather in {city}.\nAction: {json.dumps(call)}"})
        result = {"city": city, "temperature": temp, "unit": "celsius", "condition": cond, "humidity": hum}
        msgs.append({"role": "tool", "content": json.dumps(result)})
    msgs.append({"role": "user", "content": "Now write the final report. For every city, copy its tool result JSON "
                                            "exactly on one line, then one short sentence about it."})
    return msgs


SPEC_PROMPTS: dict[str, list[dict]] = {
    "prose": _PROSE,
    "code": _CODE,
    "json": _JSONISH,
    "agent": _agent_transcript(),
}


def mixed_prompts(n: int) -> list[list[dict]]:
    """n chat prompts cycling over the spec kinds and the tool-call requests (as plain chats):
    the mixed traffic of batch-sweep."""
    pool = list(SPEC_PROMPTS.values()) + [[{"role": "user", "content": q}] for q, _ in TOOLCALL_REQUESTS]
    return [pool[i % len(pool)] for i in range(n)]

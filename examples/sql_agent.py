"""SQL agent: answers a question from an SQLite database of a small shop, which this example
creates (deterministic data) in the temp directory on first use. The schema is inspected first;
then an agent loop queries, reads the rows or the SQL error (and repairs the query), and answers.
The tools are described to the model by the engine (structured output); the system prompt only
says how to work. The first step must query (tool_choice="required_first"): left to choose, a
small model mostly answers at once from the table names, making the numbers up.

    agentrt run examples/sql_agent.py
    agentrt run examples/sql_agent.py --input question="Which city has the most customers?"

    schema (inspect_schema) ── agent loop: LLM ─ run_query ─ LLM ─ run_query ─ ... ─ answer (at most 4 LLM steps;
                                           the first one calls run_query)
"""
from __future__ import annotations

import os
import random
import sqlite3
import tempfile
from pathlib import Path
from typing import Annotated, Optional

from pydantic import Field

from agentrt.dag import Program
from agentrt.tools import ToolRaisedError, tool

DB_VERSION = 2
MAX_ROWS = 20
CITIES = ["Lyon", "Lisbon", "Oslo", "Leeds", "Porto", "Graz", "Turin", "Ghent"]
FIRST = ["Ana", "Ben", "Chloe", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jade", "Karim", "Lena",
         "Mateo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sami", "Tess"]
LAST = ["Silva", "Berg", "Martin", "Rossi", "Novak", "Costa", "Meyer", "Dubois", "Olsen", "Moreau"]
PRODUCTS = [("Espresso beans 1kg", "coffee", 24.0), ("Filter beans 500g", "coffee", 13.5),
            ("Ceramic mug", "kitchen", 9.0), ("Pour-over kettle", "kitchen", 42.0), ("Hand grinder", "kitchen", 58.0),
            ("Green tea 100g", "tea", 8.5), ("Earl grey 250g", "tea", 11.0), ("Teapot", "kitchen", 35.0),
            ("Dark chocolate", "snacks", 4.5), ("Almond biscuits", "snacks", 6.0), ("Paper filters x100", "coffee", 5.0),
            ("Milk frother", "kitchen", 29.0)]
SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, joined DATE NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL,
                     order_date DATE NOT NULL);
"""


def build_database(path: Path, seed: int = 7) -> None:
    """Create the shop database at `path` (atomically: written aside, then renamed)."""
    rng = random.Random(seed)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    con = sqlite3.connect(tmp)
    try:
        con.executescript(SCHEMA)
        con.execute(f"PRAGMA user_version = {DB_VERSION}")
        customers = [(i, f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.choice(CITIES),
                      f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}") for i in range(1, 41)]
        con.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", customers)
        con.executemany("INSERT INTO products VALUES (?, ?, ?, ?)",
                        [(i, n, c, p) for i, (n, c, p) in enumerate(PRODUCTS, 1)])
        orders = [(i, rng.randint(1, 40), rng.randint(1, len(PRODUCTS)), rng.choice([1, 1, 1, 2, 2, 3]),
                   f"2025-{rng.randint(1, 6):02d}-{rng.randint(1, 28):02d}") for i in range(1, 301)]
        con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
        con.commit()
    finally:
        con.close()
    os.replace(tmp, path)


def database() -> Path:
    """The example's database, created on first use (or when its layout version changed)."""
    path = Path(tempfile.gettempdir()) / "agentrt-examples" / "shop.sqlite"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            if con.execute("PRAGMA user_version").fetchone()[0] == DB_VERSION:
                return path
    build_database(path)
    return path


def _connect() -> sqlite3.Connection:
    # Read-only: the agent may run any SELECT but cannot change the data.
    return sqlite3.connect(f"file:{database()}?mode=ro", uri=True)


@tool(idempotent=True, timeout_s=10)
def inspect_schema(table: Annotated[Optional[str], Field(description="one table to describe; all if omitted")] = None) -> dict:
    """Tables of the shop database with their columns and row counts (and sample rows for one table)."""
    with _connect() as con:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        if table is not None and table not in names:
            raise ValueError(f"no table {table!r}; tables: {', '.join(names)}")
        out = {}
        for name in [table] if table else names:
            cols = [f"{c[1]} {c[2]}" for c in con.execute(f'PRAGMA table_info("{name}")')]
            count = con.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
            out[name] = {"columns": cols, "rows": count}
            if table:
                out[name]["sample"] = [list(r) for r in con.execute(f'SELECT * FROM "{name}" LIMIT 3')]
        return out


@tool(timeout_s=10)
def run_query(sql: Annotated[str, Field(min_length=1, max_length=200, description="one SQLite SELECT statement")]) -> dict:
    """Run one read-only SQL query; the columns and up to 20 rows, or the SQLite error to fix."""
    try:
        with _connect() as con:
            cur = con.execute(sql)
            rows = cur.fetchmany(MAX_ROWS + 1)
            columns = [d[0] for d in cur.description or []]
    except sqlite3.Error as e:
        # A ToolCallError reaches the model as it is (other exceptions also name the source line).
        raise ToolRaisedError("run_query", f"SQL error: {e}") from None
    return {"columns": columns, "rows": [list(r) for r in rows[:MAX_ROWS]], "truncated": len(rows) > MAX_ROWS}


tools = [inspect_schema, run_query]

p = Program("sql_agent", inputs={"question": str}, tools=tools)
schema = p.tool("schema", "inspect_schema", args={})
p.output(p.agent_loop(
    "agent",
    system="You answer questions about a shop database by running SQLite queries. Dates are text like "
           "'2025-03-14'. Example: to count the customers who joined in 2024, run "
           "SELECT COUNT(*) FROM customers WHERE joined LIKE '2024-%'. If a query fails, fix it. "
           "When you have the rows you need, answer in one sentence.",
    prompt="Tables: {schema}\nQuestion: {question}",
    # max_tokens: a call with the longest SQL run_query takes (200 characters, up to one token each) fits
    # the penalty keeps the model from repeating a condition until the query runs out of room
    tools=["run_query"], max_steps=4, max_tokens=256, tool_choice="required_first",
    sampling={"frequency_penalty": 0.3}))
program = p.compile()

DEFAULT_INPUTS = {"question": "How many orders were placed in March 2025?"}

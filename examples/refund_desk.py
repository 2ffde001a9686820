"""Refund desk: a customer asks for a refund; the order is looked up, the refund policy for its
price is picked (a branch whose predicates read the order and whose cases are fixed texts: no
model call), the model proposes a refund under that policy, and a person approves or declines it
before any money moves (`wait_for`: the run waits, status "waiting", until the decision is
posted). Approved: the refund is issued (a write to a local ledger, not idempotent: never issued
twice, even across a server restart) and the model confirms it; declined: the model writes a
polite reply with the reviewer's note.

    agentrt run examples/refund_desk.py --answer approval='{"approved": true, "note": ""}'
    agentrt serve examples/refund_desk.py      # then POST /v1/runs/RUN_ID/input/approval {"value": {...}}

    order (lookup_order) ── policy (price <= 40? costly? else: a fixed text) ── proposal (LLM, JSON)
        ── approval (wait_for) ── approved? refund ─ reply
                                          └ no: decline
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from agentrt.dag import JsonSchema, Program
from agentrt.tools import ToolRaisedError, tool

ORDERS = {
    1041: {"order_id": 1041, "item": "Pour-over kettle", "price": 42.0, "delivered": "2025-05-02", "customer": "Nora Berg"},
    1042: {"order_id": 1042, "item": "Hand grinder", "price": 58.0, "delivered": "2025-05-09", "customer": "Ivo Costa"},
    1043: {"order_id": 1043, "item": "Teapot", "price": 35.0, "delivered": "2025-05-11", "customer": "Lena Moreau"},
}


def ledger() -> Path:
    path = Path(tempfile.gettempdir()) / "agentrt-examples" / "refunds.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@tool(idempotent=True, timeout_s=5)
def lookup_order(order_id: int) -> dict:
    """The order: item, price, delivery date and customer."""
    if order_id not in ORDERS:
        raise ToolRaisedError(f"no order {order_id}")
    return ORDERS[order_id]


@tool(timeout_s=5)
def issue_refund(order_id: int, amount: float, reason: str) -> dict:
    """Pay a refund back to the customer (appends to the refund ledger)."""
    if order_id not in ORDERS or not 0 < amount <= ORDERS[order_id]["price"]:
        raise ToolRaisedError(f"refund of {amount} on order {order_id} is not allowed")
    entry = {"order_id": order_id, "amount": round(amount, 2), "reason": reason, "time": time.time()}
    with ledger().open("a") as f:
        f.write(json.dumps(entry) + "\n")
    return {"refunded": entry["amount"], "order_id": order_id}


tools = [lookup_order, issue_refund]
DEFAULT_INPUTS = {"order_id": 1042, "message": "The grinder I got last week has a cracked handle. Can I get my money back?"}
DECISION = {"type": "object", "properties": {"approved": {"type": "boolean"}, "note": {"type": "string", "maxLength": 300}},
            "required": ["approved"], "additionalProperties": False}
PROPOSAL = {"type": "object", "properties": {
    "amount": {"type": "number", "minimum": 0, "maximum": 1000},
    "reason": {"type": "string", "maxLength": 120}}, "required": ["amount", "reason"]}


def costly(order: dict) -> bool:
    return order["price"] >= 50


p = Program("refund_desk", inputs={"order_id": int, "message": str}, tools=tools)
order = p.tool("order", "lookup_order", args={"order_id": p.input("order_id")})
policy = p.branch("policy", on=order, cases=[  # the first case whose predicate holds; each case is a constant
    (lambda o: o["price"] <= 40, "Orders up to 40 EUR: refund the full price, no questions asked."),
    (costly, "Orders of 50 EUR or more: the full price if the item arrived broken, else at most half of it."),
], default="Refund what is fair for the problem described, at most the price.")
proposal = p.llm("proposal", prompt="A customer wrote: {message}\nTheir order: {order}\nRefund policy: {policy}\n"
                                    "Propose a refund: the amount in EUR (at most the price) and a short reason.",
                 output=JsonSchema(PROPOSAL), max_tokens=64)
decision = p.wait_for("approval", DECISION,
                      prompt="Refund {proposal.amount} EUR on order {order_id} ({order.item})? Reason: {proposal.reason}")


def approved(b):
    refund = b.tool("refund", "issue_refund", args={"order_id": p.input("order_id"), "amount": proposal["amount"],
                                                   "reason": proposal["reason"]})
    return b.llm("reply", prompt="Tell {order.customer} in two sentences that {refund} was refunded for: {message}",
                 max_tokens=80)


def declined(b):
    return b.llm("decline", prompt="Tell {order.customer} in two sentences, kindly, that the refund they asked for "
                                   "({message}) was declined. Reviewer's note: {approval}", max_tokens=80)


p.output(p.branch("outcome", on=decision["approved"], cases={True: approved, False: declined}))
program = p.compile()

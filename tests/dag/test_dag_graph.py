"""The compiled IR: a frozen networkx DiGraph, scheduler queries, Mermaid/DOT export, doctests."""
import doctest
import importlib
import re

import networkx as nx
import pytest

import agentrt.dag as dag
from agentrt.dag import JsonSchema, Program
from agentrt.errors import ProgramRunError

SEARCH = {"type": "function", "function": {"name": "search", "description": "web search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}}}}


def research():
    p = Program("research", inputs={"question": str}, tools=[SEARCH])
    subs = p.llm("split", prompt="{question}", output=JsonSchema({"type": "array", "items": {"type": "string"}}))

    def body(b):
        b.tool("search", "search", args={"query": b.item})
        return b.llm("summary", prompt="{item} {search}")

    answers = p.fan_out("answers", over=subs, body=body)
    p.output(p.llm("synthesis", prompt="{question} {answers}"))
    return p.compile()


def test_graph_is_a_frozen_digraph_with_kind_and_spec():
    c = research()
    assert isinstance(c.graph, nx.DiGraph) and nx.is_frozen(c.graph)
    with pytest.raises(nx.NetworkXError):
        c.graph.add_node("x")
    with pytest.raises(AttributeError):
        c.name = "other"
    assert {n: a["kind"] for n, a in c.graph.nodes(data=True)} == {
        "question": "input", "split": "llm", "answers[*].item": "item", "answers[*].search": "tool",
        "answers[*].summary": "llm", "answers": "fan_out", "synthesis": "llm"}
    assert all(a["spec"].id == n for n, a in c.graph.nodes(data=True))
    assert c.spec("split").output.to_response_format()["json_schema"]["schema"]["type"] == "array"
    assert c.inputs == {"question": "string"} and c.output_nodes() == ["synthesis"]


def test_remaining_calls_and_critical_path_static():
    c = research()
    assert (c.remaining_calls().llm, c.remaining_calls().tool) == (3, 1)
    assert c.remaining_calls(fan_out_width=4).total == 2 + 4 * 2
    assert c.remaining_calls(done={"question", "split"}).total == 3
    # split -> search -> summary -> synthesis
    assert c.critical_path_length() == 4.0
    assert c.critical_path_length(from_node="answers[*].summary") == 2.0
    assert c.critical_path_length(weights={"tool": 5.0, "synthesis": 0.5}) == 1 + 5 + 1 + 0.5
    with pytest.raises(ProgramRunError, match=r"^nope: no such node"):
        c.critical_path_length(from_node="nope")


def test_remaining_calls_and_critical_path_follow_the_run():
    run = research().start({"question": "q"})
    run.complete("split", ["a", "b", "c"])
    assert (run.remaining_calls().llm, run.remaining_calls().tool) == (4, 3)
    run.begin("answers[0].search")
    run.complete("answers[1].search", [])
    assert run.remaining_calls().tool == 2  # a running call still remains
    assert run.critical_path_length() == 3.0  # search -> summary -> synthesis
    assert run.critical_path_length(from_node="answers[1].summary") == 2.0
    assert run.critical_path_length(from_node="answers[1].search") == 2.0  # done: weighs 0


def mermaid_edges(text):
    ids = dict(re.findall(r'^\s+(n_\w+)\W+"([^<]+)<br/>', text, re.M))
    return {(ids[a], ids[b]) for a, b in re.findall(r"^\s+(n_\w+) -(?:-|\.-)> (n_\w+)$", text, re.M)}


def dot_edges(text):
    return set(re.findall(r'^\s+"([^"]+)" -> "([^"]+)"(?: \[style=dotted\])?;$', text, re.M))


def test_mermaid_and_dot_contain_every_node_and_edge():
    c = research()
    mermaid, dot = c.to_mermaid(), c.to_dot()
    assert mermaid.startswith("flowchart TD\n") and dot.startswith('digraph "research" {')
    for node in c.graph:
        assert f'"{node}<br/>' in mermaid.replace("#quot;", '"')
        assert f'"{node}" [label="{node}\\n' in dot
    assert mermaid_edges(mermaid) == set(c.graph.edges) == dot_edges(dot)
    assert "class n_answers____item,n_answers____search,n_answers____summary template" in mermaid
    assert dot.count("style=\"dashed\"") == 3


def test_export_of_a_run_shows_expansion_and_states():
    run = research().start({"question": "q"})
    run.complete("split", ["a", "b"])
    run.begin("answers[0].search")
    mermaid, dot = run.to_mermaid(), run.to_dot()
    assert mermaid_edges(mermaid) == set(run.graph.edges) == dot_edges(dot)
    assert "answers[1].summary" in mermaid and "[*]" not in mermaid
    assert re.search(r"class [\w,]*n_answers_0__search[\w,]* running", mermaid)
    assert '"split" [label="split\\nllm -> json", shape=box, style="filled", fillcolor="#d4edda"]' in dot
    assert "fan-out over split x2" in dot


def test_branch_cases_wait_on_the_decision_by_control_edges():
    p = Program("b", inputs={"q": str}, tools=[SEARCH])
    kind = p.llm("kind", prompt="{q}", output=JsonSchema({"type": "string", "enum": ["look", "say"]}))

    def look(b):
        b.tool("search", "search", args={"query": p.input("q")})
        return b.llm("answer", prompt="{search}")

    p.output(p.branch("reply", on=kind, cases={"look": look, "say": lambda b: b.llm("say", prompt="{q}")}))
    c = p.compile()
    control = {(u, v) for u, v, d in c.graph.edges(data=True) if d.get("control")}
    assert control == {("kind", "reply?look.search"), ("kind", "reply?say.say")}
    assert c.topological_order.index("kind") < c.topological_order.index("reply?say.say")
    assert c.critical_path_length() == 3.0  # kind -> search -> answer
    mermaid, dot = c.to_mermaid(), c.to_dot()
    assert "n_kind -.-> n_reply_say_say" in mermaid and '"kind" -> "reply?look.search" [style=dotted];' in dot
    assert mermaid_edges(mermaid) == set(c.graph.edges) == dot_edges(dot)


def test_mermaid_ids_stay_unique_and_off_keywords():
    p = Program("p", inputs={"end": str})
    p.output(p.llm("a", prompt="{end} with \"quotes\" <b>"))
    text = p.compile().to_mermaid()
    assert 'n_end(["end<br/>input: string"])' in text and "n_end --> n_a" in text


def test_public_docstring_examples_run():
    names = {n: getattr(dag, n) for n in dag.__all__}
    failed = tried = 0
    for module in ("refs", "tooldefs", "outputs", "builder", "compiled", "run", "render"):
        mod = importlib.import_module(f"agentrt.dag.{module}")
        result = doctest.testmod(mod, extraglobs=names, optionflags=doctest.ELLIPSIS)
        failed, tried = failed + result.failed, tried + result.attempted
    assert failed == 0 and tried >= 40


def test_dag_imports_no_torch_engine_or_runtime():
    import subprocess
    import sys
    code = ("import sys, agentrt.dag; bad = [m for m in sys.modules if m == 'torch' or m.startswith(("
            "'agentrt.engine', 'agentrt.runtime', 'agentrt.tools', 'agentrt.spec', 'agentrt.kernels'))]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

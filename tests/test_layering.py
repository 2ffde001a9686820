"""The package layering stated in docs/architecture.md holds in the imports.

The documented line (`kernels, decoding <- spec <- engine -> ...; dag <- runtime -> ...; server -> ...;
cli -> ...`) is parsed, so the doc and this test cannot drift apart: every import of one
agentrt package by another, at module level or inside a function, must be one of its arrows (a
package that skips a layer says so in the line). errors.py, files.py, jsonutil.py, retry.py and tables.py are leaves any
package may use; the command line (cli) is the top of the line, and the benchmarks sit beside it: only its bench
command imports them.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentrt"
LEAVES = {"errors", "files", "jsonutil", "retry", "tables"}
TOP = {"bench", "__init__"}


def documented_arrows() -> dict[str, set[str]]:
    """package -> the packages it may import directly, from docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    line = re.search(r"dependencies run one way: (.+?)\.\n", text)
    assert line, "docs/architecture.md no longer states the dependency line"
    deps: dict[str, set[str]] = {}
    for chain in line.group(1).split(";"):
        parts = re.split(r"\s*(<-|->)\s*", chain.strip())
        for i in range(1, len(parts) - 1, 2):
            left = [p.strip() for p in parts[i - 1].split(",")]
            right = [p.strip() for p in parts[i + 1].split(",")]
            users, used = (left, right) if parts[i] == "->" else (right, left)
            for u in users:
                deps.setdefault(u, set()).update(used)
                for d in used:
                    deps.setdefault(d, set())
    return deps


def allowed(deps: dict[str, set[str]]) -> dict[str, set[str]]:
    """The transitive closure: a package may use what the packages it uses may use."""
    closure = {p: set(d) for p, d in deps.items()}
    changed = True
    while changed:
        changed = False
        for p, reach in closure.items():
            more = set().union(*(closure[d] for d in reach)) - reach
            if more:
                reach |= more
                changed = True
    return closure


def agentrt_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level agentrt package) for every import of agentrt.X in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        out += [(node.lineno, n.split(".")[1]) for n in names if n.startswith("agentrt.")]
    return out


def owner(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_the_documented_line_parses_to_the_known_packages():
    deps = documented_arrows()
    assert deps["engine"] == {"spec", "kernels", "decoding", "structured"}
    assert deps["spec"] == {"kernels", "decoding"} and deps["structured"] == {"kernels"}
    assert deps["decoding"] == set() and deps["client"] == set()
    assert deps["runtime"] == {"dag", "engine", "spec", "structured", "tools", "client"}
    assert deps["server"] == {"runtime", "spec", "structured", "tools", "dag", "client"}
    assert deps["cli"] >= {"server", "runtime", "engine", "bench"} and not any("cli" in d for d in deps.values())
    assert allowed(deps)["cli"] >= {"kernels", "dag"} and "runtime" not in allowed(deps)["engine"]


def test_imports_follow_the_documented_arrows():
    arrows = documented_arrows()
    reach = allowed(arrows)
    packages = {owner(p) for p in PACKAGE.rglob("*.py")}
    undocumented = packages - set(reach) - LEAVES - TOP
    assert not undocumented, f"packages missing from docs/architecture.md's dependency line: {sorted(undocumented)}"
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        src = owner(path)
        if src in TOP:
            continue
        for line, dst in agentrt_imports(path):
            ok = dst == src or dst in LEAVES or (src not in LEAVES and dst in arrows.get(src, set()))
            if not ok:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {dst}")
    assert not wrong, "imports against the documented direction:\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", ["dag", "tools", "client"])
def test_packages_without_a_model_import_no_torch(package):
    for path in (PACKAGE / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "torch" or m.startswith("torch.") for m in mods), f"{path} imports torch"


def module_imports(path: Path) -> set[str]:
    """The agentrt modules a file imports (at module level or inside a function; imports under
    `if TYPE_CHECKING:` are for annotations only and never run, so they are left out)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("agentrt")}


def test_no_two_modules_import_each_other_directly_or_in_a_loop():
    import networkx as nx

    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path

    def module_of(name: str) -> str | None:  # agentrt.x.y.Name -> agentrt.x.y
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    for name, path in modules.items():
        for imported in module_imports(path):
            target = module_of(imported)
            # a package's __init__ re-exports its modules: that is not a loop back to it
            if target and target != name and not (path.name == "__init__.py" and target.startswith(name + ".")):
                graph.add_edge(name, target)
    loops = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not loops, "modules that import each other (directly or in a loop): " + "; ".join(" <-> ".join(c) for c in loops)


ENGINE_LEAVES = {"config", "sampling_params", "outputs"}


def test_engine_subpackages_import_one_way():
    """The engine's subpackages (step, loading, chat, models, kv) import each other in one direction only,
    and of the engine's top-level modules they use only the leaves (config, sampling_params, outputs):
    llm_engine, async_engine and calibration put the subpackages together, so nothing below imports them."""
    import networkx as nx

    engine = PACKAGE / "engine"
    subpackages = {p.name for p in engine.iterdir() if (p / "__init__.py").is_file()}
    graph, upward = nx.DiGraph(), set()
    for path in engine.rglob("*.py"):
        rel = path.relative_to(engine).parts
        if len(rel) == 1:
            continue
        for imported in module_imports(path):
            first = imported.split(".")[2:3]
            if not first or first[0] == rel[0]:
                continue
            if first[0] in subpackages:
                graph.add_edge(rel[0], first[0])
            elif (engine / f"{first[0]}.py").is_file() and first[0] not in ENGINE_LEAVES:
                upward.add(f"{path.relative_to(ROOT)} imports agentrt.engine.{first[0]}")
    assert {"step", "loading", "chat", "models", "kv"} <= subpackages
    loops = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not loops, "engine subpackages that import each other (directly or in a loop): " + "; ".join(" <-> ".join(c) for c in loops)
    assert not upward, "engine subpackages importing the modules that assemble them:\n" + "\n".join(sorted(upward))

"""The house's imports, read from the source: no cycle among the product's modules, and every import
flows one way (docs/architecture.md): schema <- infra <- activities <- workflows <- the top floor,
the trainer beside them on schema alone; on the top floor, the CLI above what it drives and the docs
generator above the CLI. The controller never imports torch, the trainer never temporalio.

Imports under `if TYPE_CHECKING:` are left out: they are annotations, never executed."""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lazarus"

FLOORS = {"schema": 0, "infra": 1, "activities": 2, "workflows": 3}
"""The controller's floors, lowest first; every other module of the package but the trainer is the top floor (4)."""
TOP = 4
CLI = ("lazarus.cli", "lazarus.commands")
"""The top floor's highest part but one: the commands, which drive the rest of the top floor."""
DOCS_GENERATOR = ("lazarus.reference",)
"""Above the CLI: it documents it."""


def module_files() -> dict[str, Path]:
    """Every module of the package (its floors are links into it) by dotted name."""
    modules = {}
    for folder, _, files in os.walk(PACKAGE, followlinks=True):
        if "__pycache__" in folder or "rank_hook" in folder:
            continue  # rank_hook holds a file loaded by path into a rank, never imported
        for name in files:
            if name.endswith(".py"):
                path = Path(folder) / name
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
                dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules[dotted] = path
    return modules


def _runtime_imports(tree: ast.Module):
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:`."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(the package's modules `name` imports, the top-level names of the others it imports)."""
    inside, outside = set(), set()
    is_package = path.name == "__init__.py"
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for target in targets:
            if target.split(".")[0] != "lazarus":
                outside.add(target.split(".")[0])
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                inside.add(target)
    return inside, outside


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> the package's modules it imports, module -> the other packages it imports)."""
    modules = module_files()
    graph, foreign = {}, {}
    for name, path in modules.items():
        graph[name], foreign[name] = imports_of(name, path, modules)
    return graph, foreign


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _within(module: str, parts: tuple[str, ...]) -> bool:
    return any(module == part or module.startswith(part + ".") for part in parts)


def floor(module: str) -> float:
    """How high `module` sits: the controller's floors 0-3, the top floor 4, its CLI 4.5, the docs
    generator 4.75; the trainer is apart (-1)."""
    part = module.split(".")[1] if "." in module else ""
    if part == "trainer":
        return -1
    if part in FLOORS:
        return FLOORS[part]
    if _within(module, DOCS_GENERATOR):
        return TOP + 0.75
    if _within(module, CLI):
        return TOP + 0.5
    return TOP


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module by one below it, and every import across the trainer's boundary
    (the trainer imports schema only; of the controller only `lazarus.session`, the script SDK's
    door, imports the trainer)."""
    wrong = []
    for module, targets in graph.items():
        for target in targets:
            here, there = floor(module), floor(target)
            if here == -1:
                bad = there not in (-1, 0)
            elif there == -1:
                bad = module != "lazarus.session"
            else:
                bad = there > here
            if bad:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_no_import_cycle_in_the_product():
    graph, _ = import_graph()
    assert len(graph) > 100, "the package's modules were not found"
    assert cycles(graph) == []


def test_imports_flow_one_way():
    graph, _ = import_graph()
    assert upward_imports(graph) == []


def test_the_controller_never_imports_torch_and_the_trainer_never_temporalio():
    graph, foreign = import_graph()
    controller = [m for m in graph if floor(m) >= 0 and m != "lazarus.session"]
    assert sorted(m for m in controller if "torch" in foreign[m]) == []
    assert sorted(m for m in graph if floor(m) == -1 and "temporalio" in foreign[m]) == []


def test_the_checks_find_what_they_look_for():
    """The checks above can fail: a made-up cycle and upward imports are found."""
    made_up = {"lazarus.schema.a": {"lazarus.schema.b"}, "lazarus.schema.b": {"lazarus.schema.a"}, "lazarus.c": set()}
    assert cycles(made_up) == [["lazarus.schema.a", "lazarus.schema.b"]]
    upward = {
        "lazarus.infra.x": {"lazarus.workflows.y"},
        "lazarus.demo": {"lazarus.commands.common"},
        "lazarus.trainer.sdk.session": {"lazarus.infra.z"},
        "lazarus.activities.w": {"lazarus.trainer.gpt.model"},
        "lazarus.reference": {"lazarus.cli"},
    }
    assert upward_imports(upward) == [
        "lazarus.activities.w -> lazarus.trainer.gpt.model",
        "lazarus.demo -> lazarus.commands.common",
        "lazarus.infra.x -> lazarus.workflows.y",
        "lazarus.trainer.sdk.session -> lazarus.infra.z",
    ]

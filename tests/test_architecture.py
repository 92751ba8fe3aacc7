"""The shape of the package, checked from its source: no import circle under src/, and the generic attention modules
name no architecture outside the ordered backend list (a new architecture is a backend package plus one entry)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "flashmoe_science"

# The modules that hold no kernel family of their own: the front doors, the planner, the execute layer and what
# they share. A word below in their code (docstrings excepted: they tell a user which kernels run) is an
# architecture leaking out of its backend package.
GENERIC = [f"attention/{name}.py" for name in (
    "api", "call", "plan", "problem", "autograd", "tiles", "features", "checks", "varlen", "fp8",
    "record", "reference", "reference_backend", "triton_backend")] + [
    f"attention/decode/{name}.py" for name in (
        "__init__", "api", "call", "checks", "dense_backend", "launch", "plan", "problem", "reference",
        "reference_backend", "tiles", "triton_backend")] + [
    "backends.py", "prepared_cache.py", "prepared_launch.py", "integrations/ops.py", "__init__.py"]
# names, strings (f-string pieces on Python >= 3.12) and comments
CODE_TOKENS = {tokenize.NAME, tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
ARCHITECTURE = re.compile(r"sm_?90|hopper|is_hopper", re.IGNORECASE)
# The lines allowed to name one: the ordered backend lists and their imports.
ALLOWED = {
    "attention/plan.py": {
        "from flashmoe_science.attention.hopper.backend import HOPPER, HOPPER_FP8",
        "ATTENTION_BACKENDS = (HOPPER, TRITON, REFERENCE)",
        "FP8_BACKENDS = (HOPPER_FP8, DEQUANTISED)",
    },
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module of the package `path` imports, at module level or inside a function (`from x import y` counts
    as x, and as x.y where x.y is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # an import of a.b.c also runs a and a.b (their __init__), which are modules of their own here
        graph[name] = {m for m in _imports(path) if m in modules and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_under_src():
    graph = _graph()
    # package __init__ files import their children for the public names; a child importing a sibling through the
    # package's own __init__ is not a circle of the code, so the parents' edges down to children are left out
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def test_generic_modules_name_no_architecture():
    offending = []
    for relative in GENERIC:
        path = SRC / PACKAGE / relative
        source = path.read_text()
        docstrings = _docstring_lines(ast.parse(source))
        allowed = ALLOWED.get(relative, set())
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.start[0] in docstrings or token.type not in CODE_TOKENS:
                continue
            line = source.splitlines()[token.start[0] - 1].strip()
            if ARCHITECTURE.search(token.string) and line not in allowed:
                offending.append(f"{relative}:{token.start[0]}: {line}")
    assert not offending, "\n".join(offending)


def test_the_checks_see_what_they_should():
    """The two checks above would fail on the shapes they forbid."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert ARCHITECTURE.search("device_traits(q.device).is_hopper") and ARCHITECTURE.search('"the sm_90 kernel"')
    assert all((SRC / PACKAGE / relative).exists() for relative in GENERIC)

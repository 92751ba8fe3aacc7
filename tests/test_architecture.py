"""The shape of the package, checked from its source: no import circle under src/; no module outside the architecture
packages names an architecture (the device's is read in device.py, the families listed in architectures.py: a new
architecture is a backend package plus its entries there); the portable Triton family (attention/triton/) and the
architecture packages apart but for its backend module; the custom ops imported by the front doors that call them;
the e4m3 format's constants written once."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "flashmoe_science"

# The architecture packages: the kernels of one architecture, their heuristics and backend families, the Gluon
# plumbing they share, the list of families (architectures.py) and the teaching ladder's rungs (one per GPU kernel).
ARCHITECTURE_PACKAGES = ("attention/hopper/", "moe/hopper/", "gluon/", "attention/ladder/", "architectures.py",
                         "bench/ladder.py")
# The modules that decide or describe a call: the front doors, the planners, the execute layers, what they share and
# the CLI. Not even their comments name an architecture (docstrings excepted: they tell a user which kernels run).
GENERIC = [f"attention/{name}.py" for name in (
    "api", "call", "plan", "problem", "autograd", "tiles", "features", "checks", "varlen", "fp8", "ops",
    "record", "reference", "reference_backend", "triton/backend")] + [
    f"attention/decode/{name}.py" for name in (
        "__init__", "api", "call", "checks", "dense_backend", "launch", "ops", "plan", "problem", "reference",
        "reference_backend", "tiles", "triton_backend")] + [
    f"moe/{name}.py" for name in ("__init__", "api", "plan", "execute", "ops", "fp8", "gemms", "layer", "tiles")] + [
    "backends.py", "prepared_cache.py", "prepared_launch.py", "custom_ops.py", "device.py", "cli.py", "__init__.py"]
# names, strings (f-string pieces on Python >= 3.12) and comments
CODE_TOKENS = {tokenize.NAME, tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
ARCHITECTURE = re.compile(r"sm_?90|hopper|is_hopper", re.IGNORECASE)


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


def _architecture_words(relative: str, kinds) -> list[str]:
    """Where the module `relative` names an architecture in tokens of `kinds` (docstrings excepted)."""
    source = (SRC / PACKAGE / relative).read_text()
    docstrings = _docstring_lines(ast.parse(source))
    return [f"{relative}:{token.start[0]}: {source.splitlines()[token.start[0] - 1].strip()}"
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.start[0] not in docstrings and token.type in kinds and ARCHITECTURE.search(token.string)]


def _modules() -> list[str]:
    return sorted(str(p.relative_to(SRC / PACKAGE)) for p in (SRC / PACKAGE).rglob("*.py"))


def test_generic_modules_name_no_architecture():
    offending = [line for relative in GENERIC for line in _architecture_words(relative, CODE_TOKENS)]
    assert not offending, "\n".join(offending)


def test_no_module_outside_the_architecture_packages_names_one_in_code():
    """Names and strings (comments may say where a measurement was taken)."""
    code = CODE_TOKENS - {tokenize.COMMENT}
    offending = [line for relative in _modules() if not relative.startswith(ARCHITECTURE_PACKAGES)
                 for line in _architecture_words(relative, code)]
    assert not offending, "\n".join(offending)


def test_the_portable_triton_family_and_the_architecture_packages_keep_apart():
    """attention/triton/ (the portable family) imports no architecture package; an architecture package reaches it
    only through its backend module (hopper/backend.py takes the bias gradient's buffer from it), never a kernel
    module; the Triton kernel modules import `common`, never one another (the backend imports them)."""
    graph = _graph()
    portable = f"{PACKAGE}.attention.triton"
    architectures = tuple(f"{PACKAGE}.{relative.rstrip('/').removesuffix('.py').replace('/', '.')}"
                          for relative in ARCHITECTURE_PACKAGES)

    def within(module, prefixes):
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    offending = [f"{name} -> {m}" for name, imports in graph.items() for m in imports if (
        within(name, (portable,)) and within(m, architectures)
        or within(name, architectures) and within(m, (portable,)) and m not in (portable, f"{portable}.backend")
        or within(name, (portable,)) and name not in (portable, f"{portable}.backend") and within(m, (portable,))
        and m not in (portable, f"{portable}.common"))]
    assert not offending, "\n".join(offending)
    assert f"{portable}.common" in graph[f"{portable}.fwd"] and f"{portable}.backend" in graph[
        f"{PACKAGE}.attention.hopper.backend"]


def test_the_device_architecture_is_read_in_device_py():
    """Capabilities come from device.device_traits: no other module asks torch for one or unpacks one (bench/report
    records the GPU's properties beside published numbers)."""
    reads = re.compile(r"get_device_capability|capability\[|\.major\b")
    offending = [f"{relative}:{n}: {line.strip()}" for relative in _modules()
                 if relative not in ("device.py", "bench/report.py")
                 for n, line in enumerate((SRC / PACKAGE / relative).read_text().splitlines(), 1)
                 if reads.search(line)]
    assert not offending, "\n".join(offending)


def _calls_ops_namespace(relative: str) -> bool:
    tree = ast.parse((SRC / PACKAGE / relative).read_text())
    return any(isinstance(node, ast.Attribute) and node.attr == PACKAGE and isinstance(node.value, ast.Attribute)
               and node.value.attr == "ops" for node in ast.walk(tree))


def test_custom_ops_are_imported_by_the_front_doors_that_call_them():
    """No module reaches an op through `torch.ops.flashmoe_science` (which holds only what some import registered
    as a side effect); every module registering ops (`custom_op(`) is imported by a front door."""
    assert not [relative for relative in _modules() if _calls_ops_namespace(relative)]
    registering = {relative for relative in _modules()
                   if "custom_op(" in (SRC / PACKAGE / relative).read_text() and relative != "custom_ops.py"}
    assert registering == {"attention/ops.py", "attention/decode/ops.py", "moe/ops.py"}
    graph = _graph()
    for relative in registering:
        module = f"{PACKAGE}.{relative[:-3].replace('/', '.')}"
        front_doors = [name for name, imports in graph.items() if module in imports and name.endswith(".api")]
        assert front_doors, f"{module}: no front door imports it"


def test_the_e4m3_constants_are_written_once():
    """torch.float8_e4m3fn and its largest value 448 are module constants of fp8_format.py only (the Gluon kernels'
    packages keep their own names for their kernels)."""
    assignment = re.compile(r"^\w+\s*=\s*(torch\.float8_e4m3fn|448(\.0)?)\b")
    offending = [f"{relative}:{n}" for relative in _modules()
                 if relative != "fp8_format.py" and not relative.startswith(ARCHITECTURE_PACKAGES)
                 for n, line in enumerate((SRC / PACKAGE / relative).read_text().splitlines(), 1)
                 if assignment.search(line)]
    assert not offending, offending


def test_the_checks_see_what_they_should():
    """The two checks above would fail on the shapes they forbid."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert ARCHITECTURE.search("device_traits(q.device).is_hopper") and ARCHITECTURE.search('"the sm_90 kernel"')
    assert all((SRC / PACKAGE / relative).exists() for relative in GENERIC)


def test_every_walk_takes_the_architectures_families_from_one_list():
    """An architecture's families enter each planner's walk from architectures.py, ahead of the portable ones; the
    decode and MoE FP8 walks have none (their kernels are portable)."""
    from flashmoe_science import architectures
    from flashmoe_science.attention import plan
    from flashmoe_science.attention.decode.plan import DECODE_BACKENDS
    from flashmoe_science.moe import fp8
    from flashmoe_science.moe import plan as moe_plan

    families = {id(f) for walk in ("attention", "attention_fp8", "moe_gemms") for f in architectures.families(walk)}
    for walk, own in ((plan.ATTENTION_BACKENDS, architectures.ATTENTION),
                      (plan.FP8_BACKENDS, architectures.ATTENTION_FP8),
                      (moe_plan.GEMM_BACKENDS, architectures.MOE_GEMMS),
                      (DECODE_BACKENDS, ()), (fp8.FP8_LAYER_BACKENDS, ())):
        assert tuple(walk[:len(own)]) == own
        assert not any(id(family) in families for family in walk[len(own):])


def test_each_planner_loads_only_its_own_architecture_families():
    """Importing and planning attention (forward, backward, describe_dispatch) imports no MoE backend, and the MoE
    planner no attention backend: each walk imports the families architectures.py names for it (a fresh
    interpreter: the modules another test imported do not count)."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import torch
        import flashmoe_science
        from flashmoe_science import flash_attention_science
        from flashmoe_science.attention.api import describe_dispatch
        q = torch.randn(1, 2, 16, 32, requires_grad=True)
        flash_attention_science(q, q, q, causal=True).sum().backward()
        describe_dispatch(q, q, q)
        assert "flashmoe_science.attention.hopper.backend" in sys.modules
        assert not [m for m in sys.modules if m.startswith("flashmoe_science.moe.hopper")], "attention"
        from flashmoe_science.moe import plan
        assert "flashmoe_science.moe.hopper.backend" in sys.modules
    """)
    moe_first = textwrap.dedent("""
        import sys
        from flashmoe_science.moe.plan import GEMM_BACKENDS
        from flashmoe_science.moe import api
        assert "flashmoe_science.moe.hopper.backend" in sys.modules
        assert not [m for m in sys.modules if m.startswith("flashmoe_science.attention.hopper")], "moe"
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    for source in (code, moe_first):
        child = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, env=env, timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]
